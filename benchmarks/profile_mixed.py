"""Where a mixed step's device time goes: `--streams` decode rows with a long prompt's chunks
beside them, each step run on its own (synchronous scheduling, the device synchronized before
and after) under torch.profiler; per step its wall time, kernel time by family and the span from
first to last kernel. `--streams 0`: the same chunks with no decode rows (what the chunks
cost alone), and a decode step without a chunk for the rows' own cost.

    python benchmarks/profile_mixed.py --preset qwen3_5_0_8b --max-mixed-tokens 1024
        [--streams 32 --long-prompt-len 8192] [--eager]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_itl import random_prompts  # noqa: E402
from common import add_model_args, resolve_model, synchronize  # noqa: E402
from profile_prefill import family, timeline  # noqa: E402

from lmdeploy_lite.messages import GenerationConfig, PytorchEngineConfig  # noqa: E402
from lmdeploy_lite.pytorch.engine.build import build_engine  # noqa: E402


def profiled_step(engine) -> dict:
    """One `engine.step()` with the device idle before and synchronized after: its wall (ms),
    kernel ms by family and by kernel, and the first-to-last kernel span."""
    synchronize(engine.device)
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        start = time.perf_counter()
        engine.step()
        synchronize(engine.device)
        wall = 1000 * (time.perf_counter() - start)
    kernels, counts = defaultdict(float), defaultdict(int)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.name] += event.device_time_total / 1000
            counts[event.name] += 1
    families = defaultdict(float)
    for name, ms in kernels.items():
        families[family(name)] += ms
    return {'wall_ms': wall, 'kernels_ms': sum(kernels.values()), 'families': dict(families),
            'span': timeline(prof.events()), 'launches': sum(counts.values()),
            'top': {name: (ms, counts[name]) for name, ms in sorted(
                kernels.items(), key=lambda x: -x[1])[:40]}}


def run(engine, streams: int, prompt_len: int, long_len: int) -> list[dict]:
    """Streams prefilled and decoding, then the long prompt; every step until its first token
    profiled (with what it scheduled), then one decode step more."""
    vocab = engine.model_config.vocab_size
    gen = GenerationConfig(max_new_tokens=engine.session_len - prompt_len - 1, ignore_eos=True)
    seqs = [engine.add_request(p, gen) for p in random_prompts(streams, prompt_len, vocab, 0)]
    while not all(s.prefilled for s in seqs):
        engine.step()
    for _ in range(4):
        engine.step()
    kinds, schedule = [], engine.scheduler.schedule

    def record(batch):              # rows and prompt tokens, read before the step changes them
        if batch is not None:
            kinds.append((len(batch.seqs), sum(n for s, n in zip(batch.seqs, batch.q_lens)
                                               if not s.prefilled)))
        return batch
    engine.scheduler.schedule = lambda: record(schedule())
    (prompt,) = random_prompts(1, long_len, vocab, 1 + long_len)
    long_seq = engine.add_request(prompt, GenerationConfig(max_new_tokens=2, ignore_eos=True))
    steps = []
    try:
        while long_seq.num_generated < 1:
            before = len(kinds)
            row = profiled_step(engine)
            row['rows'], row['chunk'] = kinds[-1] if len(kinds) > before else (0, 0)
            steps.append(row)
        steps.append({**profiled_step(engine), 'rows': streams, 'chunk': 0})
    finally:
        del engine.scheduler.schedule
        for seq in seqs + [long_seq]:
            engine.abort(seq)
        while engine.has_work:
            engine.step()
    return steps


def add_mixed_args(parser: argparse.ArgumentParser):
    """The model and the step mix (`mixed_engine`), shared with probe_step_ops.py."""
    add_model_args(parser, dtype='bfloat16', device='cuda')
    parser.add_argument('--streams', type=int, default=32)
    parser.add_argument('--prompt-len', type=int, default=128)
    parser.add_argument('--long-prompt-len', type=int, default=8192)
    parser.add_argument('--max-mixed-tokens', type=int, default=1024)


def mixed_engine(args, eager: bool):
    """An engine for `--streams` decode rows beside a `--long-prompt-len` prompt's chunks of
    `--max-mixed-tokens`, synchronous scheduling."""
    path, load_format = resolve_model(args)
    return build_engine(path, PytorchEngineConfig(
        dtype=args.dtype, device=args.device, load_format=load_format,
        max_batch_size=max(args.streams, 1) + 1, session_len=args.long_prompt_len + 64,
        max_prefill_token_num=args.max_mixed_tokens, max_mixed_token_num=args.max_mixed_tokens,
        async_scheduling=False, eager_mode=eager), progress=False)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_mixed_args(parser)
    parser.add_argument('--rows', type=int, default=30, help='kernels listed')
    parser.add_argument('--eager', action='store_true', help='no CUDA graphs')
    parser.add_argument('--out', default=None)
    args = parser.parse_args()
    engine = mixed_engine(args, args.eager)
    run(engine, min(args.streams, 2), 16, args.max_mixed_tokens * 2)        # warm-up
    steps = run(engine, args.streams, args.prompt_len, args.long_prompt_len)
    fams = sorted({f for s in steps for f in s['families']})
    print(f'{args.streams} streams, a {args.long_prompt_len}-token prompt, mixed budget '
          f'{args.max_mixed_tokens}; per step: rows, chunk tokens, wall, kernel sum, span (ms)')
    print(' '.join(f'{h:>7}' for h in ['rows', 'chunk', 'kernels', 'wall', 'k_ms', 'span']) +
          ' ' +
          ' '.join(f'{f[:12]:>12}' for f in fams))
    for s in steps:
        print(' '.join(f'{v:7.2f}' if isinstance(v, float) else f'{v:7d}' for v in (
            s['rows'], s['chunk'], s['launches'], s['wall_ms'], s['kernels_ms'],
            s['span']['kernels'])) + ' ' +
            ' '.join(f'{s["families"].get(f, 0.0):12.2f}' for f in fams))
    mid = steps[len(steps) // 2]
    print('a middle step\'s top kernels (ms, launches):')
    for name, (ms, n) in list(mid['top'].items())[:args.rows]:
        print(f'  {name[:80]:<80} {ms:7.3f} {n:5d}')
    if args.out:
        with open(args.out, 'w') as f:
            json.dump({'args': vars(args), 'steps': steps}, f, indent=1)


if __name__ == '__main__':
    main()
