"""One gated-delta prefill call at 9B heads (nk 16, nv 32, 128 x 128; bf16, fp32 state, history
1,472 tokens): `_recurrent_prefill_kernel` (device ms per call, host ms per launch) against fla's
chunk function (ms per call, synchronized at the end, and host ms per call), per batch x new
tokens: the measurement behind `SHORT_PREFILL_TOKENS` (issue 21). Needs CUDA and fla-core.

    python benchmarks/bench_gdn_prefill.py
"""
from __future__ import annotations

import argparse
import time

import torch
from common import output_path, print_table, save_json

from lmdeploy_lite.pytorch.backends.cuda import gated_delta_rule as gdr
from lmdeploy_lite.pytorch.model_inputs import ModelInputs

NK, NV, D = 16, 32, 128
CASES = '1x1,1x16,1x48,1x64,1x128,1x256,1x512,1x1024,1x2048,8x48,8x128,32x16'


def make_call(batch: int, q_len: int, history: int) -> tuple:
    """(q, k, v, g, beta, state_cache, inputs) of one step: q/k/v strided views of one
    projection, as the model splits it."""
    tokens = batch * q_len
    gen = torch.Generator().manual_seed(q_len)
    mixed = torch.randn(tokens, 2 * NK * D + NV * D, generator=gen).cuda().bfloat16()
    q, k, v = mixed.split([NK * D, NK * D, NV * D], dim=-1)
    q, k, v = q.view(tokens, NK, D), k.view(tokens, NK, D), v.view(tokens, NV, D)
    g = (-torch.rand(tokens, NV, generator=gen) * 0.5).cuda()
    beta = torch.rand(tokens, NV, generator=gen).cuda().bfloat16()
    cache = (torch.randn(batch + 1, 1, NV, D, D, generator=gen) * 0.3).cuda()
    inputs = ModelInputs(
        input_ids=torch.zeros(tokens, dtype=torch.long),
        positions=torch.zeros(tokens, dtype=torch.long), q_lens=torch.full((batch,), q_len),
        history_lens=torch.full((batch,), history),
        block_tables=torch.zeros(batch, 1, dtype=torch.long),
        state_slots=torch.arange(1, batch + 1), state_index=torch.zeros(batch, dtype=torch.long),
        is_decoding=False).to('cuda')
    inputs.max_q_len                      # the host lengths, once per step as in the engine
    return q, k, v, g, beta, cache, inputs


def timed(fn, iters: int) -> tuple[float, float, float]:
    """(device ms, host ms, wall ms) per call after 3 warm-up calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin = time.perf_counter()
    start.record()
    for _ in range(iters):
        fn()
    host = (time.perf_counter() - begin) / iters * 1e3
    end.record()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - begin) / iters * 1e3
    return start.elapsed_time(end) / iters, host, wall


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--cases', default=CASES, help='batch x new tokens per sequence')
    parser.add_argument('--history', type=int, default=1472)
    parser.add_argument('--iters', type=int, default=20)
    parser.add_argument('--out', default=None)
    args = parser.parse_args()
    rows, limit, cap = [], gdr.SHORT_PREFILL_TOKENS, gdr.CAPTURED_PREFILL_TOKENS
    for case in args.cases.split(','):
        batch, q_len = map(int, case.split('x'))
        call = make_call(batch, q_len, args.history)
        try:
            gdr.SHORT_PREFILL_TOKENS = 1 << 30                    # every step: the kernel
            kernel = timed(lambda: gdr.gated_delta_rule_prefill(*call), args.iters)
            # every step: fla (every row over both limits: its varlen form, or one row alone)
            gdr.SHORT_PREFILL_TOKENS = gdr.CAPTURED_PREFILL_TOKENS = 0
            fla = timed(lambda: gdr.gated_delta_rule_prefill(*call), args.iters)
        finally:
            gdr.SHORT_PREFILL_TOKENS, gdr.CAPTURED_PREFILL_TOKENS = limit, cap
        rows.append({'batch': batch, 'q_len': q_len, 'kernel_dev_ms': kernel[0],
                     'kernel_host_ms': kernel[1], 'fla_ms': fla[2], 'fla_host_ms': fla[1],
                     'fla_over_kernel': fla[2] / kernel[2]})
    save_json(output_path(args.out, 'bench_gdn_prefill.json'), {'history': args.history,
                                                                'rows': rows})
    print_table(rows, list(rows[0]))


if __name__ == '__main__':
    main()
