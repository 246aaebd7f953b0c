"""Where a step's new tokens end a request: a stop token (the request's `stop_token_ids`, or an EOS
id unless `ignore_eos`) or a completed stop word (needs the tokenizer). Lengths (max_new_tokens,
the session) are the scheduler's. A verify step emits up to k + 1 tokens at once; a stop inside
them truncates there."""
from __future__ import annotations

from lmdeploy_lite.pytorch.engine.sequence import Sequence

_STOP_WORD_TAIL_TOKENS = 16


class StopChecker:

    def __init__(self, eos_token_ids: tuple[int, ...], tokenizer=None):
        self.eos_token_ids = frozenset(eos_token_ids)
        self.tokenizer = tokenizer

    def stop_ids(self, seq: Sequence) -> frozenset[int]:
        """The token ids that end `seq` (computed once per request)."""
        if seq.stop_ids is None:
            cfg = seq.gen_config
            seq.stop_ids = frozenset(cfg.stop_token_ids or ()) | (
                frozenset() if cfg.ignore_eos else self.eos_token_ids)
        return seq.stop_ids

    def scan(self, seq: Sequence, tokens: list[int]) -> tuple[int, str | None]:
        """(how many of `tokens`, about to follow seq.token_ids, the request emits; 'stop' if the
        last of those ends it, else None). Stop ids are found by one set test for the common
        case of none among the tokens; stop words, when the request has any, token by token."""
        n, reason = len(tokens), None
        stop_ids = self.stop_ids(seq)
        if stop_ids and not stop_ids.isdisjoint(tokens):
            n, reason = next(i for i, t in enumerate(tokens) if t in stop_ids) + 1, 'stop'
        if seq.gen_config.stop_words and self.tokenizer is not None:
            end = self._stop_word_end(seq, tokens[:n])
            if end is not None:
                n, reason = end, 'stop'
        return n, reason

    def _stop_word_end(self, seq: Sequence, tokens: list[int]) -> int | None:
        """1 + the index of the first token of `tokens` that completes a stop word (ends one in
        its text), or None; none before the output's min_tokens-th token (as vLLM, and lmdeploy,
        whose stop words are stop ids)."""
        words = seq.gen_config.stop_words
        width = _STOP_WORD_TAIL_TOKENS + max(map(len, words))
        generated = seq.generated_ids[-width:]
        first = max(0, seq.gen_config.min_tokens - seq.num_generated - 1)
        for i in range(first, len(tokens)):
            tail = (generated + tokens[:i + 1])[-width:]
            now = self.tokenizer.decode(tail)
            end = len(self.tokenizer.decode(tail[:-1]).rstrip('\ufffd'))   # a char it completes
            if any(now.find(w, max(0, end - len(w) + 1)) >= 0 for w in words):
                return i + 1
        return None
