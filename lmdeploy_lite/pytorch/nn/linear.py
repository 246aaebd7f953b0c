"""Linear layers (no bias: Qwen3.5 has none), shaped for tensor parallelism: with `dist_ctx=None`
or tp=1 they hold the full weight and skip the collective. Weights are `[out_features,
in_features]`, as in HF checkpoints; sharded ones carry `weight.shard` (nn/sharding.py).

FP8 (`Linear.to_fp8`, after loading, before fusing): the weight becomes float8_e4m3fn with one
float32 `weight_scale` per 128 x 128 block of this rank's shard, and `matmul` calls the backend's
block-scaled GEMM. A fused projection keeps FP8 and unquantized parts as separate GEMMs.
"""
from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn

from .sequence_parallel import is_sequence_parallel
from .sharding import sharded_parameter, tp_layout

BLOCK = 128                # the FP8 weight block (rows x columns), as Qwen's FP8 checkpoints


def check_divisible(what: str, sizes: tuple[int, ...], tp: int) -> None:
    for size in sizes:
        if size % tp:
            raise ValueError(f'{what}={size}: must be divisible by tp={tp}')


class Linear(nn.Module):
    """y = x @ weight.T, on the weight as loaded or, after `to_fp8`, on its FP8 blocks."""

    def __init__(self):
        super().__init__()
        self.weight_scale = None             # FP8: float32 [ceil(N / 128), ceil(K / 128)]

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_scale is None:
            return F.linear(x, self.weight)
        return self.fp8_matmul(x, self.weight, self.weight_scale)

    def to_fp8(self, quantize, fp8_matmul) -> None:
        """`quantize(weight) -> (fp8 weight, block scales)`; `fp8_matmul(x, weight, scale)`."""
        weight, scale = quantize(self.weight.data)
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight_scale = nn.Parameter(scale, requires_grad=False)
        self.fp8_matmul = fp8_matmul


