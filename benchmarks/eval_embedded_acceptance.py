"""MTP acceptance of the embedded model, measured by our engine: greedy, on snippets of the
held-out standard-library modules (tools/train_tiny_model.py HELD_OUT, read from this machine's
stdlib). Prints a table of mean accepted length (tokens per verify step, bonus included) and
per-position acceptance for k = 1..4, and checks every speculative output against plain greedy.

    python benchmarks/eval_embedded_acceptance.py [--model DIR] [--fixed-k] [--json out.json]

`--fixed-k`: every decode step drafts exactly k (dynamic=False); by default the engine picks
each step's count in 0..k (a head that is rarely accepted then mostly drafts one token).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, 'tools'))

from lmdeploy_lite.api import EMBEDDED_MODEL_DIR, load_tokenizer  # noqa: E402
from lmdeploy_lite.messages import (GenerationConfig, PytorchEngineConfig,  # noqa: E402
                                    SpeculativeConfig)
from lmdeploy_lite.pytorch.engine.build import build_engine  # noqa: E402
from train_tiny_model import held_out_files, read_texts  # noqa: E402


def held_out_prompts(tokenizer, num_prompts: int, prompt_tokens: int) -> list[list[int]]:
    """`num_prompts` prompts of `prompt_tokens` tokens, each starting at a line start spread
    evenly over the held-out files (deterministic)."""
    lines = [line for text in read_texts(held_out_files()) for line in text.splitlines(True)]
    prompts = []
    for i in range(num_prompts):
        start = (2 * i + 1) * len(lines) // (2 * num_prompts)
        while start < len(lines) and not lines[start].strip():        # skip blank lines
            start += 1
        ids = tokenizer.encode(''.join(lines[start:start + 200]))[:prompt_tokens]
        prompts.append(ids)
    return prompts


def run(model: str, prompts: list[list[int]], new_tokens: int, k: int, dtype: str,
        dynamic: bool = True, model_format: str | None = None):
    spec = (SpeculativeConfig(method='qwen3_5_mtp', num_speculative_tokens=k, dynamic=dynamic)
            if k else None)
    engine = build_engine(model, PytorchEngineConfig(dtype=dtype, device='cpu',
                                                     model_format=model_format),
                          spec, progress=False)
    start = time.perf_counter()
    seqs = engine.generate(prompts, GenerationConfig(max_new_tokens=new_tokens, ignore_eos=True))
    seconds = time.perf_counter() - start
    outputs = [s.generated_ids for s in seqs]
    return outputs, engine.spec_stats, sum(map(len, outputs)) / seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--model', default=EMBEDDED_MODEL_DIR)
    parser.add_argument('--ks', type=int, nargs='+', default=[1, 2, 3, 4])
    parser.add_argument('--num-prompts', type=int, default=8)
    parser.add_argument('--prompt-tokens', type=int, default=64)
    parser.add_argument('--new-tokens', type=int, default=64)
    parser.add_argument('--dtype', default='float32')
    parser.add_argument('--model-format', default=None, choices=['fp8'],
                        help='fp8: the weights quantized block-wise at load (online FP8)')
    parser.add_argument('--fixed-k', action='store_true',
                        help='draft exactly k every decode step (default: dynamic k)')
    parser.add_argument('--json', default=None, help='write the results here')
    args = parser.parse_args()

    tokenizer = load_tokenizer(args.model)
    prompts = held_out_prompts(tokenizer, args.num_prompts, args.prompt_tokens)
    plain, _, plain_tps = run(args.model, prompts, args.new_tokens, 0, args.dtype,
                              model_format=args.model_format)
    rows = []
    for k in args.ks:
        outputs, stats, tps = run(args.model, prompts, args.new_tokens, k, args.dtype,
                                  dynamic=not args.fixed_k, model_format=args.model_format)
        per_position = [a / stats.num_drafts for a in stats.accepted_per_position]
        rows.append(dict(k=k, mean_accepted_length=stats.mean_accepted_length,
                         acceptance_rate=stats.acceptance_rate, per_position=per_position,
                         verify_steps=stats.num_drafts, tokens_per_s=tps,
                         equals_plain=sum(o == p for o, p in zip(outputs, plain))))
    print(f'{args.model}: {len(prompts)} held-out prompts x {args.prompt_tokens} tokens, '
          f'{args.new_tokens} new tokens each, greedy, {args.dtype} on CPU, '
          f'{"fixed" if args.fixed_k else "dynamic"} k '
          f'(plain: {plain_tps:.0f} tok/s)')
    print('| k | mean accepted length | draft acceptance | per position | outputs = plain |')
    print('|---|---|---|---|---|')
    for r in rows:
        pos = ' / '.join(f'{p:.2f}' for p in r['per_position'])
        print(f"| {r['k']} | {r['mean_accepted_length']:.2f} | {r['acceptance_rate']:.2f} | "
              f"{pos} | {r['equals_plain']}/{len(prompts)} |")
    if args.json:
        with open(args.json, 'w') as f:
            json.dump(dict(model=args.model, prompts=len(prompts),
                           prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens,
                           dtype=args.dtype, fixed_k=args.fixed_k,
                           model_format=args.model_format, plain_tokens_per_s=plain_tps,
                           rows=rows), f, indent=1)


if __name__ == '__main__':
    main()
