"""RMSNorm variants of Qwen3.5 and the SwiGLU activation, in plain PyTorch.

`rms_norm` is zero-centred (`x / rms(x) * (1 + w)`, w as stored in the checkpoint), computed in
float32 (float64 for float64 inputs) and cast back; `F.rms_norm` computes
`x * rsqrt(mean(x^2) + eps) * w'` in one call. `add_rms_norm` is the decoder layer's residual
add followed by that norm (unfused here: the reference the CUDA kernel is checked against).
`gated_rms_norm` is the gated delta net's per-head output norm: plain `w`, the norm rounded to
x.dtype before the weight, then the SiLU gate.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype for norms, softmax and recurrent state: float64 stays float64, else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D], weight [D] -> `x * rsqrt(mean(x^2) + eps) * (1 + w)` [..., D] in x.dtype."""
    acc = compute_dtype(x.dtype)
    return F.rms_norm(x.to(acc), x.shape[-1:], 1.0 + weight.to(acc), eps).to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [..., D] (same dtype), weight [D] -> (rms_norm(s), s) with s = residual + x
    rounded to x.dtype: the norm reads the rounded sum, exactly as an add followed by `rms_norm`.
    The caller must use the returned residual and treat `residual` as consumed (the CUDA kernel
    writes the sum into it)."""
    new_residual = residual + x
    return rms_norm(new_residual, weight, eps), new_residual


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                   eps: float) -> torch.Tensor:
    """x, gate [..., D], weight [D] -> `w * norm(x).to(x.dtype) * silu(gate)` [..., D] in x.dtype
    (the gate's SiLU and the product in the compute dtype)."""
    acc = compute_dtype(x.dtype)
    y = weight * F.rms_norm(x.to(acc), x.shape[-1:], None, eps).to(x.dtype)
    return (y * F.silu(gate.to(acc))).to(x.dtype)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2I] (gate first) -> `silu(gate) * up` [..., I] in gate_up.dtype."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
