"""Where a prefix-cache hit's prefill step spends its time (issue 21): request A (a prefix plus a
few tokens) warms the cache, then B (the same prefix, other tail) runs under torch.profiler; prints
the step's wall time, the ops with the most host time and the most device time.

python benchmarks/profile_prefix_hit.py --preset qwen3_5_9b --device cuda --dtype bfloat16
"""
import argparse
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import add_model_args, resolve_model, synchronize  # noqa: E402

from lmdeploy_lite.messages import GenerationConfig, PytorchEngineConfig  # noqa: E402
from lmdeploy_lite.pytorch.engine.build import build_engine  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser, dtype='bfloat16', device='cuda')
    parser.add_argument('--prefix-tokens', type=int, default=1500)
    parser.add_argument('--tail-tokens', type=int, default=20)
    parser.add_argument('--rows', type=int, default=25)
    args = parser.parse_args()
    path, load_format = resolve_model(args)
    engine = build_engine(path, PytorchEngineConfig(dtype=args.dtype, device=args.device,
                                              load_format=load_format, session_len=4096,
                                              max_batch_size=8), progress=False)
    device = engine.device
    rng = random.Random(0)
    prefix = [rng.randrange(3, min(10000, engine.model_config.vocab_size - 1)) for _ in range(args.prefix_tokens)]
    gen = GenerationConfig(max_new_tokens=1, ignore_eos=True)

    def tail():
        return [rng.randrange(3, min(10000, engine.model_config.vocab_size - 1)) for _ in range(args.tail_tokens)]

    def timed_steps(prompt):
        seq = engine.add_request(prompt, gen)
        times = []
        while engine.has_work:
            synchronize(device)
            start = time.perf_counter()
            engine.step()
            synchronize(device)
            times.append(1000 * (time.perf_counter() - start))
        return seq, times

    for _ in range(3):                       # compiles, and the first hits
        timed_steps(prefix + tail())
        timed_steps(prefix + tail())
    miss, miss_ms = timed_steps([t + 1 if t + 2 < engine.model_config.vocab_size else 3 for t in prefix] + tail())
    hit, hit_ms = timed_steps(prefix + tail())
    print(f'miss: steps {[round(t, 1) for t in miss_ms]} ms, cached {miss.num_cached_tokens}')
    print(f'hit:  steps {[round(t, 1) for t in hit_ms]} ms, cached {hit.num_cached_tokens}')
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.type == 'cuda':
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    engine.add_request(prefix + tail(), gen)
    with torch.profiler.profile(activities=acts) as prof:
        while engine.has_work:
            engine.step()
        synchronize(device)
    table = prof.key_averages()
    print(table.table(sort_by='self_cpu_time_total', row_limit=args.rows))
    if device.type == 'cuda':
        print(table.table(sort_by='self_cuda_time_total', row_limit=args.rows // 2))


if __name__ == '__main__':
    main()
