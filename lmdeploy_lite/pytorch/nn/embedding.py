"""Vocab-parallel token embedding and LM head (they may share one weight: tied embeddings). Each
TP rank holds rows `[rank * Vp, (rank + 1) * Vp)` of the `[V, H]` table, Vp = ceil(V / tp) (the
last rank's missing rows are zeros). The embedding looks up the ids it owns, zeroes the others
and all-reduces (sequence-parallel: reduce-scatters); the LM head scores its rows and
all-gathers, so every rank gets the full `[N, V]` logits.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .sharding import sharded_parameter, tp_layout


class _VocabParallel(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device | str, dist_ctx=None):
        super().__init__()
        self.vocab_size, self.dist_ctx = vocab_size, dist_ctx
        self.tp, rank = tp_layout(dist_ctx)
        self.weight = sharded_parameter((vocab_size, hidden_size), 0, dist_ctx, dtype, device)
        self.vocab_start = rank * self.weight.shape[0]

    def extra_repr(self) -> str:
        return f'vocab={self.vocab_size}, local rows={self.weight.shape[0]}, tp={self.tp}'


class VocabParallelEmbedding(_VocabParallel):
    def forward(self, input_ids: torch.Tensor, scatter_rows: int | None = None) -> torch.Tensor:
        """input_ids [T] long -> [T, H]; `scatter_rows` (sequence-parallel, tp > 1: the plan's
        Tp) -> this rank's share [Tp / tp, H] (zero rows past T), reduce-scattered."""
        if self.tp == 1:
            return F.embedding(input_ids, self.weight)
        local_ids = input_ids - self.vocab_start
        owned = (local_ids >= 0) & (local_ids < self.weight.shape[0])
        out = F.embedding(local_ids.masked_fill(~owned, 0), self.weight)
        out = out.masked_fill(~owned[:, None], 0)
        if scatter_rows is not None:
            out = F.pad(out, (0, 0, 0, scatter_rows - out.shape[0]))
            return self.dist_ctx.tp.reduce_scatter(out)
        return self.dist_ctx.tp.all_reduce(out)        # exactly one rank contributes each row


class ParallelLMHead(_VocabParallel):
    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> full-vocab logits [N, V] in the weight's dtype, on every TP rank."""
        logits = F.linear(hidden, self.weight)
        if self.tp == 1:
            return logits
        parts = self.dist_ctx.tp.all_gather(logits.contiguous())      # [tp, N, Vp]
        return parts.permute(1, 0, 2).reshape(hidden.shape[0], -1)[:, :self.vocab_size]
