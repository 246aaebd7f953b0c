"""Tiling of the Triton gated-delta decode kernel: time (and bandwidth over the state bytes read +
written) per (block_v, num_warps) for the 0.8B and 9B head counts at a batch, 1 and k+1 tokens,
fp32 and bf16 state; and the largest output difference against the first tiling (0 for an fp32
state, whose sums are fixed trees). The timed launches are captured in one CUDA graph, so
small batches show the kernel, not the launch.

    python benchmarks/tune_gdn_decode.py --batch 64
    python benchmarks/tune_gdn_decode.py --batch 1 --state float32 --configs 64x4,32x2,32x4,16x1
"""
from __future__ import annotations

import argparse
import itertools

import torch
import triton
from common import output_path, print_table, save_json

from lmdeploy_lite.pytorch.backends.cuda.gated_delta_rule import _recurrent_decode_kernel


def launch(q, k, v, g, beta, state, slots, index, hist, n, bv, warps):
    num_tokens, nv, dv = v.shape
    dk = q.shape[-1]
    out = torch.empty_like(v)
    tree = state.dtype != torch.bfloat16          # as the engine's launch: tree sums, fp32 state
    grid = (slots.numel(), nv, triton.cdiv(dv, bv))
    _recurrent_decode_kernel[grid](
        q, k, v, g, beta, out, state, slots, index, hist,
        *q.stride(), *k.stride(), *v.stride(), *g.stride(), *beta.stride(), *out.stride(),
        *state.stride(), dk ** -0.5, NUM_TOKENS=n, ACC_FP64=False, HEAD_RATIO=nv // q.shape[1],
        DK=dk, DV=dv, BK=triton.next_power_of_2(dk), BV=bv,
        TREE_LEVELS=tree * (triton.next_power_of_2(dk).bit_length() - 1), num_warps=warps,
        enable_fp_fusion=not tree)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--batch', type=int, default=64)
    parser.add_argument('--configs', default='8x1,16x1,16x2,32x2,32x4,64x4,64x8,128x8',
                        help='block_v x num_warps, the first one the reference')
    parser.add_argument('--iters', type=int, default=30)
    parser.add_argument('--state', default='float32,bfloat16', help='state dtypes')
    parser.add_argument('--out', default=None)
    args = parser.parse_args()
    configs = [tuple(map(int, c.split('x'))) for c in args.configs.split(',')]
    rows = []
    for (name, nk, nv), n, sdtype in itertools.product(
            [('0.8B', 16, 16), ('9B', 16, 32)], [1, 4], [getattr(torch, d) for d in args.state.split(',')]):
        b, dk = args.batch, 128
        gen = torch.Generator('cuda').manual_seed(0)
        q, k = (torch.randn(b * n, nk, dk, device='cuda', dtype=torch.bfloat16, generator=gen)
                for _ in range(2))
        v = torch.randn(b * n, nv, dk, device='cuda', dtype=torch.bfloat16, generator=gen)
        g = -torch.rand(b * n, nv, device='cuda', generator=gen)
        beta = torch.rand(b * n, nv, device='cuda', dtype=torch.bfloat16, generator=gen)
        state0 = torch.randn(b + 1, n, nv, dk, dk, device='cuda', generator=gen).to(sdtype) * 0.1
        slots = torch.arange(1, b + 1, device='cuda')
        index = torch.zeros(b, dtype=torch.long, device='cuda')
        hist = torch.ones(b, dtype=torch.long, device='cuda')
        nbytes = b * nv * dk * dk * state0.element_size() * (1 + n)
        ref = None
        for bv, warps in configs:
            state = state0.clone()
            out = launch(q, k, v, g, beta, state, slots, index, hist, n, bv, warps)
            if ref is None:
                ref, ref_state = out.float().clone(), state.float().clone()
            diff = max((out.float() - ref).abs().max().item(),      # 0: the same bits
                       (state.float() - ref_state).abs().max().item())
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(args.iters):
                    launch(q, k, v, g, beta, state, slots, index, hist, n, bv, warps)
            graph.replay()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            torch.cuda.synchronize()
            us = 1000 * start.elapsed_time(end) / args.iters
            rows.append({'shape': name, 'tokens': n, 'state': str(sdtype)[6:], 'block_v': bv,
                         'warps': warps, 'us': us, 'tb_s': nbytes / us / 1e6, 'max_diff': diff})
    save_json(output_path(args.out, 'tune_gdn_decode.json'), {'batch': args.batch, 'rows': rows})
    print_table(rows, ['shape', 'tokens', 'state', 'block_v', 'warps', 'us', 'tb_s', 'max_diff'])


if __name__ == '__main__':
    main()
