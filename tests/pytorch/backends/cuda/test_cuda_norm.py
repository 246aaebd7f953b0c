"""backends/cuda rms_norm, gated_rms_norm and silu_mul against backends/default: fp32 (and fp64)
on any kernel device, odd row widths (masked tails), non-contiguous inputs, empty batches; bf16 at
Qwen3.5 sizes on a GPU."""
from __future__ import annotations

import importlib

import pytest
import torch

from lmdeploy_lite.pytorch.backends.default import norm as reference


def cuda_ops():
    """The kernel module (imported once the `kernel_device` fixture has checked for Triton)."""
    return importlib.import_module('lmdeploy_lite.pytorch.backends.cuda.norm')


def randn(*shape, device, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(device, dtype)


def tolerances(dtype):
    return {torch.float64: dict(atol=1e-12, rtol=1e-12), torch.float32: dict(atol=1e-5, rtol=1e-5),
            }.get(dtype, dict(atol=2e-2, rtol=2e-2))


@pytest.mark.parametrize('dtype', [torch.float32, torch.float64])
@pytest.mark.parametrize('shape', [(7, 1000), (2, 3, 128), (0, 64)])
def test_rms_norm(kernel_device, dtype, shape):
    x = randn(*shape, device=kernel_device, dtype=dtype)
    weight = randn(shape[-1], device=kernel_device, dtype=dtype, seed=1)
    out = cuda_ops().rms_norm(x, weight, 1e-6)
    assert out.shape == x.shape and out.dtype == dtype
    torch.testing.assert_close(out, reference.rms_norm(x, weight, 1e-6), **tolerances(dtype))


@pytest.mark.parametrize('dtype', [torch.float32, torch.float64])
def test_gated_rms_norm_per_head(kernel_device, dtype):
    """[T, heads, dv] as the gated delta net calls it, x a non-contiguous view."""
    x = randn(3, 5, 4, 96, device=kernel_device, dtype=dtype)[:, 1:].transpose(0, 1)
    gate = randn(4, 3, 4, 96, device=kernel_device, dtype=dtype, seed=2)
    weight = randn(96, device=kernel_device, dtype=dtype, seed=1)
    out = cuda_ops().gated_rms_norm(x, gate, weight, 1e-6)
    assert out.shape == x.shape
    torch.testing.assert_close(out, reference.gated_rms_norm(x, gate, weight, 1e-6),
                               **tolerances(dtype))


@pytest.mark.parametrize('shape', [(5, 600), (2, 3, 2 * 48), (0, 32)])
def test_silu_mul(kernel_device, shape):
    gate_up = randn(*shape, device=kernel_device)
    out = cuda_ops().silu_mul(gate_up)
    assert out.shape == (*shape[:-1], shape[-1] // 2)
    torch.testing.assert_close(out, reference.silu_mul(gate_up), atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
def test_norms_bf16_model_sizes(dtype):
    """Hidden 2048 and 8192 rows, GDN output norm [T, 32, 128], MoE/MLP activations, decode to
    prefill batch sizes; fp32 math inside, so the kernels are at least as close to the fp32
    result as the reference is."""
    for tokens in (1, 64, 513):
        for hidden in (2048, 8192):
            x = randn(tokens, hidden, device='cuda', dtype=dtype)
            weight = randn(hidden, device='cuda', dtype=dtype, seed=1) * 0.1
            torch.testing.assert_close(cuda_ops().rms_norm(x, weight, 1e-6),
                                       reference.rms_norm(x, weight, 1e-6), **tolerances(dtype))
        x = randn(tokens, 32, 128, device='cuda', dtype=dtype)
        gate = randn(tokens, 32, 128, device='cuda', dtype=dtype, seed=2)
        weight = 1 + randn(128, device='cuda', dtype=dtype, seed=1) * 0.1
        torch.testing.assert_close(cuda_ops().gated_rms_norm(x, gate, weight, 1e-6),
                                   reference.gated_rms_norm(x, gate, weight, 1e-6),
                                   **tolerances(dtype))
        gate_up = randn(tokens, 2 * 512, device='cuda', dtype=dtype)
        torch.testing.assert_close(cuda_ops().silu_mul(gate_up), reference.silu_mul(gate_up),
                                   **tolerances(dtype))
