"""SwiGLU MLP: `down(silu(gate(x)) * up(x))`; gate/up column-parallel, down row-parallel."""
from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from ..backends import get_backend
from ..model_inputs import ForwardSizes
from .linear import ColumnParallelLinear, FusedColumnLinear, RowParallelLinear


class SwiGLUMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype,
                 device: torch.device | str, dist_ctx=None, reduce_output: bool = True):
        """reduce_output=False: return this TP rank's partial sum (the caller all-reduces)."""
        super().__init__()
        column = partial(ColumnParallelLinear, hidden_size, intermediate_size, dtype, device,
                         dist_ctx=dist_ctx)
        self.gate_proj, self.up_proj = column(), column()
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, dtype, device,
                                           dist_ctx=dist_ctx, reduce_output=reduce_output)
        self.gate_up_proj = None     # gate/up_proj as one GEMM, after `fuse_projections`
        self.fused_by_parent = False  # a parent's GEMM computes gate/up (SparseMoeBlock)
        self.backend = get_backend(device)

    def fuse_projections(self, keep_parts: bool = False):
        if self.gate_up_proj is not None or self.fused_by_parent:
            return
        self.gate_up_proj = FusedColumnLinear([self.gate_proj, self.up_proj], keep_parts)
        if not keep_parts:
            del self.gate_proj, self.up_proj

    def forward_fused(self, gate_up: torch.Tensor, sequence_parallel: bool = False) -> torch.Tensor:
        """The MLP from its `[gate | up]` projection (computed by the caller's GEMM)."""
        return self.down_proj(self.backend.silu_mul(gate_up), sequence_parallel)

    def forward(self, x: torch.Tensor, sizes: ForwardSizes | None = None) -> torch.Tensor:
        """`sizes`: the step's (ModelInputs.sizes), says whether this forward splits its rows."""
        split = sizes is not None and sizes.sequence_parallel
        if self.gate_up_proj is not None:       # [gate | up] from one GEMM, one fused kernel
            return self.forward_fused(self.gate_up_proj.matmul(x), split)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x), split)
