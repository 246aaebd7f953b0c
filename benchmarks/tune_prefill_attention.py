"""Tile sizes of the paged prefill attention kernel (`paged_attention._prefill_kernel`) for long
prompts: one fresh sequence of T tokens at the Qwen3.5 0.8B (8 / 2 heads) and 9B (16 / 4 heads)
attention shapes (head_dim 256, bf16, 64-token KV blocks), each (BLOCK_M, BLOCK_N, warps,
stages) timed (CUDA events, median of 10) and checked against the shipped tiles' output.

    python benchmarks/tune_prefill_attention.py --tokens 2048,8192
"""
from __future__ import annotations

import argparse
import json

import torch

from lmdeploy_lite.pytorch.backends.cuda import paged_attention as pa
from lmdeploy_lite.pytorch.model_inputs import ModelInputs

CONFIGS = [(64, 32, 8, 2), (64, 64, 8, 2), (128, 32, 8, 2), (128, 64, 8, 2), (128, 32, 8, 3),
           (64, 64, 4, 2), (128, 64, 4, 2), (64, 128, 8, 2), (128, 128, 8, 2), (64, 32, 4, 3)]


def inputs_for(tokens: int, block_size: int, device) -> ModelInputs:
    long = dict(dtype=torch.long, device=device)
    return ModelInputs(
        input_ids=torch.zeros(tokens, **long), positions=torch.arange(tokens, **long),
        q_lens=torch.tensor([tokens], **long), history_lens=torch.zeros(1, **long),
        block_tables=torch.arange(tokens // block_size, **long)[None],
        state_slots=torch.zeros(1, **long), state_index=torch.zeros(1, **long),
        is_decoding=False, host_lens=([tokens], [tokens]))


def timed(fn, repeats: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--tokens', default='2048,8192')
    parser.add_argument('--out', default=None)
    args = parser.parse_args()
    device, dim, block = torch.device('cuda'), 256, 64
    shipped = (pa._prefill_tile_sizes, pa._launch_options)
    rows = []
    for name, heads, kv_heads in (('0.8B', 8, 2), ('9B', 16, 4)):
        for tokens in map(int, args.tokens.split(',')):
            gen = torch.Generator(device=device).manual_seed(0)
            q = torch.randn(tokens, heads, dim, device=device, generator=gen).bfloat16()
            k_cache, v_cache = (torch.randn(tokens // block, block, kv_heads, dim, device=device,
                                            generator=gen).bfloat16() for _ in range(2))
            flops = 2 * tokens * tokens * heads * dim          # causal: half of 4 L^2 h d
            pa._prefill_tile_sizes, pa._launch_options = shipped
            ref = pa.prefill_attention(q, k_cache, v_cache, inputs_for(tokens, block, device),
                                       dim ** -0.5)
            for bm, bn, warps, stages in CONFIGS:
                pa._prefill_tile_sizes = lambda q, bm=bm, bn=bn: (bm, bn)
                pa._launch_options = lambda q, m, d, w=warps, s=stages: dict(
                    BLOCK_D=d, DOT_PRECISION='tf32', num_warps=w, num_stages=s)
                inputs = inputs_for(tokens, block, device)
                try:
                    out = pa.prefill_attention(q, k_cache, v_cache, inputs, dim ** -0.5)
                    ms = timed(lambda: pa.prefill_attention(q, k_cache, v_cache, inputs,
                                                            dim ** -0.5))
                    diff = (out.float() - ref.float()).abs().max().item()
                except Exception as e:       # out of shared memory or registers
                    ms, diff = float('inf'), str(e)[:40]
                rows.append(dict(shape=name, tokens=tokens, block_m=bm, block_n=bn, warps=warps,
                                 stages=stages, ms=ms, tflops=flops / ms / 1e9, max_diff=diff))
                print(f'{name:>5} {tokens:>5} {bm:>4} {bn:>4} {warps:>2} {stages} '
                      f'{ms:8.3f} ms {flops / ms / 1e9:7.1f} TFLOP/s  diff {diff}', flush=True)
    pa._prefill_tile_sizes, pa._launch_options = shipped
    if args.out:
        with open(args.out, 'w') as f:
            json.dump(rows, f, indent=1)


if __name__ == '__main__':
    main()
