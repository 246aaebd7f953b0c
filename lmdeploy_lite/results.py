"""What a request gives back: `Response` (lmdeploy's fields and ours), its logprobs and its
speculative-decoding counters. `lmdeploy_lite.messages` re-exports them, as lmdeploy has them
there."""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import zip_longest
from typing import Literal

FinishReason = Literal['stop', 'length', 'abort', 'error']


@dataclass
class SpecDecodeStats:
    """Per-request (or engine-wide) speculative-decoding counters."""
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    # verify steps that drafted each position (with a dynamic k, fewer for later positions)
    drafted_per_position: list[int] = field(default_factory=list)

    @property
    def mean_accepted_length(self) -> float:
        """1 + accepted / drafts: tokens emitted per verify step (bonus included)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        """Accepted / drafted at each draft position."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position,
                                                     self.drafted_per_position)]

    def add(self, num_draft_tokens: int, num_accepted: int):
        """One verify step of `num_draft_tokens` drafts, the first `num_accepted` accepted."""
        accepted = [1] * num_accepted + [0] * (num_draft_tokens - num_accepted)
        self.merge(SpecDecodeStats(1, num_draft_tokens, num_accepted, accepted,
                                   [1] * num_draft_tokens))

    def merge(self, other: 'SpecDecodeStats'):
        """Add `other`'s counters (per-position lists: element-wise, the shorter padded with 0)."""
        for name in ('num_drafts', 'num_draft_tokens', 'num_accepted_tokens'):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for name in ('accepted_per_position', 'drafted_per_position'):
            setattr(self, name, [x + y for x, y in zip_longest(getattr(self, name),
                                                               getattr(other, name), fillvalue=0)])


class TokenLogprobs(dict):
    """One generated token's log-probabilities: a dict {token_id: logprob} of the top-N tokens
    and the chosen one (the shape lmdeploy and vLLM return). `token_id`, `logprob`: the chosen
    token and its logprob; `top_logprobs`: {token_id: logprob} of the top-N alone, most likely
    first."""
    __slots__ = ('token_id', 'logprob', 'top_logprobs')

    def __init__(self, token_id: int, logprob: float, top_logprobs: dict[int, float]):
        super().__init__(top_logprobs)
        self[token_id] = logprob
        self.token_id, self.logprob, self.top_logprobs = token_id, logprob, top_logprobs

    def __repr__(self) -> str:
        return f'TokenLogprobs({self.token_id}, {self.logprob!r}, {self.top_logprobs!r})'


@dataclass
class Response:
    text: str
    token_ids: list[int]               # generated ids only (for a stream: this chunk's ids)
    input_token_len: int
    generate_token_len: int
    finish_reason: FinishReason | None = None
    index: int = 0
    spec_stats: SpecDecodeStats | None = None
    error: str | None = None           # why the request failed, with finish_reason 'error'
    num_cached_tokens: int = 0         # prompt tokens served from the prefix cache
    num_preemptions: int = 0           # times the scheduler preempted it (then recomputed)
    hidden_states_path: str | None = None   # extract_hidden_states: the file (last response)
    logprobs: list[TokenLogprobs] | None = None     # logprobs=N: one per token of token_ids
    reasoning_content: str | None = None    # reasoning_parser: the <think> block; text: the rest

    @property
    def cached_tokens(self) -> int:
        """lmdeploy's name for num_cached_tokens."""
        return self.num_cached_tokens

    @property
    def error_message(self) -> str | None:
        """lmdeploy's name for error."""
        return self.error

    def extend(self, other: 'Response') -> 'Response':
        """lmdeploy's: add a later chunk of the same request (its text, ids and logprobs) to this
        one, whose other fields become the later chunk's; returns self."""
        self.text += other.text
        self.token_ids = self.token_ids + other.token_ids
        if other.logprobs:
            self.logprobs = (self.logprobs or []) + other.logprobs
        for name in ('input_token_len', 'generate_token_len', 'finish_reason', 'index',
                     'spec_stats', 'error', 'num_cached_tokens', 'num_preemptions',
                     'hidden_states_path'):
            setattr(self, name, getattr(other, name))
        if other.reasoning_content:
            self.reasoning_content = (self.reasoning_content or '') + other.reasoning_content
        return self
