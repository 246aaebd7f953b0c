"""The dynamic-k policy against every fixed k on synthetic steps, this checkout's policy beside
another revision's (`--against REV`, read with git show): step times per k from measured cost
tables (a GPU's 0.8B at batch 1 / 8 / 32 / 128, a compute-bound large batch, the 2-core CPU's
main job, its batch-8 steps and `pipeline()`'s batch 32), +-5% jitter and, on 5% of steps, a
1.3-2x burst; rows accept draft j with the given conditional probabilities. Per cell: dynamic /
best fixed k over `--seeds` seeds, mean and min. `--hard-start N`: each policy first runs N
steps of batch 1 on its device's batch-1 costs with nothing accepted (not counted), as after a
warm-up prompt whose drafts failed; a cell of another batch size then starts a new bucket from
that acceptance.

    python benchmarks/sim_policy_grid.py [--against 773106c --steps 300 --seeds 6]
    python benchmarks/sim_policy_grid.py --against HEAD --steps 30 --hard-start 6
    python benchmarks/sim_policy_grid.py --against HEAD --steps 122 --hard-start 8 \
        --hard-accept 0.6,0.2,0.2          # the hard-start test's case, on every cell
    python benchmarks/sim_policy_grid.py --against HEAD --steps 84 --warm-start 60
"""
from __future__ import annotations

import argparse
import importlib.util
import itertools
import os
import random
import subprocess
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
POLICY = 'lmdeploy_lite/pytorch/spec_decode/policy.py'
COSTS = {'gpu_b1': (1, [1.46, 1.72, 1.93, 2.14]), 'gpu_b8': (8, [1.62, 2.00, 2.24, 2.53]),
         'gpu_b32': (32, [2.29, 2.77, 3.33, 3.91]), 'big_b32': (32, [5.0, 8.0, 10.5, 13.0]),
         'gpu_b128': (128, [3.09, 4.85, 6.41, 8.07]),       # the 0.8B on an H200: k=1 best
         'cpu_b1': (1, [10.3, 15.0, 18.2, 22.2]),          # ms per step at k = 0..3
         'cpu_b8': (8, [17.7, 27.7, 36.0, 44.1]),
         'cpu_b32': (32, [27.4, 55.3, 73.0, 90.8])}         # pipeline()'s: k=0 best
ACCEPTANCE = {'0.8/0.6/0.5': [0.8, 0.75, 0.83], 'zero': [0.0] * 3, 'low': [0.3] * 3,
              'high': [0.9] * 3,                             # conditional, per position
              'bench': [0.8, 0.6, 0.5]}                      # bench_spec's synthetic rule


def load_policy(source: str, name: str):
    spec = importlib.util.spec_from_file_location(name, source)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.DraftCountPolicy


def tokens_per_ms(policy, batch: int, cost: list[float], accept: list[float], steps: int,
                  seed: int, fixed_k: int = 0) -> float:
    rng, tokens, elapsed = random.Random(seed), 0, 0.0
    for _ in range(steps):
        k = policy.propose(batch) if policy else fixed_k
        ms = cost[k] * rng.uniform(0.95, 1.05) * (rng.uniform(1.3, 2.0) if rng.random() < 0.05
                                                  else 1.0)
        accepted = []
        for _ in range(batch):
            n = 0
            while n < k and rng.random() < accept[n]:
                n += 1
            accepted.append(n)
        if policy:
            policy.observe_time(batch, k, ms / 1000)
            if k:
                policy.observe_acceptance([k] * batch, accepted)
        tokens, elapsed = tokens + batch + sum(accepted), elapsed + ms
    return tokens / elapsed


def started(policy, cell: str, hard_steps: int, seed: int, accept: list[float] | None = None):
    """`policy` after `hard_steps` uncounted steps of batch 1 (the cell's device) whose drafts
    all failed, or, given `accept`, that accepted as the cell's rows do (as in bench_spec, whose
    one engine runs the batch sizes in turn: a new bucket starts from a measured acceptance)."""
    if hard_steps:
        cost = COSTS['cpu_b1' if cell.startswith('cpu') else 'gpu_b1'][1]
        tokens_per_ms(policy, 1, cost, accept or [0.0] * 3, hard_steps, seed + 1000)
        policy.break_sequence()
    return policy


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--against', default='773106c', help='git revision of the other policy')
    parser.add_argument('--steps', type=int, default=300)
    parser.add_argument('--seeds', type=int, default=6)
    start = parser.add_mutually_exclusive_group()
    start.add_argument('--hard-start', type=int, default=0, metavar='N')
    parser.add_argument('--hard-accept', default=None, metavar='A,B,C',
                        help='the hard start\'s conditional acceptance per position (default: '
                             'none accepted; the hard-start test: 0.6,0.2,0.2)')
    start.add_argument('--warm-start', type=int, default=0, metavar='N',
                       help="N uncounted steps of batch 1 at the cell's acceptance first")
    args = parser.parse_args()
    hard_accept = [float(a) for a in args.hard_accept.split(',')] if args.hard_accept else None
    with tempfile.NamedTemporaryFile('w', suffix='.py', delete=False) as f:
        f.write(subprocess.run(['git', 'show', f'{args.against}:{POLICY}'], cwd=ROOT, check=True,
                               capture_output=True, text=True).stdout)
    policies = {args.against: load_policy(f.name, 'other_policy'),
                'this': load_policy(os.path.join(ROOT, POLICY), 'this_policy')}
    print('cell'.ljust(22), *(f'{name[:10]:>10} mean   min' for name in policies))
    for (cell, (batch, cost)), (acc_name, accept) in itertools.product(COSTS.items(),
                                                                       ACCEPTANCE.items()):
        best = [max(tokens_per_ms(None, batch, cost, accept, args.steps, s, k)
                    for k in range(len(cost))) for s in range(args.seeds)]
        row = []
        for policy in policies.values():
            ratios = [tokens_per_ms(started(policy(len(cost) - 1), cell,
                                            args.hard_start or args.warm_start, s,
                                            accept if args.warm_start else hard_accept),
                                    batch, cost, accept, args.steps, s) / b
                      for s, b in enumerate(best)]
            row.append(f'{sum(ratios) / len(ratios):14.3f} {min(ratios):5.3f}')
        print(f'{cell} {acc_name}'.ljust(22), *row)


if __name__ == '__main__':
    main()
