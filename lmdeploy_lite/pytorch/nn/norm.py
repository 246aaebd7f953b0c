"""RMSNorm variants used by Qwen3.5; the math is the backend's (`rms_norm`, `gated_rms_norm`).

`RMSNorm` is zero-centred: `y = x / rms(x) * (1 + w)` with w stored as in the checkpoint (initialised
to 0), computed in float32 (float64 for a float64 model) and cast back; given a residual it adds
it first (`add_rms_norm`, one fused kernel on CUDA). `GatedRMSNorm` is the gated delta net's
output norm: plain `w`, norm before the SiLU gate.
"""
from __future__ import annotations

import torch
from torch import nn

from ..backends import get_backend
from ..backends.default.norm import compute_dtype

__all__ = ['RMSNorm', 'GatedRMSNorm', 'compute_dtype']


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm over the last dim of size `dim`: `x * rsqrt(mean(x^2) + eps) * (1 + w)`."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.eps = eps
        self.backend = get_backend(device)
        self.weight = nn.Parameter(torch.zeros(dim, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x [..., dim] -> norm(x); with a residual [..., dim] -> (norm(s), s), s = residual + x.
        The residual is consumed (the CUDA backend writes s into it): use the returned one."""
        if residual is None:
            return self.backend.rms_norm(x, self.weight, self.eps)
        return self.backend.add_rms_norm(x, residual, self.weight, self.eps)


class GatedRMSNorm(nn.Module):
    """Per-head output norm of the gated delta net: `w * norm(o) * silu(z)` over the last dim."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.eps = eps
        self.backend = get_backend(device)
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return self.backend.gated_rms_norm(x, gate, self.weight, self.eps)
