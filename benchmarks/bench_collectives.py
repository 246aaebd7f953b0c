"""Per-step cost of the StepPlan all-gather and of the MoE all-to-all dispatch+combine on CPU
(gloo) for 2 and 4 processes.

    python benchmarks/bench_collectives.py [--world-sizes 2,4] [--iters 200] [--tokens 64]
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.multiprocessing as mp
from common import environment, print_table, save_json

from lmdeploy_lite.pytorch.config import DistConfig
from lmdeploy_lite.pytorch.distributed import DistContext
from lmdeploy_lite.pytorch.engine.executor.mp import free_port
from lmdeploy_lite.pytorch.engine.step_plan import StepPlan
from lmdeploy_lite.pytorch.nn.token_dispatcher import AllToAllDispatcher


def worker(rank, world, port, args, results):
    torch.set_num_threads(1)
    ctx = DistContext.init(DistConfig(dp=world, ep=world), rank, f'tcp://127.0.0.1:{port}')
    hidden, experts, top_k = args.hidden, 8 * world, 2
    dispatcher = AllToAllDispatcher(ctx, experts)
    x = torch.randn(args.tokens, hidden)
    ids = torch.randint(0, experts, (args.tokens, top_k))
    weights = torch.full((args.tokens, top_k), 0.5)
    def a2a():
        expert_x, _, handle = dispatcher.dispatch(x, ids, weights)
        return dispatcher.combine(expert_x, handle)

    timings = {}
    for name, fn in (('plan_gather', lambda: StepPlan.gather(None, ctx)),
                     ('a2a_dispatch_combine', a2a)):
        for _ in range(10):
            fn()
        ctx.world.all_gather(torch.zeros(1))                          # line up
        start = time.perf_counter()
        for _ in range(args.iters):
            fn()
        timings[name] = (time.perf_counter() - start) / args.iters * 1e6
    if rank == 0:
        results.put(timings)
    ctx.destroy()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--world-sizes', default='2,4')
    parser.add_argument('--iters', type=int, default=200)
    parser.add_argument('--tokens', type=int, default=64, help='tokens per rank in the a2a')
    parser.add_argument('--hidden', type=int, default=2048)
    parser.add_argument('--out', default='out/bench_collectives.json')
    args = parser.parse_args()
    rows = []
    ctx = mp.get_context('spawn')
    for world in (int(w) for w in args.world_sizes.split(',')):
        results = ctx.Queue()
        port = free_port()
        procs = [ctx.Process(target=worker, args=(r, world, port, args, results))
                 for r in range(world)]
        for p in procs:
            p.start()
        timings = results.get(timeout=300)
        for p in procs:
            p.join(60)
        rows.append({'processes': world, 'plan_gather_us': timings['plan_gather'],
                     'a2a_us': timings['a2a_dispatch_combine'], 'tokens_per_rank': args.tokens,
                     'hidden': args.hidden})
    print_table(rows, ['processes', 'plan_gather_us', 'a2a_us', 'tokens_per_rank', 'hidden'])
    save_json(args.out, {'env': environment(), 'rows': rows})


if __name__ == '__main__':
    main()
