"""Greedy decisions on logits: the first maximum of each row, and the accepted prefix of a greedy
verify. Reference semantics for `backends/cuda/greedy.py`."""
from __future__ import annotations

import torch


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [..., V] -> [...] long: each row's first maximal index (a NaN counts as the
    maximum), as `torch.argmax`."""
    return logits.argmax(-1)


def greedy_accept(target_argmax: torch.Tensor, draft_tokens: torch.Tensor,
                  num_drafts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """target_argmax [B, k+1] long; draft_tokens [B, k] long (-1 placeholders never match);
    num_drafts [B] long or None (all k real). Returns (output_tokens [B, k+1]: the target's
    tokens up to and including the first mismatch, then -1; num_accepted [B] long).
    `target_argmax` may be overwritten."""
    k = draft_tokens.shape[1]
    accept = draft_tokens == target_argmax[:, :k]
    if num_drafts is not None:
        accept &= torch.arange(k, device=accept.device) < num_drafts[:, None]
    num_accepted = accept.long().cumprod(-1).sum(-1)
    emitted = torch.arange(k + 1, device=accept.device) <= num_accepted[:, None]
    return target_argmax.masked_fill_(~emitted, -1), num_accepted
