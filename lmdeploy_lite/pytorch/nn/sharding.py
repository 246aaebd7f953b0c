"""Which piece of a full checkpoint tensor a tensor-parallel rank holds: a sharded parameter
carries `param.shard` (a `Shard`); the loader checks the checkpoint tensor against
`shard.full_shape(...)` (the shape config.json implies) and copies `shard.narrow(full)`.
Parameters without `shard` are replicated. With tp == 1 nothing is sharded.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


def tp_layout(dist_ctx) -> tuple[int, int]:
    """(tp size, tp rank) of this process; (1, 0) without a DistContext."""
    return (1, 0) if dist_ctx is None else (dist_ctx.config.tp, dist_ctx.tp_rank)


@dataclass(frozen=True)
class Shard:
    """Rank `rank` of `parts` along `dim`, the concatenation of `sections` (`(Dk, Dk, Dv)` for
    in_proj_qkv's [q | k | v]): the rank keeps piece `rank` (ceil(size / parts) rows) of every
    section, in order, zero padded past the section's end (a vocab not divisible by tp)."""
    dim: int
    rank: int
    parts: int
    sections: tuple[int, ...]

    def piece(self, size: int) -> int:
        return -(-size // self.parts)

    def full_shape(self, local_shape: tuple) -> tuple:
        shape = list(local_shape)
        shape[self.dim] = sum(self.sections)
        return tuple(shape)

    def narrow(self, full: torch.Tensor) -> torch.Tensor:
        """The full tensor (shape `full_shape`) -> this rank's piece of every section."""
        pieces, offset = [], 0
        for size in self.sections:
            piece = self.piece(size)
            start = min(self.rank * piece, size)
            stop = min(start + piece, size)
            part = full.narrow(self.dim, offset + start, stop - start)
            if stop - start < piece:                         # zero rows past the section
                part = F.pad(part, (0, 0) * (full.dim() - 1 - self.dim) + (0, piece - stop + start))
            pieces.append(part)
            offset += size
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, self.dim)

    def per_expert(self, section: int) -> 'Shard':
        """A fused-expert shard ([E, ...], sharded dim >= 1) seen from one expert's tensor of one
        section (e.g. `experts.{e}.up_proj.weight` is section 1 of gate_up_proj)."""
        return Shard(self.dim - 1, self.rank, self.parts, (self.sections[section],))


def sharded_parameter(full_shape: tuple[int, ...], dim: int, dist_ctx, dtype: torch.dtype,
                      device: torch.device | str, sections: tuple[int, ...] | None = None,
                      init=torch.empty, replicas: int = 1) -> nn.Parameter:
    """This TP rank's piece of a `full_shape` tensor split along `dim` (`sections` default: the
    whole dim), filled by `init` until loaded; `replicas` consecutive ranks hold each piece
    (`head_replicas`). One piece: the full tensor, no `shard` attribute."""
    tp, rank = tp_layout(dist_ctx)
    if tp == replicas:
        return nn.Parameter(init(full_shape, dtype=dtype, device=device), requires_grad=False)
    shard = Shard(dim, rank // replicas, tp // replicas, tuple(sections or (full_shape[dim],)))
    if sum(shard.sections) != full_shape[dim]:
        raise ValueError(f'sections {shard.sections} do not add up to dim {dim} of {full_shape}')
    local = list(full_shape)
    local[dim] = sum(shard.piece(size) for size in shard.sections)
    param = nn.Parameter(init(tuple(local), dtype=dtype, device=device), requires_grad=False)
    param.shard = shard
    return param
