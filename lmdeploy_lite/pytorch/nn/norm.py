"""Qwen3.5's RMSNorms; the math (dtypes, rounding) is the backend's `rms_norm`, `add_rms_norm`
and `gated_rms_norm` (backends/default/norm.py)."""
from __future__ import annotations

import torch
from torch import nn

from ..backends import get_backend


class RMSNorm(nn.Module):
    """Zero-centred: `x * rsqrt(mean(x^2) + eps) * (1 + w)`, w as in the checkpoint (init 0)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.eps, self.backend = eps, get_backend(device)
        self.weight = nn.Parameter(torch.zeros(dim, dtype=dtype, device=device),
                                   requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x [..., dim] -> norm(x); with a residual [..., dim] -> (norm(s), s), s = residual + x.
        The residual is consumed (the CUDA backend writes s into it): use the returned one."""
        if residual is None:
            return self.backend.rms_norm(x, self.weight, self.eps)
        return self.backend.add_rms_norm(x, residual, self.weight, self.eps)


class GatedRMSNorm(nn.Module):
    """The gated delta net's per-head output norm: `w * norm(o) * silu(z)` (plain w, init 1)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.eps, self.backend = eps, get_backend(device)
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return self.backend.gated_rms_norm(x, gate, self.weight, self.eps)
