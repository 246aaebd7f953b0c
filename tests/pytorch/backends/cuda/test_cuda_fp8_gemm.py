"""backends/cuda/fp8_gemm (the block-scaled FP8 GEMM) against the float32 reference on the
dequantized weights (models/fp8.py): the activations quantized exactly as models/fp8.quantize would,
the product within the tensor cores' FP8 accumulation error of the float32 one; within FP8's
activation error against the unquantized activations. GPU only: Triton's CPU interpreter rounds some
values to FP8 wrongly (124.3 -> 64 where round-to-nearest gives 128), so it cannot stand for the
hardware here. Small odd shapes, the linear shapes of every preset (0.8B, 9B, 35B-A3B: attention,
gated delta net, dense FFN, experts) at 1 to 300 rows, and a call captured in a CUDA graph."""
from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

from lmdeploy_lite.pytorch.models.fp8 import BLOCK, dequantize, quantize

BENCHMARKS = os.path.join(os.path.dirname(__file__), '..', '..', '..', '..', 'benchmarks')


def ops():
    return importlib.import_module('lmdeploy_lite.pytorch.backends.cuda.fp8_gemm')


def check(m: int, n: int, k: int, device: str, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=gen) * 2).to(torch.bfloat16)
    w = torch.randn(n, k, generator=gen) * (0.02 + torch.rand(n, 1, generator=gen))
    wq, ws = quantize(w)
    xq, xs = ops().quantize_activations(x.to(device))
    # the activations' scales and values are quantize()'s rule applied per (row, group of 128)
    xq_ref, xs_ref = quantize(x.float().view(m, 1, k))
    torch.testing.assert_close(xs.cpu(), xs_ref.view(m, -1), rtol=0, atol=0)
    torch.testing.assert_close(xq.cpu().float(), xq_ref.view(m, k).float(), rtol=0, atol=0)
    out = ops().fp8_block_matmul(xq, xs, wq.to(device), ws.to(device), torch.float32).cpu()
    exact = dequantize(xq.cpu().view(m, 1, k), xs.cpu().view(m, 1, -1)).view(m, k) @ \
        dequantize(wq, ws).T
    # Hopper's FP8 MMA adds a 128-wide block's products with fewer bits than fp32 (DeepSeek-V3
    # reports ~14); the blocks are then summed in fp32, so the error stays near 1e-4 of the range
    torch.testing.assert_close(out, exact, rtol=1e-3, atol=1e-3 * exact.abs().max().item())
    bf16 = ops().fp8_linear(x.to(device), wq.to(device), ws.to(device)).cpu()
    assert bf16.dtype == torch.bfloat16 and bf16.shape == (m, n)
    full = x.float() @ dequantize(wq, ws).T            # activations not quantized
    error = (bf16.float() - full).norm() / full.norm()
    assert error < 0.05, f'relative error {error:.4f} at M={m} N={n} K={k}'


pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason='needs CUDA')]


@pytest.mark.parametrize('m,n,k', [(1, 64, 128), (5, 200, 300), (17, 130, 96)])
def test_fp8_gemm_partial_blocks(m, n, k):
    check(m, n, k, 'cuda')


def preset_shapes(name: str) -> set[tuple[int, int]]:
    """(N, K) of every quantized linear of a preset (models/fp8.quantizable's set)."""
    if BENCHMARKS not in sys.path:
        sys.path.insert(0, BENCHMARKS)
    from presets import preset_config
    c = preset_config(name)
    h, d = c['hidden_size'], c['head_dim']
    dk, dv = c['linear_key_head_dim'], c['linear_value_head_dim']
    kh, vh = c['linear_num_key_heads'], c['linear_num_value_heads']
    shapes = {(2 * c['num_attention_heads'] * d, h), (c['num_key_value_heads'] * d, h),
              (h, c['num_attention_heads'] * d), (2 * kh * dk + vh * dv, h), (vh * dv, h),
              (h, vh * dv)}
    for inter in (c.get('intermediate_size'), c.get('moe_intermediate_size'),
                  c.get('shared_expert_intermediate_size')):
        if inter:
            shapes |= {(inter, h), (2 * inter, h), (h, inter)}
    return shapes


@pytest.mark.parametrize('preset', ['qwen3_5_0_8b', 'qwen3_5_9b', 'qwen3_5_35b_a3b'])
def test_fp8_gemm_at_every_preset_shape(preset):
    for n, k in sorted(preset_shapes(preset)):
        for m in (1, 16, 64, 300):
            check(m, n, k, 'cuda', seed=n + k + m)


def test_fp8_linear_replays_in_a_cuda_graph():
    x = torch.randn(8, 4096, device='cuda', dtype=torch.bfloat16)
    wq, ws = (t.cuda() for t in quantize(torch.randn(1024, 4096) * 0.05))
    want = ops().fp8_linear(x, wq, ws)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops().fp8_linear(x, wq, ws)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.testing.assert_close(out, ops().fp8_linear(x, wq, ws), rtol=0, atol=0)
    assert not torch.equal(out, want)
    assert BLOCK == ops().GROUP
