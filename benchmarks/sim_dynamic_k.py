"""The dynamic-k policy's choices on the embedded model's real acceptance, with modeled step
times: each decode step of k drafts costs `--costs`[k] ms (the CPU main job's, measured
2026-11-28: 10.3 / 15.0 / 18.2 / 22.2 ms at k = 0..3), times a burst factor of 1.3-2x with
probability `--burst` (seeded per prompt); the policy is fed those times instead of the wall
clock. Output: per prompt the modeled tokens/s of dynamic k and of each fixed k, dynamic over
the best fixed, and the k of every step. Greedy, one sequence, `--new-tokens` each: the same
numbers on any machine, so a change to the policy can be judged without the machine's noise.
`--batch B`: as `pipeline()` runs a batch, one engine warmed up on 4 prompts x 8 tokens (not
counted) then B prompts (lines of a source file) x `--new-tokens` in one call, all starting
together; `--costs` may then give a table per batch size ('B:t0,t1,...;B2:...'), interpolated at
each step's batch (the batch shrinks as outputs end).

    python benchmarks/sim_dynamic_k.py [--costs 10.3,15.0,18.2,22.2 --burst 0.1 --new-tokens 256]
    python benchmarks/sim_dynamic_k.py --batch 32 --new-tokens 64 --costs "$CPU_PIPE"
    CPU_PIPE='1:10.3,15.0,18.2,22.2;8:16.7,24.6,32.0,36.2;16:20.8,34.6,46.6,57.4;\
        32:27.4,55.3,73.0,90.8'           # (one line)

(`pipeline()`'s one thread on the 2-core machine, 2026-11-29: the lower quartile of each k's
steps at batch 8 / 16 / 32, k = 0 from an MTP engine held at k = 0.)
"""
from __future__ import annotations

import argparse
import random
import zlib

import torch
from common import default_model

from lmdeploy_lite import GenerationConfig, PytorchEngineConfig, SpeculativeConfig
from lmdeploy_lite.pytorch.engine.build import build_engine
from lmdeploy_lite.pytorch.spec_decode import policy as policy_module
from lmdeploy_lite.tokenizer import load_tokenizer

PROMPTS = ['def fibonacci(n):', 'import os\n\n\ndef main(', 'class Stack:\n    def __init__(self',
           'for i in range(10):', 'def parse_args(argv', 'with open(path) as f:']


def parse_costs(text: str) -> dict[int, list[float]]:
    """'10.3,15.0,...' (any batch) or 'B:t0,t1,...;B2:...' (per batch size, interpolated)."""
    tables = [part.split(':') if ':' in part else ('1', part) for part in text.split(';')]
    return {int(b): [float(c) for c in costs.split(',')] for b, costs in tables}


def step_cost(costs: dict[int, list[float]], batch: int, k: int) -> float:
    """ms of a step of `batch` sequences and k drafts: linear between the tabled batch sizes."""
    sizes = sorted(costs)
    lo = max([b for b in sizes if b <= batch], default=sizes[0])
    hi = min([b for b in sizes if b >= batch], default=sizes[-1])
    if lo == hi:
        return costs[lo][k]
    return costs[lo][k] + (costs[hi][k] - costs[lo][k]) * (batch - lo) / (hi - lo)


def modeled_clock(costs: dict[int, list[float]], burst: float):
    """Patches the policy's observe_time: (state, rng); state['ms'] sums the modeled times."""
    state, rng = {'ms': 0.0, 'ks': []}, random.Random(0)
    observe = policy_module.DraftCountPolicy.observe_time

    def observe_time(self, batch_size: int, k: int, seconds: float):
        ms = step_cost(costs, batch_size, k) * (rng.uniform(1.3, 2.0) if rng.random() < burst
                                                 else 1.0)
        state['ms'] += ms
        state['ks'].append(k)
        return observe(self, batch_size, k, ms / 1000)
    policy_module.DraftCountPolicy.observe_time = observe_time
    return state, rng


def run(mode, prompts: list[str], args, state, rng) -> float:
    """Modeled tokens/s of the prompts run together: mode 'dyn' or a fixed k (0: plain)."""
    rng.seed(zlib.crc32(''.join(prompts).encode()))
    if mode == 0:       # the first token comes from the prefill, as in the engine runs
        cost = step_cost(args.costs, len(prompts), 0)
        ms = sum(cost * (rng.uniform(1.3, 2.0) if rng.random() < args.burst else 1.0)
                 for _ in range(args.new_tokens - 1))
        return len(prompts) * args.new_tokens * 1000 / ms
    spec = SpeculativeConfig(num_speculative_tokens=args.max_k if mode == 'dyn' else mode,
                             dynamic=mode == 'dyn')
    engine = build_engine(args.model, PytorchEngineConfig(
        device='cpu', dtype='float32', session_len=args.new_tokens + 256,
        max_batch_size=max(2, len(prompts))), spec, progress=False)
    encode = load_tokenizer(args.model).encode
    if args.batch:                                     # pipeline()'s warm-up call
        engine.generate([encode(p) for p in prompts[:4]],
                        GenerationConfig(max_new_tokens=8, ignore_eos=True))
    state['ms'], state['ks'] = 0.0, []
    engine.generate([encode(p) for p in prompts],
                    GenerationConfig(max_new_tokens=args.new_tokens, ignore_eos=True))
    return len(prompts) * args.new_tokens / state['ms'] * 1000


def batch_prompts(batch: int) -> list[str]:
    """`batch` lines of the scheduler's source of more than 20 characters (as the CPU
    `pipeline()` batch runs of BENCHMARKS.md)."""
    import inspect

    from lmdeploy_lite.pytorch.engine import scheduler
    lines = [line for line in inspect.getsource(scheduler).splitlines() if len(line.strip()) > 20]
    return lines[:batch]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--model', default=None)
    parser.add_argument('--costs', default='10.3,15.0,18.2,22.2',
                        help="ms per step, k = 0..; or 'B:...;B2:...' per batch size")
    parser.add_argument('--burst', type=float, default=0.1)
    parser.add_argument('--new-tokens', type=int, default=256)
    parser.add_argument('--batch', type=int, default=0, help='B source lines run together')
    args = parser.parse_args()
    torch.set_num_threads(1)
    args.model = args.model or default_model()
    args.costs = parse_costs(args.costs)
    args.max_k = len(next(iter(args.costs.values()))) - 1
    state, rng = modeled_clock(args.costs, args.burst)
    fixed = list(range(args.max_k, -1, -1))
    print('prompt'.ljust(14), 'dyn'.rjust(7), *(f'k={k}'.rjust(7) for k in fixed),
          'dyn/best'.rjust(8), ' k per step (dynamic)')
    ratios = []
    for prompt in [[p] for p in PROMPTS] if not args.batch else [batch_prompts(args.batch)]:
        dyn = run('dyn', prompt, args, state, rng)
        ks = ''.join(map(str, state['ks']))
        rates = [run(k, prompt, args, state, rng) for k in fixed]
        ratios.append(dyn / max(rates))
        print(repr(prompt[0])[1:13].ljust(14), f'{dyn:7.1f}', *(f'{r:7.1f}' for r in rates),
              f'{ratios[-1]:8.3f}', '', ks)
    print(f'dynamic / best fixed k: mean {sum(ratios) / len(ratios):.3f}, min {min(ratios):.3f}')


if __name__ == '__main__':
    main()
