"""Prompt-lookup (n-gram) proposer: drafts by copying what followed an earlier match. No weights."""
from __future__ import annotations

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    """Copies what followed the most recent earlier occurrence of the longest suffix n-gram
    (max_n down to min_n), reading its own output past the end (like LZ77: [1, 2, 1, 2] ->
    1, 2, 1, ...). No match: the last token repeated (0 for an empty sequence)."""

    def __init__(self, num_speculative_tokens: int, min_n: int = 1, max_n: int = 4):
        if num_speculative_tokens < 1:
            raise ValueError(f'num_speculative_tokens={num_speculative_tokens}: must be >= 1')
        if not 1 <= min_n <= max_n:
            raise ValueError(f'min_n={min_n}, max_n={max_n}: need 1 <= min_n <= max_n')
        self.num_speculative_tokens = num_speculative_tokens
        self.min_n, self.max_n = min_n, max_n

    def _match_end(self, tokens: np.ndarray) -> int | None:
        """Index just after the most recent earlier occurrence of the longest matching suffix."""
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            windows = sliding_window_view(tokens[:-1], n)          # starts 0 .. len-1-n
            hits = np.flatnonzero((windows == tokens[-n:]).all(-1))
            if hits.size:
                return int(hits[-1]) + n
        return None

    def propose(self, token_ids: list[int]) -> list[int]:
        """token_ids: the sequence so far (prompt + generated) -> k draft tokens."""
        k = self.num_speculative_tokens
        if not token_ids:
            return [0] * k
        start = self._match_end(np.asarray(token_ids, dtype=np.int64))
        if start is None:
            return [token_ids[-1]] * k
        period = len(token_ids) - start          # copying on past the end repeats the match
        return [token_ids[start + i % period] for i in range(k)]

    def propose_batch(self, batch_token_ids: list[list[int]]) -> torch.Tensor:
        """B sequences -> draft tokens LongTensor [B, k]."""
        proposals = [self.propose(ids) for ids in batch_token_ids]
        return torch.tensor(proposals, dtype=torch.long).view(-1, self.num_speculative_tokens)