class ColumnParallelLinear(Linear):
    """Output features split over the TP group; no collective. `sections`: parts of the output
    split separately (`(Dk, Dk, Dv)` for `[q | k | v]`: each rank keeps its piece of each).
    `replicas`: consecutive ranks that hold the same piece (KV heads fewer than tp)."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype,
                 device: torch.device | str, dist_ctx=None,
                 sections: tuple[int, ...] | None = None, replicas: int = 1):
        super().__init__()
        tp, _ = tp_layout(dist_ctx)
        sections, parts = tuple(sections or (out_features,)), tp // replicas
        check_divisible('out_features', sections, parts)
        self.in_features, self.out_features = in_features, out_features // parts
        self.weight = sharded_parameter((out_features, in_features), 0, dist_ctx, dtype, device,
                                        sections, replicas=replicas)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x)

    def extra_repr(self) -> str:
        return f'in={self.in_features}, out={self.out_features} (local)'


class ReplicatedLinear(ColumnParallelLinear):
    """The full weight on every rank (built without a `dist_ctx`)."""


class RowParallelLinear(Linear):
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
        out = self.matmul(x)
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
    buffer here). `outputs`: how many consecutive parts each returned piece covers (default 1).
    FP8 parts (`Linear.to_fp8`): one GEMM per run of parts of one kind (`segments`), a run of
    FP8 parts broken after a part whose rows are not whole 128-row blocks."""

    def __init__(self, parts: list[nn.Module], keep_parts: bool = False,
                 outputs: list[int] | None = None):
        super().__init__()
        part_sizes = [p.weight.shape[0] for p in parts]
        bounds = [0] + list(itertools.accumulate(outputs or [1] * len(parts)))
        self.sizes = [sum(part_sizes[a:b]) for a, b in zip(bounds, bounds[1:])]
        self.segments = None
        if any(getattr(p, 'weight_scale', None) is not None for p in parts):
            self._fuse_segments(parts, set(bounds), keep_parts)
            return
        weights = [p.weight.data for p in parts]
        weight = (torch.cat([w.t() for w in weights], 1).t()      # column-major parts stay so
                  if all(is_column_major(w) for w in weights) else torch.cat(weights))
        if keep_parts:
            self.register_buffer('weight', weight, persistent=False)
            for part, rows in zip(parts, weight.split(part_sizes)):
                part.weight.data = rows
        else:
            self.weight = nn.Parameter(weight, requires_grad=False)

    def _fuse_segments(self, parts: list[nn.Module], bounds: set[int], keep_parts: bool) -> None:
        """`keep_parts`: the parts keep their weights too, and the segments are not registered
        (the state_dict stays the checkpoint's)."""
        runs = [[parts[0]]]
        for part in parts[1:]:
            last = runs[-1][-1]
            fp8 = getattr(last, 'weight_scale', None) is not None
            if fp8 == (getattr(part, 'weight_scale', None) is not None) and not (
                    fp8 and last.weight.shape[0] % BLOCK):
                runs[-1].append(part)
            else:
                runs.append([part])
        segments = []
        for run in runs:
            segment = Linear()
            segment.weight = nn.Parameter(torch.cat([p.weight.data for p in run]),
                                          requires_grad=False)
            if getattr(run[0], 'weight_scale', None) is not None:
                segment.weight_scale = nn.Parameter(torch.cat([p.weight_scale.data for p in run]),
                                                    requires_grad=False)
                segment.fp8_matmul = run[0].fp8_matmul
            segments.append(segment)
        self.segments = segments if keep_parts else nn.ModuleList(segments)
        # each segment's output split by itself where no returned piece spans two segments
        ends = list(itertools.accumulate(len(run) for run in runs))
        sizes = [p.weight.shape[0] for p in parts]
        self.segment_sizes = None
        if set(ends) <= bounds:
            edges = [sorted(b for b in bounds if start <= b <= end)
                     for start, end in zip([0] + ends, ends)]
            self.segment_sizes = [[sum(sizes[a:b]) for a, b in zip(e, e[1:])] for e in edges]

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, K] -> every part's output side by side [T, sum(sizes)]."""
        if self.segments is None:
            return F.linear(x, self.weight)
        outs = [segment.matmul(x) for segment in self.segments]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.segments is None or self.segment_sizes is None:
            return self.matmul(x).split_with_sizes(self.sizes, dim=-1)
        return tuple(piece for segment, sizes in zip(self.segments, self.segment_sizes)
                     for piece in segment.matmul(x).split_with_sizes(sizes, dim=-1))


def is_column_major(weight: torch.Tensor) -> bool:
    return weight.dim() >= 2 and weight.stride(-2) == 1 and weight.stride(-1) == weight.shape[-2]


def column_major(weight: torch.Tensor) -> torch.Tensor:
    """The same [..., N, K] values stored column-major (strides [..., 1, N])."""
    return weight.transpose(-1, -2).contiguous().transpose(-1, -2)


def column_major_weights(model: nn.Module, keep: tuple[torch.Tensor, ...] = ()) -> None:
    """On CPU, every float32/float64 projection matrix (`weight` [N, K]) and MoE expert stack
    (`gate_up_proj`, `down_proj` [E, N, K]) stored column-major, in place: `x @ W.T` then reads
    W.T contiguous, which MKL's decode-size GEMMs (1-4 rows) run 1.2-2.6x faster on the
    project's CPU machines (BENCHMARKS.md); values, shapes and names are unchanged. `keep`:
    tensors left as they are (the embedding, whose rows are gathered, and a head tied to it).
    Call after loading and before `fuse_projections` (a fused GEMM keeps its parts' layout)."""
    kept = {id(t) for t in keep}
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if (param.device.type == 'cpu' and param.dtype in (torch.float32, torch.float64)
                    and id(param) not in kept and (name, param.dim()) in (
                        ('weight', 2), ('gate_up_proj', 3), ('down_proj', 3))):
                param.data = column_major(param.data)


def fuse_projections(model: nn.Module, keep_parts: bool = False) -> nn.Module:
    """Replace each module's same-input projections by one GEMM (`module.fuse_projections()`, what
    small-batch decode needs). Call after loading; idempotent. `keep_parts`: `FusedColumnLinear`."""
    for module in list(model.modules()):
        if hasattr(module, 'fuse_projections'):
            module.fuse_projections(keep_parts)
    return model
