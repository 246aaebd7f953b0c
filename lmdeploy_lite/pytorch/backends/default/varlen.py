"""Batching sequences of different lengths for the plain-PyTorch ops: the step's tokens are flat
(`[T, ...]`, sequence after sequence); ops pad them to `[n, L, ...]` (L = the longest new-token
run), run one batched computation, and take the real tokens back out. Padding costs memory, so
`seq_groups` splits a step into runs of consecutive sequences whose padded intermediates stay
under `MAX_PADDED_ELEMENTS`; a decode step, or a prefill of similar lengths, is one group.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ...model_inputs import ModelInputs

MAX_PADDED_ELEMENTS = 1 << 26      # per group, in the op's largest padded intermediate


@dataclass
class SeqGroup:
    """Sequences `seqs` of the step (n of them) and their tokens `tokens` of the flat batch (t).
    Token j of the group is new token `offsets[j]` of group sequence `seq_idx[j]`."""
    seqs: slice
    num_seqs: int
    tokens: slice
    max_q_len: int
    max_kv_len: int
    q_lens: torch.Tensor          # [n] long
    history_lens: torch.Tensor    # [n] long
    seq_idx: torch.Tensor         # [t] long, in 0..n-1
    offsets: torch.Tensor         # [t] long

    @property
    def is_dense(self) -> bool:
        """All sequences have max_q_len tokens (decode, verify): padding is a reshape."""
        return self.num_seqs * self.max_q_len == self.seq_idx.numel()

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """x [t, ...] (the group's tokens) -> [n, max_q_len, ...], zeros after each sequence
        (a view of x when dense: read it, do not write it)."""
        if self.is_dense:
            return x.reshape(self.num_seqs, self.max_q_len, *x.shape[1:])
        out = x.new_zeros(self.num_seqs, self.max_q_len, *x.shape[1:])
        out[self.seq_idx, self.offsets] = x
        return out

    def unpad(self, padded: torch.Tensor) -> torch.Tensor:
        """[n, max_q_len, ...] -> [t, ...], the inverse of `pad`."""
        return padded.flatten(0, 1) if self.is_dense else padded[self.seq_idx, self.offsets]

    def valid(self) -> torch.Tensor:
        """[n, max_q_len] bool, True at real (not padding) tokens."""
        return torch.arange(self.max_q_len, device=self.q_lens.device) < self.q_lens[:, None]


def seq_groups(inputs: ModelInputs, cost: Callable[[int, int, int], int]) -> list[SeqGroup]:
    """Split the step into groups of consecutive sequences. `cost(num_seqs, max_q_len, max_kv_len)`
    is the element count of the op's largest padded intermediate; a group grows while it stays
    within `MAX_PADDED_ELEMENTS` and, when new-token runs differ in length, within twice its
    sequences' unpadded costs (a mixed step's 1-token decode rows are not padded to a prefill
    chunk's length); a single sequence always forms a group."""
    q_lens, kv_lens = inputs.host_q_lens, inputs.host_kv_lens
    whole = cost(len(q_lens), inputs.max_q_len, inputs.max_kv_len)
    if whole <= MAX_PADDED_ELEMENTS and (
            min(q_lens, default=0) == inputs.max_q_len
            or whole <= 2 * sum(cost(1, q, kv) for q, kv in zip(q_lens, kv_lens))):
        bounds = [(0, len(q_lens), inputs.max_q_len, inputs.max_kv_len)]
    else:
        bounds, start, max_q, max_kv, unpadded = [], 0, 0, 0, 0
        for b, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens)):
            grown_q, grown_kv = max(max_q, q_len), max(max_kv, kv_len)
            own = cost(1, q_len, kv_len)
            padded = cost(b + 1 - start, grown_q, grown_kv)
            if b > start and (padded > MAX_PADDED_ELEMENTS or padded > 2 * (unpadded + own)):
                bounds.append((start, b, max_q, max_kv))
                start, grown_q, grown_kv, unpadded = b, q_len, kv_len, 0
            max_q, max_kv, unpadded = grown_q, grown_kv, unpadded + own
        bounds.append((start, len(q_lens), max_q, max_kv))
    groups, token_start = [], 0
    for start, stop, max_q, max_kv in bounds:
        tokens = slice(token_start, token_start + sum(q_lens[start:stop]))
        token_start = tokens.stop
        groups.append(SeqGroup(
            seqs=slice(start, stop), num_seqs=stop - start, tokens=tokens, max_q_len=max_q,
            max_kv_len=max_kv, q_lens=inputs.q_lens[start:stop],
            history_lens=inputs.history_lens[start:stop],
            seq_idx=inputs.token_seq_idx[tokens] - start, offsets=inputs.token_offsets[tokens]))
    return groups
