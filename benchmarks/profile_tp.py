"""Where a multi-rank decode step's time goes, on every rank: compute kernels, collective kernels
(NCCL, the one-shot peer-memory all-reduce, DeepEP) and the host (wall time the GPU is idle).

    python benchmarks/profile_tp.py --preset qwen3_5_0_8b --tp 2 --batch-sizes 1,64 \
        --modes eager,graphs --spec-ks 0,3

One process per rank (rank r on cuda:r), each an `Engine` over `DistContext.init` as the mp
executor builds it, fed the same requests (TP peers schedule alike); a step is `Engine.step`, as
`rank_loop` runs it (the inbox's events are agreed inside the StepPlan's gather). Per (mode, k,
batch): `--steps` timed steps after a warm-up, then 10 steps under torch.profiler. Rank 0 also
prints the host functions that take the most time in eager mode (cProfile). Synthetic
acceptance (`--synthetic-acceptance`) is installed on every rank.
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import os
import pstats
import time
from functools import partial

import torch
import torch.multiprocessing as mp
from common import add_model_args, environment, output_path, print_table, resolve_model

COLUMNS = ['mode', 'tp', 'dp', 'ep', 'spec_k', 'batch', 'rank', 'step_ms', 'compute_ms',
           'collective_ms', 'host_idle_ms', 'tok_s']
COLLECTIVE_KERNELS = ('nccl', 'one_shot', 'all_reduce', 'dispatch', 'combine', 'deep_ep')


def split_device_time(prof, steps: int) -> tuple[float, float]:
    """(compute ms, collective ms) per step: the profiler's CUDA kernel times."""
    compute = collective = 0.0
    for event in prof.key_averages():
        us = getattr(event, 'self_device_time_total', None)
        if us is None:
            us = event.self_cuda_time_total
        if not us or event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = event.key.lower()
        if any(k in name for k in COLLECTIVE_KERNELS):
            collective += us
        else:
            compute += us
    return compute / 1000 / steps, collective / 1000 / steps


def rank_loop_step(engine):
    """One step as `rank_loop` runs it (no inbox event: `Engine.step` alone)."""
    engine.step()


