"""Stop conditions that need the tokenizer or the model's EOS ids (the rest live in the scheduler)."""
from __future__ import annotations

from lmdeploy_lite.pytorch.engine.sequence import Sequence

_STOP_WORD_TAIL_TOKENS = 16


class StopChecker:
    """Called after each appended token: 'stop' on EOS (unless ignore_eos) or a completed stop word."""

    def __init__(self, eos_token_ids: tuple[int, ...], tokenizer=None):
        self.eos_token_ids = set(eos_token_ids)
        self.tokenizer = tokenizer

    def __call__(self, seq: Sequence) -> str | None:
        cfg = seq.gen_config
        token = seq.token_ids[-1]
        if not cfg.ignore_eos and token in self.eos_token_ids:
            return 'stop'
        if cfg.stop_words and self.tokenizer is not None:
            tail = seq.generated_ids[-(_STOP_WORD_TAIL_TOKENS + max(map(len, cfg.stop_words))):]
            now = self.tokenizer.decode(tail)
            before = self.tokenizer.decode(tail[:-1])
            if any(w in now and w not in before for w in cfg.stop_words):
                return 'stop'
        return None


def truncate_at_stop_word(text: str, stop_words) -> str:
    """The output text ends before the first stop word (the stop word itself is not returned)."""
    cut = min((i for i in (text.find(w) for w in stop_words or ()) if i >= 0), default=-1)
    return text if cut < 0 else text[:cut]
