"""Output tokens/s of `pipeline()` (any layout: tp/dp/ep through the mp executor) for batches of
concurrent requests, e.g. the Qwen3.5-35B-A3B shape with dp=2 ep=2 on two GPUs beside one GPU.

    python benchmarks/bench_pipeline.py --preset qwen3_5_35b_a3b --device cuda --dtype bfloat16 \
        --dp 2 --ep 2 --batch-sizes 1,16,64,128
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
from common import add_model_args, output_path, print_table, resolve_model, save_json

from lmdeploy_lite import GenerationConfig, PytorchEngineConfig, SpeculativeConfig, pipeline


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser)
    parser.add_argument('--tp', type=int, default=1)
    parser.add_argument('--dp', type=int, default=1)
    parser.add_argument('--ep', type=int, default=1)
    parser.add_argument('--spec-k', type=int, default=0, help='MTP draft tokens (0: off)')
    parser.add_argument('--batch-sizes', default='1,16,64')
    parser.add_argument('--prompt-len', type=int, default=128)
    parser.add_argument('--new-tokens', type=int, default=64)
    parser.add_argument('--eager-mode', action='store_true', help='no CUDA graphs')
    parser.add_argument('--repeats', type=int, default=2,
                        help='runs per batch size; the fastest counts (the first one may pay '
                             'for kernel compiles of new prefill shapes)')
    parser.add_argument('--out', default=None)
    args = parser.parse_args()
    model_dir, load_format = resolve_model(args)
    batch_sizes = [int(b) for b in args.batch_sizes.split(',')]
    cfg = PytorchEngineConfig(dtype=args.dtype, device=args.device, tp=args.tp, dp=args.dp,
                              ep=args.ep, max_batch_size=max(batch_sizes), session_len=1024,
                              load_format=load_format, seed=args.seed,
                              eager_mode=args.eager_mode, async_scheduling=args.async_scheduling)
    spec = SpeculativeConfig(num_speculative_tokens=args.spec_k) if args.spec_k else None
    pipe = pipeline(model_dir, backend_config=cfg, speculative_config=spec)
    gen = GenerationConfig(max_new_tokens=args.new_tokens, ignore_eos=True)
    with open(os.path.join(model_dir, 'config.json')) as f:
        config = json.load(f)
    vocab = config.get('text_config', config)['vocab_size']
    rows = []
    try:
        pipe([[5] * 16] * 2, GenerationConfig(max_new_tokens=4, ignore_eos=True))   # warm-up
        for bs in batch_sizes:
            prompts = torch.randint(2, vocab, (bs, args.prompt_len),
                                    generator=torch.Generator().manual_seed(bs)).tolist()
            seconds = float('inf')
            for _ in range(args.repeats):
                start = time.perf_counter()
                outputs = pipe(prompts, gen)
                seconds = min(seconds, time.perf_counter() - start)
            tokens = sum(len(o.token_ids) for o in outputs)
            rows.append({'batch': bs, 'layout': f'tp{args.tp} dp{args.dp} ep{args.ep}',
                         'graphs': not args.eager_mode, 'spec_k': args.spec_k, 'seconds': seconds,
                         'output_tok_s': tokens / seconds})
    finally:
        pipe.close()
    save_json(output_path(args.out, 'bench_pipeline.json'), {'args': vars(args), 'rows': rows})
    print_table(rows, ['layout', 'graphs', 'spec_k', 'batch', 'seconds', 'output_tok_s'])


if __name__ == '__main__':
    main()
