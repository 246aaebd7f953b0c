"""Partial NeoX rotary embedding (Qwen3.5 text: mRoPE with equal positions == 1-D RoPE).

Only the first `rotary_dim` channels of each head are rotated (rotate_half style); the rest pass.
"""
from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    def __init__(self, rotary_dim: int, theta: float, device: torch.device | str):
        super().__init__()
        self.rotary_dim = rotary_dim
        # float32 exactly as transformers computes it; float64 for float64 models
        exponent = torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim
        self.register_buffer('inv_freq64', (1.0 / theta ** exponent).to(device), persistent=False)
        exponent = torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim
        self.register_buffer('inv_freq32', (1.0 / theta ** exponent).to(device), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] long -> (cos, sin), each [T, rotary_dim] in `dtype`.

        Angles are computed in float32 like transformers (float64 for a float64 model)."""
        inv_freq = self.inv_freq64 if dtype == torch.float64 else self.inv_freq32
        freqs = positions.to(inv_freq.dtype)[:, None] * inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim]; cos/sin [T, rotary_dim]; rotates x[..., :rotary_dim]."""
    rotary_dim = cos.shape[-1]
    cos, sin = cos[:, None, :], sin[:, None, :]
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    x_rot = x_rot * cos + _rotate_half(x_rot) * sin
    return torch.cat([x_rot, x_pass], dim=-1)