def worker(rank: int, args, model_dir: str, load_format: str, init_method: str, queue):
    from lmdeploy_lite.messages import (GenerationConfig, PytorchEngineConfig,
                                        SpeculativeConfig)
    from lmdeploy_lite.pytorch.config import DistConfig
    from lmdeploy_lite.pytorch.distributed import DistContext
    from lmdeploy_lite.pytorch.engine.build import build_engine
    torch.set_num_threads(1)
    cuda = args.device == 'cuda'
    device = torch.device('cuda', rank) if cuda else None
    if cuda:
        torch.cuda.set_device(rank)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    layout = DistConfig(args.tp, args.dp, args.ep, args.sequence_parallel)
    dist_ctx = DistContext.init(layout, rank, init_method, device)
    batch_sizes = [int(b) for b in args.batch_sizes.split(',')]
    rows = []
    for k in (int(k) for k in args.spec_ks.split(',')):
        for mode in args.modes.split(','):
            cfg = PytorchEngineConfig(dtype=args.dtype, device=args.device, tp=args.tp, dp=args.dp,
                                      ep=args.ep, sequence_parallel=args.sequence_parallel,
                                      max_batch_size=max(batch_sizes), session_len=4096,
                                      load_format=load_format, seed=args.seed,
                                      eager_mode=mode == 'eager', enable_prefix_caching=False)
            spec = SpeculativeConfig(num_speculative_tokens=k) if k else None
            engine = build_engine(model_dir, cfg, spec, progress=False, dist_ctx=dist_ctx)
            if k and args.synthetic_acceptance:
                from bench_spec import synthetic_rejection_sampler
                rates = [float(r) for r in args.synthetic_acceptance.split(',')]
                engine.agent.rejection_sampler = synthetic_rejection_sampler(rates)
            gen = GenerationConfig(max_new_tokens=3000, ignore_eos=True)
            for batch in batch_sizes:
                # every DP rank gets the batch (ep > 1: the per-GPU batch); TP peers the same
                seqs = [engine.add_request(list(range(10 + b, 10 + b + args.prompt_len)), gen)
                        for b in range(batch)]
                step = partial(rank_loop_step, engine)
                while not all(s.prefilled for s in seqs):
                    step()
                for _ in range(8):
                    step()
                sync()
                generated = sum(s.num_generated for s in seqs)
                start = time.perf_counter()
                for _ in range(args.steps):
                    step()
                sync()
                seconds = time.perf_counter() - start
                tokens = sum(s.num_generated for s in seqs) - generated
                step_ms = 1000 * seconds / args.steps
                host_report = None
                if mode == 'eager' and batch == batch_sizes[0]:     # every rank steps
                    profiler = cProfile.Profile()
                    profiler.enable()
                    for _ in range(10):
                        step()
                    profiler.disable()
                    text = io.StringIO()
                    pstats.Stats(profiler, stream=text).sort_stats('tottime').print_stats(12)
                    host_report = text.getvalue()
                sync()
                activities = [torch.profiler.ProfilerActivity.CPU]
                if cuda:
                    activities.append(torch.profiler.ProfilerActivity.CUDA)
                with torch.profiler.profile(activities=activities) as prof:
                    for _ in range(10):
                        step()
                    sync()
                compute, collective = split_device_time(prof, 10)
                for seq in seqs:
                    engine.abort(seq)
                while engine.has_work:
                    step()
                rows.append({'mode': mode, 'tp': args.tp, 'dp': args.dp, 'ep': args.ep,
                             'spec_k': k, 'batch': batch, 'rank': rank, 'step_ms': step_ms,
                             'compute_ms': compute, 'collective_ms': collective,
                             'host_idle_ms': max(0.0, step_ms - compute - collective),
                             'tok_s': tokens / seconds * (args.dp if args.ep > 1 else 1)})
                if host_report and rank == 0:
                    rows[-1]['host_top'] = host_report
            del engine
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
    queue.put(rows)
    dist_ctx.destroy()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser, dtype='bfloat16', device='cuda')
    parser.add_argument('--tp', type=int, default=2)
    parser.add_argument('--dp', type=int, default=1)
    parser.add_argument('--ep', type=int, default=1)
    parser.add_argument('--sequence-parallel', action='store_true')
    parser.add_argument('--batch-sizes', default='1,64')
    parser.add_argument('--spec-ks', default='0')
    parser.add_argument('--synthetic-acceptance', default=None)
    parser.add_argument('--modes', default='eager,graphs')
    parser.add_argument('--prompt-len', type=int, default=128)
    parser.add_argument('--steps', type=int, default=40)
    parser.add_argument('--out', default=None)
    args = parser.parse_args()
    model_dir, load_format = resolve_model(args)
    args.out_path = output_path(args.out, f'profile_tp_{args.preset or "model"}_tp{args.tp}'
                                          f'_dp{args.dp}_ep{args.ep}.json')
    os.makedirs(os.path.dirname(args.out_path) or '.', exist_ok=True)
    from lmdeploy_lite.pytorch.engine.executor.mp import free_port
    ctx = mp.get_context('spawn')
    queue = ctx.Queue()
    world = args.tp * args.dp
    init_method = f'tcp://127.0.0.1:{free_port()}'
    procs = [ctx.Process(target=worker, args=(r, args, model_dir, load_format, init_method, queue))
             for r in range(world)]
    for p in procs:
        p.start()
    rows = []
    for _ in procs:
        rows += queue.get(timeout=540)
    for p in procs:
        p.join(30)
    rows.sort(key=lambda r: (r['spec_k'], r['mode'], r['batch'], r['rank']))
    for row in rows:
        if 'host_top' in row:
            print(f"--- rank 0, {row['mode']}, k={row['spec_k']}, batch {row['batch']}: "
                  f"host functions by own time (10 steps)")
            print(row.pop('host_top'))
    with open(args.out_path, 'w') as f:
        json.dump({'env': environment(), 'args': {k: v for k, v in vars(args).items()},
                   'rows': rows}, f, indent=1)
    print(f'model: {args.preset or model_dir}, {args.dtype}')
    print_table(rows, COLUMNS)


if __name__ == '__main__':
    main()
