"""The recurrent prefill walk (`_recurrent_prefill_kernel`) at a graph's shape: `--rows` sequences
walking `--tokens` new tokens each beside `--decode-rows` of one token and `--padding-rows` of
none (a bucket's unused rows), 0.8B / 9B value heads, an fp32 state; time per call for each
config, all calls captured in one CUDA graph; and the output's difference from the first
config's, relative in norm (0: fixed-tree sums). A config is `single` (one launch,
`decode_tiling` by the batch), `engine` (`recurrent_prefill` as the engine calls it), a forced
tiling `BVxWARPS` for one launch, `walk` (`recurrent_prefill` with the token-by-token walk for
every row, as a float32 model has it) or `cBVxW` (`recurrent_prefill` with bf16 rows of several
tokens in chunks, `gdn_chunk`, in programs of BV value columns, W resident a multiprocessor).

    python benchmarks/tune_gdn_prefill.py --rows 16 --tokens 32 --decode-rows 48
    python benchmarks/tune_gdn_prefill.py --rows 0 --decode-rows 48 --configs single,engine
"""
from __future__ import annotations

import argparse
from functools import partial

import torch

from lmdeploy_lite.pytorch.backends.cuda import gated_delta_rule as gdr
from tests.helpers.step_inputs import make_inputs, shuffled_block_tables


def one_launch(q, k, v, g, beta, cache, inputs, start_loc):
    """The walk as one launch over every row (the tiling `decode_tiling` gives)."""
    return gdr._launch(gdr._recurrent_prefill_kernel, q, k, v, g, beta, cache, inputs,
                       start_loc, inputs.q_lens, inputs.q_lens, ROWS=0)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--rows', type=int, default=16)
    parser.add_argument('--tokens', type=int, default=32)
    parser.add_argument('--decode-rows', type=int, default=48)
    parser.add_argument('--padding-rows', type=int, default=0)
    parser.add_argument('--configs', default='single,engine,64x4,32x2,16x1')
    parser.add_argument('--reps', type=int, default=20)
    args = parser.parse_args()
    # the engine's: restored for every config
    tiling = gdr.decode_tiling
    chunked = gdr.CHUNKED_DTYPES, gdr.CHUNK_BLOCK_V, gdr.CHUNK_WALKERS_PER_SM
    for name, (nk, nv) in {'0.8B': (16, 16), '9B': (16, 32)}.items():
        q_lens = [args.tokens] * args.rows + [1] * args.decode_rows + [0] * args.padding_rows
        batch, dk = len(q_lens), 128
        inputs = make_inputs([[0] * n for n in q_lens], [5] * batch,
                             shuffled_block_tables(batch, 4), list(range(1, batch + 1)),
                             [0] * batch, False).to('cuda')
        t = sum(q_lens)
        mixed = torch.randn(t, 2 * nk * dk + nv * dk, device='cuda', dtype=torch.bfloat16)
        q, k, v = mixed.split([nk * dk, nk * dk, nv * dk], dim=-1)
        q, k, v = q.view(t, nk, dk), k.view(t, nk, dk), v.view(t, nv, dk)
        g = -torch.rand(t, nv, device='cuda') * 0.5
        beta = torch.rand(t, nv, device='cuda', dtype=torch.bfloat16)
        state = torch.randn(batch + 1, 1, nv, dk, dk, device='cuda') * 0.3
        first, rows = None, []
        for config in args.configs.split(','):
            gdr.decode_tiling = tiling
            gdr.CHUNKED_DTYPES, gdr.CHUNK_BLOCK_V, gdr.CHUNK_WALKERS_PER_SM = chunked
            if config == 'walk':
                gdr.CHUNKED_DTYPES = ()
            elif config.startswith('c'):
                gdr.CHUNK_BLOCK_V, gdr.CHUNK_WALKERS_PER_SM = map(int, config[1:].split('x'))
            elif 'x' in config:
                bv, warps = map(int, config.split('x'))
                gdr.decode_tiling = lambda dv, programs, bv=bv, warps=warps: (bv, warps)
            engine = config in ('engine', 'walk') or config.startswith('c')
            call = gdr.recurrent_prefill if engine else partial(
                one_launch, start_loc=inputs.q_start_loc)
            cache = state.clone()
            out = call(q, k, v, g, beta, cache, inputs)
            diff = 0.0 if first is None else ((out.float() - first.float()).norm()
                                              / first.float().norm()).item()
            first = out if first is None else first
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(args.reps):
                    call(q, k, v, g, beta, cache, inputs)
            graph.replay()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            torch.cuda.synchronize()
            rows.append((config, 1000 * start.elapsed_time(end) / args.reps, diff))
        print(f'{name}: {args.rows} rows x {args.tokens} tokens + {args.decode_rows} decode rows'
              f' + {args.padding_rows} padding rows')
        for config, us, diff in rows:
            print(f'  {config:>6}: {us:8.1f} us a call, relative diff {diff:.3g}')


if __name__ == '__main__':
    main()
