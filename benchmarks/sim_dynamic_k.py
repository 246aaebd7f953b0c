"""The dynamic-k policy's choices on the embedded model's real acceptance, with modeled step
times: each decode step of k drafts costs `--costs`[k] ms (the CPU main job's, measured
2026-11-28: 10.3 / 15.0 / 18.2 / 22.2 ms at k = 0..3), times a burst factor of 1.3-2x with
probability `--burst` (seeded per prompt); the policy is fed those times instead of the wall
clock. Output: per prompt the modeled tokens/s of dynamic k and of each fixed k, dynamic over
the best fixed, and the k of every step. Greedy, one sequence, `--new-tokens` each: the same
numbers on any machine, so a change to the policy can be judged without the machine's noise.

    python benchmarks/sim_dynamic_k.py [--costs 10.3,15.0,18.2,22.2 --burst 0.1 --new-tokens 256]
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


def modeled_clock(costs: list[float], burst: float):
    """Patches the policy's observe_time: (state, rng); state['ms'] sums the modeled times."""
    state, rng = {'ms': 0.0, 'ks': []}, random.Random(0)
    observe = policy_module.DraftCountPolicy.observe_time

    def observe_time(self, batch_size: int, k: int, seconds: float):
        ms = costs[k] * (rng.uniform(1.3, 2.0) if rng.random() < burst else 1.0)
        state['ms'] += ms
        state['ks'].append(k)
        return observe(self, batch_size, k, ms / 1000)
    policy_module.DraftCountPolicy.observe_time = observe_time
    return state, rng


def run(mode, prompt: str, args, state, rng) -> float:
    """Modeled tokens/s of one prompt: mode 'dyn' or a fixed k (0: plain)."""
    state['ms'], state['ks'] = 0.0, []
    rng.seed(zlib.crc32(prompt.encode()))
    if mode == 0:
        return 1000 / args.costs[0]
    spec = SpeculativeConfig(num_speculative_tokens=args.max_k if mode == 'dyn' else mode,
                             dynamic=mode == 'dyn')
    engine = build_engine(args.model, PytorchEngineConfig(
        device='cpu', dtype='float32', session_len=args.new_tokens + 256, max_batch_size=2),
        spec, progress=False)
    ids = load_tokenizer(args.model).encode(prompt)
    engine.generate([ids], GenerationConfig(max_new_tokens=args.new_tokens, ignore_eos=True))
    return args.new_tokens / state['ms'] * 1000


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--model', default=None)
    parser.add_argument('--costs', default='10.3,15.0,18.2,22.2', help='ms per step, k = 0..')
    parser.add_argument('--burst', type=float, default=0.1)
    parser.add_argument('--new-tokens', type=int, default=256)
    args = parser.parse_args()
    torch.set_num_threads(1)
    args.model = args.model or default_model()
    args.costs = [float(c) for c in args.costs.split(',')]
    args.max_k = len(args.costs) - 1
    state, rng = modeled_clock(args.costs, args.burst)
    fixed = list(range(args.max_k, -1, -1))
    print('prompt'.ljust(14), 'dyn'.rjust(7), *(f'k={k}'.rjust(7) for k in fixed),
          'dyn/best'.rjust(8), ' k per step (dynamic)')
    ratios = []
    for prompt in PROMPTS:
        dyn = run('dyn', prompt, args, state, rng)
        ks = ''.join(map(str, state['ks']))
        rates = [run(k, prompt, args, state, rng) for k in fixed]
        ratios.append(dyn / max(rates))
        print(repr(prompt)[1:13].ljust(14), f'{dyn:7.1f}', *(f'{r:7.1f}' for r in rates),
              f'{ratios[-1]:8.3f}', '', ks)
    print(f'dynamic / best fixed k: mean {sum(ratios) / len(ratios):.3f}, min {min(ratios):.3f}')


if __name__ == '__main__':
    main()
