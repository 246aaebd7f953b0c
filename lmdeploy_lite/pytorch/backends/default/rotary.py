"""RoPE's cos/sin rows (`nn/rotary.py`); reference for `backends/cuda/rotary.py`."""
from __future__ import annotations

import torch


def rotary_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] long, inv_freq [R / 2] -> (cos, sin), each [T, R] in `dtype`: the angles
    positions * inv_freq in inv_freq's dtype, cos of [f, f] and sin of [f, f] with its first half
    negated (rotate_half's sign folded in)."""
    freqs = positions.to(inv_freq.dtype)[:, None] * inv_freq[None, :]
    sin = freqs.sin()
    return (torch.cat([freqs, freqs], dim=-1).cos().to(dtype),
            torch.cat([-sin, sin], dim=-1).to(dtype))
