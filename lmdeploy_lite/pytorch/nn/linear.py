"""Linear layers, shaped for tensor parallelism.

`ColumnParallelLinear` splits the output features over the TP group (no communication);
`RowParallelLinear` splits the input features and all-reduces the partial sums in `forward`.
With `tp_group=None` (tp=1, the only mode so far) both hold the full weight and skip the collective.
Weights are `[out_features, in_features]`, as in HF checkpoints.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def _tp_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


class _Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype,
                 device: torch.device | str, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device),
                                   requires_grad=False)
        self.bias = (nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device),
                                  requires_grad=False) if bias else None)

    def extra_repr(self) -> str:
        return f'in={self.in_features}, out={self.out_features}, bias={self.bias is not None}'


class ReplicatedLinear(_Linear):
    """The full weight on every rank."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class ColumnParallelLinear(_Linear):
    """Output features split over the TP group (tp=1: the full weight); no collective."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype,
                 device: torch.device | str, bias: bool = False, tp_group=None):
        tp = _tp_size(tp_group)
        if out_features % tp:
            raise ValueError(f'out_features={out_features}: must be divisible by tp={tp}')
        super().__init__(in_features, out_features // tp, dtype, device, bias)
        self.tp_group = tp_group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(_Linear):
    """Input features split over the TP group; partial outputs are all-reduced here."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype,
                 device: torch.device | str, bias: bool = False, tp_group=None):
        tp = _tp_size(tp_group)
        if in_features % tp:
            raise ValueError(f'in_features={in_features}: must be divisible by tp={tp}')
        super().__init__(in_features // tp, out_features, dtype, device, bias)
        self.tp_group = tp_group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight)
        if _tp_size(self.tp_group) > 1:
            dist.all_reduce(out, group=self.tp_group)
        if self.bias is not None:
            out = out + self.bias
        return out
