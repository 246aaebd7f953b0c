"""Where an eager prefill step's host time goes (issue 38): cProfile over one engine step of a
fresh `--tokens` prompt (after two warm-ups), top functions by own time and by cumulative time.

python benchmarks/profile_prefill_host.py --preset qwen3_5_0_8b --device cuda --dtype bfloat16
"""
import argparse
import cProfile
import os
import pstats
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import add_model_args, resolve_model, synchronize  # noqa: E402

from lmdeploy_lite.messages import GenerationConfig, PytorchEngineConfig  # noqa: E402
from lmdeploy_lite.pytorch.engine.build import build_engine  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser, dtype='bfloat16', device='cuda')
    parser.add_argument('--tokens', type=int, default=2048)
    parser.add_argument('--rows', type=int, default=30)
    args = parser.parse_args()
    path, load_format = resolve_model(args)
    engine = build_engine(path, PytorchEngineConfig(
        dtype=args.dtype, device=args.device, load_format=load_format, session_len=16384,
        max_batch_size=8, max_prefill_token_num=16384, enable_prefix_caching=False),
        progress=False)
    rng = random.Random(0)
    vocab = min(10000, engine.model_config.vocab_size - 1)
    gen = GenerationConfig(max_new_tokens=1, ignore_eos=True)

    def step():
        engine.add_request([rng.randrange(3, vocab) for _ in range(args.tokens)], gen)
        synchronize(engine.device)
        engine.step()
        while engine.has_work:
            engine.step()
        synchronize(engine.device)

    step()
    step()
    profile = cProfile.Profile()
    profile.enable()
    step()
    profile.disable()
    stats = pstats.Stats(profile)
    stats.sort_stats('tottime').print_stats(args.rows)
    stats.sort_stats('cumtime').print_stats(args.rows)


if __name__ == '__main__':
    main()
