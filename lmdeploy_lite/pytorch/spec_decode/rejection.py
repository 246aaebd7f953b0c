"""Verify k draft tokens against the target: greedy matching or exact rejection sampling (Leviathan
et al. 2023: every emitted token is distributed exactly as if sampled from the target alone).
Penalties and grammar masks apply to the target's logits first, position j counting drafts 1..j
as emitted: each token is verified against the distribution plain decoding samples it from (q is
whatever the draft used)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from lmdeploy_lite.pytorch.backends import get_backend
from lmdeploy_lite.pytorch.sampling import (SamplingInputs, apply_penalties, draw_from_probs,
                                            probs_from_logits, random_like_rows)


def rejection_sample(target_logits: Tensor, draft_tokens: Tensor, draft_probs: Tensor | None,
                     sampling: SamplingInputs, num_drafts: Tensor | None = None,
                     token_map: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Accept a prefix of each row's drafts and emit one more token after it.

    target_logits [B, k+1, V]: position i scores the token after draft i-1 (position 0 follows the
        last verified token); draft_tokens [B, k] long (entries past num_drafts may be any value,
        e.g. -1); draft_probs [B, k, V] float: the draft distribution q the drafts were sampled
        from, already shaped by the caller, or None for deterministic drafts (q one-hot at the
        draft); num_drafts [B] long in 0..k: real drafts per row (default k), later positions are
        never accepted; token_map [M] long (a reduced draft vocabulary, spec_decode/token_map.py):
        draft_probs is then [B, k, M], q at token_map[j], and q is zero at every other id.
    Returns output_tokens [B, k+1] long (accepted drafts, one correction / bonus token, -1 padding)
    and num_accepted_drafts [B] long in 0..num_drafts; row b emits num_accepted_drafts[b] + 1.
    Randomness: each sampled row draws k uniforms and V exponentials from its own generator.
    """
    if sampling.penalties is not None:     # position i counts drafts 0..i-1 as emitted
        target_logits = apply_penalties(target_logits, sampling.penalties, draft_tokens)
    if sampling.masks is not None:         # position i: the grammar after drafts 0..i-1
        target_logits = sampling.masks.apply(target_logits, draft_tokens)
    if sampling.all_greedy:
        return greedy_verify(target_logits, draft_tokens, num_drafts)
    batch_size, k = draft_tokens.shape
    device = draft_tokens.device
    positions = torch.arange(k, device=device)
    rows = torch.arange(batch_size, device=device)
    if num_drafts is None:
        num_drafts = torch.full((batch_size,), k, dtype=torch.long, device=device)
    safe_drafts = draft_tokens.clamp(min=0)                        # placeholders never index
    target_argmax = target_logits.argmax(-1)                       # [B, k+1]
    target_probs = probs_from_logits(target_logits, sampling)      # p: [B, k+1, V]
    accept = _accepted(target_argmax, target_probs, safe_drafts, draft_probs, sampling, token_map)
    accept &= positions < num_drafts[:, None]
    num_accepted = accept.long().cumprod(-1).sum(-1)               # length of the accepted prefix

    next_token = target_argmax[rows, num_accepted]                  # greedy: correction or bonus
    dist = target_probs[rows, num_accepted]                         # all accepted: bonus from p
    if k > 0:
        dist = _after_rejection(dist, num_accepted, num_drafts, safe_drafts, draft_probs, token_map)
    sampled_next = draw_from_probs(dist, sampling.generators)
    next_token = torch.where(sampling.do_sample, sampled_next, next_token)

    output_tokens = torch.full((batch_size, k + 1), -1, dtype=torch.long, device=device)
    output_tokens[:, :k] = torch.where(positions < num_accepted[:, None], draft_tokens, -1)
    output_tokens[rows, num_accepted] = next_token
    return output_tokens, num_accepted


def _accepted(target_argmax: Tensor, target_probs: Tensor, safe_drafts: Tensor,
              draft_probs: Tensor | None, sampling: SamplingInputs,
              token_map: Tensor | None) -> Tensor:
    """[B, k] bool: whether each draft passes on its own (the caller keeps the prefix)."""
    batch_size, k = safe_drafts.shape
    # Greedy rows: accept draft i while it equals the target's argmax at position i.
    accept = safe_drafts == target_argmax[:, :k]
    p_draft = target_probs[:, :k].gather(-1, safe_drafts[..., None])[..., 0]
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
    elif token_map is not None:     # q at each draft's entry in the map (0 if it has none)
        q_draft = (draft_probs.to(p_draft.dtype) * (token_map == safe_drafts[..., None])).sum(-1)
    else:
        q_draft = draft_probs.to(p_draft.dtype).gather(-1, safe_drafts[..., None])[..., 0]
    uniform = random_like_rows((batch_size, k), sampling.generators, 'uniform', p_draft.dtype,
                               safe_drafts.device)
    # Sampled rows: accept draft i with probability min(1, p_i(d_i) / q_i(d_i)), i.e. u * q < p
    # for u ~ U[0, 1); p(d) = 0 (e.g. outside top-k/top-p) never accepts.
    return torch.where(sampling.do_sample[:, None], uniform * q_draft < p_draft, accept)


def _after_rejection(p_next: Tensor, num_accepted: Tensor, num_drafts: Tensor, safe_drafts: Tensor,
                     draft_probs: Tensor | None, token_map: Tensor | None) -> Tensor:
    """[B, V]: what a sampled row draws its next token from. After a rejection,
    norm(max(p - q, 0)) (falling back to p if that is all zero, i.e. p == q); after all
    accepts, the bonus comes from p at the next position (`p_next` as given)."""
    batch_size, k = safe_drafts.shape
    rows = torch.arange(batch_size, device=safe_drafts.device)
    rejected = num_accepted < num_drafts
    at = num_accepted.clamp(max=k - 1)
    if draft_probs is None:
        q_next = F.one_hot(safe_drafts[rows, at], p_next.size(-1)).to(p_next.dtype)
    else:
        q_next = draft_probs[rows, at].to(p_next.dtype)
        if token_map is not None:                         # [B, M] -> [B, V], 0 off the map
            q_next = torch.zeros_like(p_next).scatter_(-1, token_map.expand(batch_size, -1), q_next)
    residual = (p_next - q_next).clamp(min=0)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_next)
    return torch.where(rejected[:, None], residual, p_next)


def greedy_verify(target_logits: Tensor, draft_tokens: Tensor, num_drafts: Tensor | None = None
                  ) -> tuple[Tensor, Tensor]:
    """`rejection_sample` when no row samples: the emitted tokens are the target's argmax up to
    and including the first mismatch with the drafts, then -1."""
    backend = get_backend(target_logits.device)          # on a GPU: two launches, then one
    return backend.greedy_accept(backend.argmax(target_logits), draft_tokens, num_drafts)


def acceptance_by_position(num_accepted_drafts: Tensor, num_drafts: Tensor, k: int
                           ) -> tuple[Tensor, Tensor]:
    """(accepted [k], drafted [k]) long from num_accepted_drafts, num_drafts [B]: position i is
    drafted where num_drafts > i, accepted where num_accepted_drafts > i."""
    positions = torch.arange(k, device=num_drafts.device)
    accepted = (num_accepted_drafts[:, None] > positions).sum(0)
    drafted = (num_drafts[:, None] > positions).sum(0)
    return accepted, drafted
