"""Decode attention's device time for batches of equal and of mixed lengths, the splits of
`paged_attention.decode_attention` at SPREAD = 1 (every sequence split alike, as before
2026-11-27) against the shipped SPREAD, each call replayed in a CUDA graph (device time only).

    python benchmarks/bench_decode_attention.py [--heads 8 --kv-heads 2 --head-dim 256]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from lmdeploy_lite.pytorch.backends.cuda import paged_attention as ops  # noqa: E402
from lmdeploy_lite.pytorch.model_inputs import ModelInputs  # noqa: E402

# (name, history lengths): the 0.8B's bench_itl streams with and without an 8k row, and more
CASES = [('1 x 8k', [8192]), ('32 x 150', [150] * 32), ('32 x 150 + 1 x 8k', [150] * 32 + [8192]),
         ('64 x 2k', [2048] * 64), ('63 x 300 + 1 x 16k', [300] * 63 + [16384]),
         ('256 x 500', [500] * 256), ('255 x 500 + 1 x 8k', [500] * 255 + [8192])]


def inputs_for(histories: list[int], q_len: int, block_size: int, max_blocks: int,
               device) -> ModelInputs:
    batch = len(histories)
    tables = torch.arange(1, 1 + batch * max_blocks, device=device).view(batch, max_blocks)
    lens = torch.tensor(histories, device=device)
    ids = torch.zeros(batch * q_len, dtype=torch.long, device=device)
    return ModelInputs(ids, ids, torch.full((batch,), q_len, device=device), lens, tables,
                       torch.zeros(batch, dtype=torch.long, device=device),
                       torch.zeros(batch, dtype=torch.long, device=device), is_decoding=True,
                       uniform_q_len=q_len)


def time_graph(fn, iters: int = 50) -> float:
    """Microseconds per replay of `fn` captured in a CUDA graph."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return 1000 * start.elapsed_time(end) / iters


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--heads', type=int, default=8)
    parser.add_argument('--kv-heads', type=int, default=2)
    parser.add_argument('--head-dim', type=int, default=256)
    parser.add_argument('--block-size', type=int, default=64)
    parser.add_argument('--q-len', type=int, default=1)
    parser.add_argument('--out', default=None)
    args = parser.parse_args()
    device, shipped = torch.device('cuda'), ops.SPREAD
    rows = []
    for name, histories in CASES:
        max_blocks = -(-(max(histories) + args.q_len) // args.block_size) + 1
        blocks = 1 + len(histories) * max_blocks
        cache = [torch.randn(blocks, args.block_size, args.kv_heads, args.head_dim,
                             dtype=torch.bfloat16, device=device) for _ in range(2)]
        q = torch.randn(len(histories) * args.q_len, args.heads, args.head_dim,
                        dtype=torch.bfloat16, device=device)
        row = {'case': name}
        for spread in (1, shipped):
            ops.SPREAD = spread
            inputs = inputs_for(histories, args.q_len, args.block_size, max_blocks, device)
            row[f'spread{spread}_us'] = time_graph(
                lambda: ops.decode_attention(q, *cache, inputs, args.head_dim ** -0.5))
        ops.SPREAD = shipped
        rows.append(row)
        print(f'{name:<22} ' + '  '.join(f'{k} {v:8.1f}' for k, v in row.items() if k != 'case'),
              flush=True)
    if args.out:
        with open(args.out, 'w') as f:
            json.dump({'args': vars(args), 'device': torch.cuda.get_device_name(), 'rows': rows},
                      f, indent=1)


if __name__ == '__main__':
    main()
