"""One request's state as the scheduler sees it."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from lmdeploy_lite.messages import GenerationConfig, SpecDecodeStats, short_repr


class SeqStatus(enum.Enum):
    WAITING = 'waiting'
    RUNNING = 'running'
    FINISHED = 'finished'


@dataclass(eq=False)
class PrefixState:
    """engine/prefix_cache.py: its full blocks' keys, where its prefill keeps snapshots, the row
    to restore before its next chunk, the (position, row) its current step saves."""
    block_keys: list[int] = field(default_factory=list)
    snapshot_points: list[int] = field(default_factory=list)
    restore_row: int | None = None
    pending_save: tuple[int, int] | None = None


@dataclass(eq=False)
class ForkState:
    """engine/forking.py: a waiting member's `leader`, a leader's waiting `members`, and for a
    member forked this step the `copy` to make: (leader's slot, (partial block, copy) or None)."""
    leader: Sequence | None = None
    members: list[Sequence] = field(default_factory=list)
    copy: tuple[int, tuple[int, int] | None] | None = None


@dataclass(eq=False)
class Sequence:
    seq_id: int
    token_ids: list[int]                  # prompt + generated; the prompt is token_ids[:num_prompt]
    num_prompt: int
    gen_config: GenerationConfig
    arrival: int                          # admission order; later arrivals are preempted first
    status: SeqStatus = SeqStatus.WAITING
    num_computed: int = 0                 # tokens whose KV / linear state is in the cache
    prefilled: bool = False               # its (re)prefill has finished: it decodes from now on
    blocks: list[int] = field(default_factory=list)
    state_slot: int | None = None
    finish_reason: str | None = None
    error: str | None = None              # why, when finish_reason == 'error' (set at the end)
    generator: torch.Generator | None = None
    spec_stats: SpecDecodeStats = field(default_factory=SpecDecodeStats)
    drafts_ready: int = 0                 # drafts its last step made (the next verify's at most)
    stop_ids: frozenset[int] | None = None   # token ids that end it (StopChecker, computed once)
    num_cached_tokens: int = 0            # prompt tokens its first admission found cached
    num_preemptions: int = 0              # times the scheduler preempted it (recomputed)
    request_id: str | None = None         # the front-end's name for it (hidden-states files)
    grammar: object | None = None         # response_format's matcher (pytorch/grammar.py)
    prefix: PrefixState = field(default_factory=PrefixState)
    fork: ForkState = field(default_factory=ForkState)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt

    @property
    def generated_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt:]

    @property
    def is_decoding(self) -> bool:
        """A prefill whose last chunk is one token is still a prefill: it has no drafts yet."""
        return self.prefilled

    @property
    def is_finished(self) -> bool:
        return self.status == SeqStatus.FINISHED


def request_error(error: BaseException) -> str:
    """One line: a ValueError's message (it names the field), else type and first line."""
    lines = str(error).strip().splitlines()
    line = lines[0][:500] if lines else ''
    if isinstance(error, ValueError):
        return line
    return f'{type(error).__name__}: {line}' if line else type(error).__name__


def validate_request(token_ids: list[int], gen_config: GenerationConfig, vocab_size: int,
                     session_len: int):
    """Raise ValueError naming the problem; called in the caller's thread and again on admission
    (a frozen config can still be changed through object.__setattr__)."""
    if not isinstance(gen_config, GenerationConfig):
        raise ValueError(f'gen_config={type(gen_config).__name__}: must be a GenerationConfig')
    gen_config.validate()
    if not isinstance(token_ids, (list, tuple)):
        raise ValueError(f'prompt: {type(token_ids).__name__} given; token ids are a list of int')
    if len(token_ids) == 0:
        raise ValueError('prompt: empty; give at least one token')
    for name in ('logit_bias', 'bad_token_ids'):
        far = [t for t in getattr(gen_config, name) or () if t >= vocab_size]
        if far:
            raise ValueError(f'{name}: token ids {short_repr(far[:5])} are outside '
                             f'0..{vocab_size - 1}')
    plain = set(map(type, token_ids)) == {int} and 0 <= min(token_ids) and max(
        token_ids) < vocab_size                  # at C speed: an 8k prompt in ~0.2 ms, not 1
    bad = [] if plain else [t for t in token_ids if not isinstance(t, int) or isinstance(t, bool)
                            or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f'prompt: token ids {short_repr(bad[:5])} are outside '
                         f'0..{vocab_size - 1}')
    if len(token_ids) >= session_len:
        raise ValueError(f'prompt: {len(token_ids)} tokens, but session_len={session_len} leaves '
                         f'no room to generate; shorten the prompt to at most {session_len - 1} '
                         f'tokens or raise session_len')
