"""Partial NeoX rotary embedding (Qwen3.5 text: mRoPE with equal positions == 1-D RoPE): only
the first `rotary_dim` channels of each head are rotated (rotate_half style); the rest pass.
The cos/sin rows are the backend's `rotary_cos_sin`, the rotation its `rms_norm_rope`
(backends/default)."""
from __future__ import annotations

import torch
from torch import nn

from ..backends import get_backend


class RotaryEmbedding(nn.Module):
    def __init__(self, rotary_dim: int, theta: float, device: torch.device | str):
        super().__init__()
        # float32 exactly as transformers computes it; float64 for float64 models
        for name, dtype in (('inv_freq64', torch.float64), ('inv_freq32', torch.float32)):
            exponent = torch.arange(0, rotary_dim, 2, dtype=dtype) / rotary_dim
            self.register_buffer(name, (1.0 / theta ** exponent).to(device), persistent=False)
        self.backend = get_backend(device)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] long -> (cos, sin), each [T, rotary_dim] in `dtype`, sin's first half
        negated (rotate_half's sign folded in: what the backend's `rms_norm_rope` multiplies the
        rolled x by)."""
        inv_freq = self.inv_freq64 if dtype == torch.float64 else self.inv_freq32
        return self.backend.rotary_cos_sin(positions, inv_freq, dtype)

