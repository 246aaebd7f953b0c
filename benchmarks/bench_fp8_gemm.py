"""The block-scaled FP8 GEMM (backends/cuda/fp8_gemm.py: activation quantization + GEMM) against
bf16 `x @ w.T` (cuBLAS) at the linear shapes of a preset, 1 to 64 rows (decode), timed as CUDA
graph replays (no launch overhead): microseconds each, the speed-up, the FP8 path's bandwidth
against the HBM peak, and one decode step's linear layers summed (each shape times the layers
that have it, projections fused as the engine fuses them).

    python benchmarks/bench_fp8_gemm.py --preset qwen3_5_9b --rows 1,16,64
    python benchmarks/bench_fp8_gemm.py --preset qwen3_5_9b --rows 1,16,64 --sweep

`--sweep`: every (BLOCK_N, splits, warps, stages) of a grid timed per shape and row count, the
best beside `gemm_config`'s choice (what the heuristic is tuned from); the GEMM alone, on
activations quantized before.
"""
from __future__ import annotations

import argparse

import torch
from common import environment, output_path, print_table, save_json
from presets import preset_config


def step_linears(name: str) -> dict[tuple[int, int], int]:
    """(N, K) -> how many of that linear one decode step of the target runs (fused as built)."""
    c = preset_config(name)
    h, d, layers = c['hidden_size'], c['head_dim'], c['num_hidden_layers']
    full = layers // c['full_attention_interval']
    dk, dv = c['linear_key_head_dim'], c['linear_value_head_dim']
    kh, vh = c['linear_num_key_heads'], c['linear_num_value_heads']
    heads, kv = c['num_attention_heads'], c['num_key_value_heads']
    shapes: dict[tuple[int, int], int] = {}

    def add(shape, count):
        shapes[shape] = shapes.get(shape, 0) + count
    add((2 * heads * d + 2 * kv * d, h), full)             # q (gated) + k + v, fused
    add((h, heads * d), full)                              # o
    add((2 * kh * dk + 2 * vh * dv, h), layers - full)     # in_proj qkv + z, fused
    add((h, vh * dv), layers - full)                       # out_proj
    inter = c.get('intermediate_size') or c.get('shared_expert_intermediate_size')
    add((2 * inter, h), layers)                            # gate + up (dense or shared expert)
    add((h, inter), layers)                                # down
    return shapes


def time_us(fn, rep: int = 50) -> float:
    import triton.testing
    return triton.testing.do_bench_cudagraph(fn, rep=rep) * 1000


def sweep(preset: str, rows: list[int]) -> list[dict]:
    import itertools

    from lmdeploy_lite.pytorch.backends.cuda.fp8_gemm import (fp8_block_matmul, gemm_config,
                                                              quantize_activations)
    from lmdeploy_lite.pytorch.models.fp8 import dequantize, quantize
    device = torch.device('cuda')
    out = []
    for (n, k), count in sorted(step_linears(preset).items()):
        wq, ws = (t.cuda() for t in quantize(torch.randn(n, k) * 0.02))
        for m in rows:
            xq, xs = quantize_activations(torch.randn(m, k, device='cuda', dtype=torch.bfloat16))
            default = gemm_config(m, n, k, device)
            block_m = default[0]
            timed = {}
            grid = (itertools.product((block_m,), (32, 64, 128, 256), (1, 2, 4, 8), (4,),
                                      (3, 4, 6)) if m <= 64 else
                    itertools.product((64, 128), (64, 128, 256), (1,), (4, 8), (3, 4)))
            for config in grid:
                try:
                    timed[config] = time_us(lambda: fp8_block_matmul(
                        xq, xs, wq, ws, torch.bfloat16, config), rep=15)
                except Exception:                   # out of shared memory, ...
                    continue
            best = min(timed, key=timed.get)
            wb = dequantize(wq, ws).to(torch.bfloat16)
            x = torch.randn(m, k, device='cuda', dtype=torch.bfloat16)
            out.append({'n': n, 'k': k, 'layers': count, 'm': m,
                        'bf16_us': time_us(lambda: x @ wb.T, rep=15), 'default': str(default),
                        'default_us': timed.get(default, float('nan')), 'best': str(best),
                        'best_us': timed[best], 'best_tb_s': n * k / timed[best] / 1e6})
            print(out[-1], flush=True)
    print_table(out, ['n', 'k', 'layers', 'm', 'bf16_us', 'default', 'default_us', 'best',
                      'best_us', 'best_tb_s'])
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--preset', default='qwen3_5_9b')
    parser.add_argument('--rows', default='1,16,64')
    parser.add_argument('--hbm-tb-s', type=float, default=3.35, help='HBM peak (H100 SXM)')
    parser.add_argument('--sweep', action='store_true', help='time a grid of kernel configs')
    parser.add_argument('--out', default=None)
    args = parser.parse_args()
    if args.sweep:
        rows = sweep(args.preset, [int(m) for m in args.rows.split(',')])
        save_json(output_path(args.out, f'sweep_fp8_gemm_{args.preset}.json'),
                  {'environment': environment(), 'preset': args.preset, 'rows': rows})
        return
    from lmdeploy_lite.pytorch.backends.cuda.fp8_gemm import fp8_linear
    from lmdeploy_lite.pytorch.models.fp8 import quantize
    rows, totals = [], {}
    for (n, k), count in sorted(step_linears(args.preset).items()):
        w = torch.randn(n, k, device='cuda') * 0.02
        wb = w.to(torch.bfloat16)
        wq, ws = (t.cuda() for t in quantize(w.cpu()))
        for m in map(int, args.rows.split(',')):
            x = torch.randn(m, k, device='cuda', dtype=torch.bfloat16)
            bf16 = time_us(lambda: x @ wb.T)
            fp8 = time_us(lambda: fp8_linear(x, wq, ws))
            gb = (n * k + ws.numel() * 4 + m * k * 2 + m * n * 2) / fp8 / 1e3
            rows.append({'n': n, 'k': k, 'layers': count, 'm': m, 'bf16_us': bf16, 'fp8_us': fp8,
                         'speedup': bf16 / fp8, 'fp8_tb_s': gb / 1e3,
                         'of_hbm_peak': gb / 1e3 / args.hbm_tb_s})
            total = totals.setdefault(m, [0.0, 0.0])
            total[0] += bf16 * count
            total[1] += fp8 * count
    summary = [{'m': m, 'step_linears_bf16_us': b, 'step_linears_fp8_us': f, 'speedup': b / f}
               for m, (b, f) in totals.items()]
    print(f'{args.preset}: {torch.cuda.get_device_name()}')
    print_table(rows, ['n', 'k', 'layers', 'm', 'bf16_us', 'fp8_us', 'speedup', 'fp8_tb_s',
                       'of_hbm_peak'])
    print_table(summary, ['m', 'step_linears_bf16_us', 'step_linears_fp8_us', 'speedup'])
    save_json(output_path(args.out, f'bench_fp8_gemm_{args.preset}.json'),
              {'environment': environment(), 'preset': args.preset, 'rows': rows,
               'step': summary})


if __name__ == '__main__':
    main()
