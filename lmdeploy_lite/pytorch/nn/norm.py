"""RMSNorm variants used by Qwen3.5.

`RMSNorm` is zero-centred: `y = x / rms(x) * (1 + w)` with w stored as in the checkpoint (initialised
to 0), computed in float32 (float64 for a float64 model) and cast back. `GatedRMSNorm` is the gated
delta net's output norm: plain `w`, norm before the SiLU gate.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype for norms, softmax and recurrent state: float64 stays float64, else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm over the last dim of size `dim`: `x * rsqrt(mean(x^2) + eps) * (1 + w)`."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        acc = compute_dtype(x.dtype)
        xf = x.to(acc)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.to(acc))).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """Per-head output norm of the gated delta net: `w * norm(o) * silu(z)` over the last dim."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        acc = compute_dtype(x.dtype)
        xf = x.to(acc)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        y = self.weight * xf.to(x.dtype)
        return (y * F.silu(gate.to(acc))).to(x.dtype)
