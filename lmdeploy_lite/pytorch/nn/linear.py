"""Linear layers (no bias: Qwen3.5 has none), shaped for tensor parallelism: with `dist_ctx=None`
or tp=1 they hold the full weight and skip the collective. Weights are `[out_features,
in_features]`, as in HF checkpoints; sharded ones carry `weight.shard` (nn/sharding.py).
"""
from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn

from .sequence_parallel import is_sequence_parallel
from .sharding import sharded_parameter, tp_layout


def check_divisible(what: str, sizes: tuple[int, ...], tp: int) -> None:
    for size in sizes:
        if size % tp:
            raise ValueError(f'{what}={size}: must be divisible by tp={tp}')


class ColumnParallelLinear(nn.Module):
    """Output features split over the TP group; no collective. `sections`: parts of the output
    split separately (`(Dk, Dk, Dv)` for `[q | k | v]`: each rank keeps its piece of each)."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype,
                 device: torch.device | str, dist_ctx=None,
                 sections: tuple[int, ...] | None = None):
        super().__init__()
        tp, _ = tp_layout(dist_ctx)
        sections = tuple(sections or (out_features,))
        check_divisible('out_features', sections, tp)
        self.in_features, self.out_features = in_features, out_features // tp
        self.weight = sharded_parameter((out_features, in_features), 0, dist_ctx, dtype, device,
                                        sections)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    def extra_repr(self) -> str:
        return f'in={self.in_features}, out={self.out_features} (local)'


class ReplicatedLinear(ColumnParallelLinear):
    """The full weight on every rank (built without a `dist_ctx`)."""


class RowParallelLinear(nn.Module):
    """Input features split over the TP group; partial outputs are all-reduced here, unless
    `reduce_output=False` (the caller adds more partial sums first and reduces once).
    Sequence-parallel: x [N, in / tp] -> this rank's rows [N / tp, out] by a reduce-scatter."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype,
                 device: torch.device | str, dist_ctx=None, reduce_output: bool = True):
        super().__init__()
        self.tp, self.tp_rank = tp_layout(dist_ctx)
        check_divisible('in_features', (in_features,), self.tp)
        self.dist_ctx, self.reduce_output = dist_ctx, reduce_output
        self.sequence_parallel = self.tp > 1 and is_sequence_parallel(dist_ctx)
        self.in_features, self.out_features = in_features // self.tp, out_features
        self.weight = sharded_parameter((out_features, in_features), 1, dist_ctx, dtype, device)

    def forward(self, x: torch.Tensor, sequence_parallel: bool = False) -> torch.Tensor:
        """`sequence_parallel`: this forward splits its rows (`splits_rows`); see the class."""
        out = F.linear(x, self.weight)
        if self.tp > 1 and self.reduce_output:
            if self.sequence_parallel and sequence_parallel:
                out = self.dist_ctx.tp.reduce_scatter(out)
            else:
                out = self.dist_ctx.tp.all_reduce(out)
        return out

    def extra_repr(self) -> str:
        return f'in={self.in_features} (local), out={self.out_features}'


class FusedColumnLinear(nn.Module):
    """Column-parallel projections of the same input as ONE GEMM (the parts' local weights
    concatenated by rows), built after loading, so checkpoint names and sharding are the parts'.
    `keep_parts=True`: the parts stay, their weights views of the fused one (a non-persistent
    buffer here). `outputs`: how many consecutive parts each returned piece covers (default 1)."""

    def __init__(self, parts: list[nn.Module], keep_parts: bool = False,
                 outputs: list[int] | None = None):
        super().__init__()
        part_sizes = [p.weight.shape[0] for p in parts]
        weight = torch.cat([p.weight.data for p in parts])
        if keep_parts:
            self.register_buffer('weight', weight, persistent=False)
            for part, rows in zip(parts, weight.split(part_sizes)):
                part.weight.data = rows
        else:
            self.weight = nn.Parameter(weight, requires_grad=False)
        bounds = [0] + list(itertools.accumulate(outputs or [1] * len(parts)))
        self.sizes = [sum(part_sizes[a:b]) for a, b in zip(bounds, bounds[1:])]

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return F.linear(x, self.weight).split_with_sizes(self.sizes, dim=-1)


def fuse_projections(model: nn.Module, keep_parts: bool = False) -> nn.Module:
    """Replace each module's same-input projections by one GEMM (`module.fuse_projections()`, what
    small-batch decode needs). Call after loading; idempotent. `keep_parts`: `FusedColumnLinear`."""
    for module in list(model.modules()):
        if hasattr(module, 'fuse_projections'):
            module.fuse_projections(keep_parts)
    return model
