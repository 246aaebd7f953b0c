"""SwiGLU MLP: `down(silu(gate(x)) * up(x))`."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .linear import ColumnParallelLinear, RowParallelLinear


class SwiGLUMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype,
                 device: torch.device | str, tp_group=None):
        super().__init__()
        self.gate_proj = ColumnParallelLinear(hidden_size, intermediate_size, dtype, device,
                                              tp_group=tp_group)
        self.up_proj = ColumnParallelLinear(hidden_size, intermediate_size, dtype, device,
                                            tp_group=tp_group)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, dtype, device,
                                           tp_group=tp_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
