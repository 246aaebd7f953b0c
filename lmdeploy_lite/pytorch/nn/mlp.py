"""SwiGLU MLP: `down(silu(gate(x)) * up(x))`; gate/up column-parallel, down row-parallel."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .linear import ColumnParallelLinear, RowParallelLinear


class SwiGLUMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype,
                 device: torch.device | str, dist_ctx=None, reduce_output: bool = True):
        """reduce_output=False: return this TP rank's partial sum (the caller all-reduces)."""
        super().__init__()
        self.gate_proj = ColumnParallelLinear(hidden_size, intermediate_size, dtype, device,
                                              dist_ctx=dist_ctx)
        self.up_proj = ColumnParallelLinear(hidden_size, intermediate_size, dtype, device,
                                            dist_ctx=dist_ctx)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, dtype, device,
                                           dist_ctx=dist_ctx, reduce_output=reduce_output)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
