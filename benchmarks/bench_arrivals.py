"""A wave of prompts arriving beside decoding streams, as a server's clients send them: `--streams`
sequences decode, then `--arrivals` prompts of `--prompt-len` tokens come at once; every step until
they have their first tokens and a few after, with its wall time, rows, prompt tokens and whether
it replayed a prefill graph (the engine as `serve` builds it: async scheduling, graphs, prefix
caching on).

    python benchmarks/bench_arrivals.py --preset qwen3_5_0_8b --device cuda --dtype bfloat16 \
        --streams 48 --arrivals 16 --prompt-len 170
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_itl import random_prompts  # noqa: E402
from common import add_model_args, resolve_model, synchronize  # noqa: E402
from profile_mixed import profiled_step  # noqa: E402

from lmdeploy_lite.messages import GenerationConfig, PytorchEngineConfig  # noqa: E402
from lmdeploy_lite.pytorch.engine.build import build_engine  # noqa: E402


def wave(engine, streams: int, arrivals: int, prompt_len: int, seed: int,
         profile: bool = False) -> list[dict]:
    vocab = engine.model_config.vocab_size
    gen = GenerationConfig(max_new_tokens=512, ignore_eos=True)
    seqs = [engine.add_request(p, gen) for p in random_prompts(streams, 128, vocab, seed)]
    while not all(s.num_generated > 2 for s in seqs):
        engine.step()
    for _ in range(4):
        engine.step()
    runner, used = engine.agent.prefill_graph, []
    if runner is not None:
        bucket_for = runner.bucket_for
        runner.bucket_for = lambda inputs: used.append(bucket_for(inputs)) or used[-1]
    kinds, schedule = [], engine.scheduler.schedule

    def record(batch):
        if batch is not None:
            kinds.append((len(batch.seqs), sum(n for s, n in zip(batch.seqs, batch.q_lens)
                                               if not s.prefilled)))
        return batch
    engine.scheduler.schedule = lambda: record(schedule())
    new = [engine.add_request(p, GenerationConfig(max_new_tokens=4, ignore_eos=True))
           for p in random_prompts(arrivals, prompt_len, vocab, seed + 1)]
    steps, extra = [], 3
    while extra:
        before, calls = len(kinds), len(used)
        if profile:
            step = profiled_step(engine)
            step = {k: step[k] for k in ('kernels_ms', 'families', 'launches', 'wall_ms')} | {
                'top': dict(list(step['top'].items())[:20])}
        else:
            start = time.perf_counter()
            engine.step()
            step = {'wall_ms': 1000 * (time.perf_counter() - start)}
        steps.append({**step,
                      'rows_tokens': kinds[-1] if len(kinds) > before else None,
                      'graph': used[-1] if len(used) > calls else None})
        extra -= all(s.num_generated >= 1 for s in new)
    for s in seqs + new:
        engine.abort(s)
    while engine.has_work:
        engine.step()
    synchronize(engine.device)
    return steps


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser)
    parser.add_argument('--streams', type=int, default=48)
    parser.add_argument('--arrivals', type=int, default=16)
    parser.add_argument('--prompt-len', type=int, default=170)
    parser.add_argument('--max-mixed-tokens', type=int, default=4096)
    parser.add_argument('--session-len', type=int, default=4096)
    parser.add_argument('--max-batch-size', type=int, default=None,
                        help='default: streams + arrivals (the server: 256, so a prefill '
                        "graph's buckets hold 257 rows)")
    parser.add_argument('--eager', action='store_true')
    parser.add_argument('--profile', action='store_true', help='each step of the wave on its own '
                        '(device synchronized before and after) under torch.profiler: kernel ms')
    parser.add_argument('--out', default=None)
    args = parser.parse_args()
    path, load_format = resolve_model(args)
    engine = build_engine(path, PytorchEngineConfig(
        dtype=args.dtype, device=args.device, load_format=load_format,
        max_batch_size=args.max_batch_size or args.streams + args.arrivals,
        session_len=args.session_len,
        max_mixed_token_num=args.max_mixed_tokens, eager_mode=args.eager), progress=False)
    wave(engine, 4, 4, args.prompt_len, 100)                                    # warm-up
    steps = wave(engine, args.streams, args.arrivals, args.prompt_len, 0, args.profile)
    print(f'{args.streams} streams, {args.arrivals} prompts of {args.prompt_len} tokens arrive')
    print(f'{"step":>4} {"wall ms":>8} {"rows":>5} {"prompt tok":>10} graph bucket')
    for i, s in enumerate(steps):
        rows, tokens = s['rows_tokens'] or ('-', '-')
        print(f'{i:4d} {s["wall_ms"]:8.2f} {rows:>5} {tokens:>10} {s["graph"]}'
              + (f'  kernels {s["kernels_ms"]:.2f} ms in {s["launches"]}: ' + ', '.join(
                  f'{f} {ms:.2f}' for f, ms in sorted(s['families'].items(), key=lambda x: -x[1])
                  [:6]) if 'kernels_ms' in s else ''))
    if args.out:
        with open(args.out, 'w') as f:
            json.dump({'args': vars(args), 'steps': steps}, f, indent=1)


if __name__ == '__main__':
    main()
