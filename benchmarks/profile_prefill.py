"""Where a long prefill's device time goes: one prompt of `--tokens` on an idle engine (prefill
graphs up to `--graph-tokens`; 0: eager), its wall time (best of 5), then one run under
torch.profiler: device time by kernel family and the kernels with the most device time.
`--chunk N`: the prompt prefilled in steps of N tokens (what a long prompt costs when it is spread
over steps, as mixed steps spread it), every step's kernels summed.

    python benchmarks/profile_prefill.py --preset qwen3_5_0_8b --tokens 8192 [--chunk 1024]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import add_model_args, resolve_model, synchronize  # noqa: E402

from lmdeploy_lite.messages import GenerationConfig, PytorchEngineConfig  # noqa: E402
from lmdeploy_lite.pytorch.engine.build import build_engine  # noqa: E402

# kernel-name fragments -> family (the first that matches)
FAMILIES = (('gated delta (ours)', ('_recurrent', '_gating')),
            ('conv1d', ('conv', '_prefill_body', '_prefill_head')),
            ('attention', ('_prefill_kernel', 'attn', '_decode_kernel', 'sum_splits')),
            ('gated delta (fla)', ('chunk', 'solve_tril', 'recompute', 'l2norm', 'cumsum', 'kkt',
                                   'wy')),
            ('gemm', ('gemm', 'sm90', 'nvjet', 'cutlass', 'matmul', 'fp8')),
            ('norm', ('norm',)), ('moe', ('moe', 'expert')))


def family(name: str) -> str:
    low = name.lower()
    return next((fam for fam, keys in FAMILIES if any(k in low for k in keys)), 'other')


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser, dtype='bfloat16', device='cuda')
    parser.add_argument('--tokens', type=int, default=8192)
    parser.add_argument('--graph-tokens', type=int, default=8192)
    parser.add_argument('--chunk', type=int, default=0, help='prefill steps of this many tokens')
    parser.add_argument('--rows', type=int, default=20)
    parser.add_argument('--host-rows', type=int, default=15,
                        help='host functions with the most own time in one run (cProfile)')
    parser.add_argument('--out', default=None)
    args = parser.parse_args()
    path, load_format = resolve_model(args)
    engine = build_engine(path, PytorchEngineConfig(
        dtype=args.dtype, device=args.device, load_format=load_format, max_batch_size=8,
        session_len=args.tokens + 64, max_prefill_token_num=args.chunk or args.tokens,
        max_prefill_graph_tokens=args.graph_tokens, enable_prefix_caching=False), progress=False)
    rng = random.Random(0)
    vocab = min(10000, engine.model_config.vocab_size - 1)
    prompt = [rng.randrange(3, vocab) for _ in range(args.tokens)]
    gen = GenerationConfig(max_new_tokens=1, ignore_eos=True)

    def run():
        engine.add_request(prompt, gen)
        while engine.has_work:
            engine.step()
        synchronize(engine.device)

    for _ in range(3):
        run()
    walls = []
    for _ in range(5):
        start = time.perf_counter()
        run()
        walls.append(1000 * (time.perf_counter() - start))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        run()
    kernels = defaultdict(float)
    span = timeline(prof.events())
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.name] += event.device_time_total / 1000       # ms
    device_ms = sum(kernels.values())
    families = defaultdict(float)
    for name, ms in kernels.items():
        families[family(name)] += ms
    print(f'{args.tokens} tokens in steps of {args.chunk or args.tokens}, graphs <= '
          f'{args.graph_tokens}: wall best {min(walls):.2f} ms '
          f'(median {sorted(walls)[2]:.2f}), device kernels {device_ms:.2f} ms')
    print('timeline (ms): host before the first kernel {lead:.2f}, first to last kernel '
          '{kernels:.2f}, host after the last {tail:.2f}'.format(**span))
    print(f'{"family":<22} {"ms":>8} {"share":>6}')
    for fam, ms in sorted(families.items(), key=lambda x: -x[1]):
        print(f'{fam:<22} {ms:8.2f} {100 * ms / device_ms:5.1f}%')
    print(f'{"kernel":<70} {"ms":>8}')
    for name, ms in sorted(kernels.items(), key=lambda x: -x[1])[:args.rows]:
        print(f'{name[:70]:<70} {ms:8.2f}')
    host = host_profile(run, args.host_rows)
    if args.out:
        with open(args.out, 'w') as f:
            json.dump({'tokens': args.tokens, 'chunk': args.chunk or args.tokens,
                       'graph_tokens': args.graph_tokens, 'walls_ms': walls,
                       'device_ms': device_ms, 'families_ms': families,
                       'kernels_ms': dict(kernels), 'host_ms': host, 'timeline_ms': span}, f,
                      indent=1)


def timeline(events) -> dict[str, float]:
    """The profiled run's host ops against its kernels (ms): host time before the first kernel
    starts, the first kernel's start to the last one's end (device busy or idle), host time
    after the last kernel ends."""
    cuda = torch.autograd.DeviceType.CUDA
    kernels = [e.time_range for e in events if e.device_type == cuda]
    host = [e.time_range for e in events if e.device_type != cuda]
    if not kernels:                                       # a CPU run
        return {'lead': 0.0, 'kernels': 0.0, 'tail': 0.0}
    first, last = min(r.start for r in kernels), max(r.end for r in kernels)
    return {'lead': (first - min(r.start for r in host)) / 1000, 'kernels': (last - first) / 1000,
            'tail': (max(r.end for r in host) - last) / 1000}


def host_profile(run, rows: int) -> dict[str, float]:
    """One run under cProfile: the functions with the most own time (ms; a wait for the device
    shows as the call that synchronizes)."""
    import cProfile
    import pstats
    profiler = cProfile.Profile()
    profiler.runcall(run)
    stats = pstats.Stats(profiler).stats
    own = sorted(((1000 * tt, f'{os.path.basename(fn)}:{line}:{name}')
                  for (fn, line, name), (_, _, tt, _, _) in stats.items()), reverse=True)[:rows]
    print(f'{"host function (own time)":<70} {"ms":>8}')
    for ms, name in own:
        print(f'{name[:70]:<70} {ms:8.2f}')
    return {name: ms for ms, name in own}


if __name__ == '__main__':
    main()
