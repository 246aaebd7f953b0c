"""Where a decode step's time goes: host (cProfile of Engine.step) and device (torch.profiler).

    python benchmarks/profile_step.py --preset qwen3_5_0_8b --device cuda --dtype bfloat16 --batch 1
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import time

import torch
from common import add_model_args, resolve_model

from lmdeploy_lite.messages import GenerationConfig, PytorchEngineConfig, SpeculativeConfig
from lmdeploy_lite.pytorch.engine.build import build_engine


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser)
    parser.add_argument('--batch', type=int, default=1)
    parser.add_argument('--steps', type=int, default=50)
    parser.add_argument('--eager', action='store_true')
    parser.add_argument('--model-format', default=None, choices=['fp8'],
                        help='fp8: the linears quantized online (FP8 GEMMs on the GPU)')
    parser.add_argument('--shapes', action='store_true',
                        help='torch.profiler table grouped by op and input shapes')
    parser.add_argument('--spec', type=int, default=0, help='MTP draft tokens, every step (0: '
                        'plain decode)')
    parser.add_argument('--spec-k0', action='store_true', help='a speculative engine (MTP, k up '
                        'to 3) held at k = 0: the dynamic policy\'s plain step (decode and the '
                        'head\'s KV write)')
    parser.add_argument('--token-map-size', type=int, default=None, metavar='N',
                        help='with --spec: draft over the first N ids (bench_spec.py\'s map)')
    parser.add_argument('--rows', type=int, default=None, help='rows of the device table')
    parser.add_argument('--kernels-out', default=None, metavar='JSON',
                        help='write the profiled steps\' kernels in launch order: [name, us]')
    args = parser.parse_args()
    model_dir, load_format = resolve_model(args)
    token_map = None
    if args.token_map_size:
        from bench_spec import first_ids_map
        args.token_map = None
        token_map = first_ids_map(parser, args, model_dir, load_format)
    spec_kwargs = ({'speculative_config': SpeculativeConfig(
        num_speculative_tokens=args.spec, dynamic=False, draft_token_map=token_map)}
                   if args.spec else {})                   # a fixed k: the step profiled is k's
    if args.spec_k0:                                       # the policy's test hook: k = 0 always
        os.environ['LMDEPLOY_LITE_SPEC_K_CYCLE'] = '0'
        spec_kwargs = {'speculative_config': SpeculativeConfig(num_speculative_tokens=3)}
    engine = build_engine(model_dir, PytorchEngineConfig(
        dtype=args.dtype, device=args.device, max_batch_size=max(args.batch, 2), session_len=2048,
        load_format=load_format, seed=args.seed, eager_mode=args.eager,
        model_format=args.model_format), progress=False,
        **spec_kwargs)
    cfg = GenerationConfig(max_new_tokens=10_000, ignore_eos=True)
    for b in range(args.batch):
        engine.add_request(list(range(10 + b, 138 + b)), cfg)
    for _ in range(8):
        engine.step()
    sync = torch.cuda.synchronize if engine.device.type == 'cuda' else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    sync()
    print(f'step: {1000 * (time.perf_counter() - start) / args.steps:.3f} ms')
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(args.steps):
        engine.step()
    profiler.disable()
    pstats.Stats(profiler).sort_stats(os.environ.get('PROFILE_SORT', 'tottime')).print_stats(int(os.environ.get('PROFILE_ROWS', 25)))
    activities = [torch.profiler.ProfilerActivity.CPU]
    if engine.device.type == 'cuda':
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities, record_shapes=args.shapes) as prof:
        for _ in range(10):
            engine.step()
        sync()
    key = 'self_cuda_time_total' if engine.device.type == 'cuda' else 'self_cpu_time_total'
    table = prof.key_averages(group_by_input_shape=args.shapes)
    print(table.table(sort_by=key, row_limit=args.rows or (40 if args.shapes else 30), max_name_column_width=60,
                      max_shapes_column_width=80))
    if engine.device.type == 'cuda':      # kernels only: what the device ran, per step
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        busy = sum(e.time_range.elapsed_us() for e in kernels) / 10
        print(f'device per step: {busy / 1000:.3f} ms in {len(kernels) / 10:.0f} kernels')
        if args.kernels_out:
            kernels.sort(key=lambda e: e.time_range.start)
            with open(args.kernels_out, 'w') as f:
                json.dump([[e.name, e.time_range.elapsed_us()] for e in kernels], f)


if __name__ == '__main__':
    main()
