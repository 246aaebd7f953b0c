"""Acceptance by draft position of the embedded model's MTP head under each execution path:
the same prompts (32 code snippets x 128 tokens, greedy, fixed k) on CPU float32 (the reference),
and on CUDA in float32 / bf16, eager and with CUDA graphs (whole greedy steps). A path whose
deeper positions accept markedly less than the reference drafts wrongly: greedy output stays
exact (the verify decides), so only these counts show it.

    python benchmarks/diag_accept.py --paths cpu:float32,cuda:float32:eager,cuda:float32
"""
from __future__ import annotations

import argparse
import collections
import inspect
import json
import os
import time

import torch

from lmdeploy_lite import pipeline
from lmdeploy_lite.api import EMBEDDED_MODEL_DIR
from lmdeploy_lite.messages import GenerationConfig, PytorchEngineConfig, SpeculativeConfig


def snippet_prompts(tokenizer, count: int) -> list[list[int]]:
    text = ''.join(inspect.getsource(m) for m in (collections, json.decoder, inspect))
    lines = [ln for ln in text.splitlines() if len(ln.strip()) > 20]
    step = max(1, len(lines) // count)
    return [tokenizer.encode('\n'.join(lines[i * step:i * step + 3]) + '\n')
            for i in range(count)]


def run_path(path: str, prompts, args) -> dict:
    device, dtype, *mode = path.split(':')
    cfg = PytorchEngineConfig(dtype=dtype, device=device, block_size=16, session_len=512,
                              max_batch_size=32, eager_mode='eager' in mode)
    spec = SpeculativeConfig(num_speculative_tokens=args.k, dynamic=args.dynamic)
    gen = GenerationConfig(max_new_tokens=args.new_tokens, ignore_eos=True)
    with pipeline(None, cfg, spec, progress=False) as pipe:
        policy, chosen = pipe.engine.draft_policy, []
        propose = policy.propose
        policy.propose = lambda batch_size: chosen.append(propose(batch_size)) or chosen[-1]
        start = time.perf_counter()
        out = pipe(prompts, gen)
        seconds = time.perf_counter() - start
        stats = pipe.engine.spec_stats
    rates = [round(a / max(d, 1), 3) for a, d in zip(stats.accepted_per_position,
                                                     stats.drafted_per_position)]
    return {'path': path, 'acceptance_by_position': rates,
            'drafted_per_position': stats.drafted_per_position,
            'mean_accepted_length': round(stats.mean_accepted_length, 3),
            'seconds': round(seconds, 3), 'chosen_k': ''.join(map(str, chosen)),
            'step_times_ms': {f'{b}:{k}': [round(1e3 * t, 2) for t in times] for (b, k), times
                              in policy._recent.items()},
            'tokens': [r.token_ids for r in out]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--paths', default='cpu:float32,cuda:float32:eager,cuda:float32,'
                        'cuda:bfloat16:eager,cuda:bfloat16')
    parser.add_argument('--k', type=int, default=3)
    parser.add_argument('--dynamic', action='store_true')
    parser.add_argument('--new-tokens', type=int, default=128)
    parser.add_argument('--num-prompts', type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(min(8, torch.get_num_threads()))
    from transformers import AutoTokenizer
    prompts = snippet_prompts(AutoTokenizer.from_pretrained(EMBEDDED_MODEL_DIR),
                              args.num_prompts)
    results = [run_path(p, prompts, args) for p in args.paths.split(',')]
    reference = results[0]['tokens']
    print(f"{'path':24} {'same as ' + results[0]['path']:>20} {'mean len':>9}  by position")
    for r in results:
        same = sum(a == b for a, b in zip(r.pop('tokens'), reference))
        r['identical_to_first'] = same
        print(f"{r['path']:24} {same:>17}/{len(reference)} {r['mean_accepted_length']:>9}  "
              f"{r['acceptance_by_position']} of {r['drafted_per_position']} {r['seconds']} s")
        if args.dynamic:
            print('  k chosen:', r['chosen_k'])
            for cell, times in r['step_times_ms'].items():
                print(f'  {cell}: {times}')
    out = os.environ.get('OUT')
    if out:
        with open(os.path.join(out, 'diag_accept.json'), 'w') as f:
            json.dump(results, f, indent=1)


if __name__ == '__main__':
    main()
