"""Continuous batching: chunked prefill under a token budget, decode, preemption by recompute.

A step is either a prefill step (sequences with more than one uncomputed token; the last chunk
of a sequence samples) or a decode step (every running sequence feeds its last token, plus
`num_spec_tokens` drafts under speculation). Prefill goes first when there is any.

Blocks cover every position a step writes: the fed tokens plus `num_draft_extra` positions past
them that a draft model writes into its own KV cache while drafting (k - 1 for the MTP head).
A sequence near its end still feeds k + 1 tokens (padding, never emitted past a stop), so the
cache holds session_len + k + num_draft_extra positions per sequence.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable

from lmdeploy_lite.pytorch.engine.block_manager import BlockManager, blocks_needed
from lmdeploy_lite.pytorch.engine.sequence import SeqStatus, Sequence


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    q_lens: list[int]              # tokens fed per sequence this step
    is_decoding: bool

    @property
    def sample_mask(self) -> list[bool]:
        """True where this step samples: every decode/verify row, and the prefill rows whose
        chunk reaches the end of the sequence's tokens."""
        if self.is_decoding:
            return [True] * len(self.seqs)
        return [s.num_computed + n == len(s.token_ids) for s, n in zip(self.seqs, self.q_lens)]


class Scheduler:

    def __init__(self, block_manager: BlockManager, max_batch_size: int,
                 max_prefill_token_num: int, session_len: int, num_spec_tokens: int = 0,
                 num_draft_extra: int = 0, stop_checker: Callable[[Sequence], str | None] | None = None):
        self.bm = block_manager
        self.max_batch_size = max_batch_size
        self.max_prefill_token_num = max_prefill_token_num
        self.session_len = session_len
        self.num_spec_tokens = num_spec_tokens
        self.num_draft_extra = num_draft_extra
        self.stop_checker = stop_checker
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._arrivals = 0
        need = blocks_needed(self.max_positions(session_len), block_manager.block_size)
        if need > block_manager.num_usable_blocks:
            raise ValueError(
                f'the KV cache holds {block_manager.num_usable_blocks} blocks of '
                f'{block_manager.block_size} tokens, but one sequence of session_len={session_len} '
                f'needs {need}: lower session_len or raise cache_max_entry_count/num_gpu_blocks')

    def max_positions(self, session_len: int) -> int:
        """Cache positions one sequence may touch: the session plus speculative overhang."""
        return session_len + self.num_spec_tokens + self.num_draft_extra

    # ---- requests -------------------------------------------------------------------------
    def add(self, seq: Sequence):
        seq.arrival = self._arrivals
        self._arrivals += 1
        self.waiting.append(seq)

    def abort(self, seq: Sequence):
        if seq.is_finished:
            return
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._finish(seq, 'abort')

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- scheduling -----------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch | None:
        return self._schedule_prefill() or self._schedule_decode()

    def _schedule_prefill(self) -> ScheduledBatch | None:
        budget = self.max_prefill_token_num
        seqs, q_lens = [], []
        # chunked prefills under way go first; they make room by preempting later arrivals
        for seq in [s for s in self.running if not s.prefilled]:
            if budget == 0:
                break
            if seq.status != SeqStatus.RUNNING:
                continue                                   # preempted in this loop
            n = min(seq.num_uncomputed, budget)
            need = seq.num_computed + n + self.num_draft_extra
            if not self.bm.can_hold(seq, need) and not self._preempt_for(seq, need):
                continue
            self.bm.grow(seq, need)
            seqs.append(seq)
            q_lens.append(n)
            budget -= n
        # then new sequences, first come first served: stop at the first that does not fit
        while self.waiting and budget > 0 and len(self.running) < self.max_batch_size:
            seq = self.waiting[0]
            n = min(seq.num_uncomputed, budget)
            need = seq.num_computed + n + self.num_draft_extra
            # admit only with room for the whole prompt: a sequence admitted on a first chunk
            # that then cannot grow preempts itself and is re-admitted, forever (a livelock
            # when it is the newest and the cache is full)
            whole = min(len(seq.token_ids) + self.num_draft_extra,
                        self.max_positions(self.session_len))
            if not self.bm.can_hold(seq, max(need, whole)):
                break
            self.bm.grow(seq, need)
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            seqs.append(seq)
            q_lens.append(n)
            budget -= n
        scheduled = [(s, n) for s, n in zip(seqs, q_lens) if s.status == SeqStatus.RUNNING]
        if not scheduled:
            return None
        return ScheduledBatch([s for s, _ in scheduled], [n for _, n in scheduled],
                              is_decoding=False)

    def _schedule_decode(self) -> ScheduledBatch | None:
        seqs = []
        for seq in sorted(self.running, key=lambda s: s.arrival):
            if seq.status != SeqStatus.RUNNING or not seq.prefilled:
                continue                                       # preempted in this loop
            need = seq.num_computed + 1 + self.num_spec_tokens + self.num_draft_extra
            if not self.bm.can_hold(seq, need) and not self._preempt_for(seq, need):
                continue
            self.bm.grow(seq, need)
            seqs.append(seq)
        if not seqs:
            return None
        return ScheduledBatch(seqs, [1 + self.num_spec_tokens] * len(seqs), is_decoding=True)

    def reserve_ahead(self, seqs: list[Sequence], num_steps: int) -> bool:
        """Async scheduling: grow each sequence's blocks to cover `num_steps` more decode steps
        past what the host knows (the step in flight and the next one). False when a sequence
        would pass its session or the cache has no room without preempting: the caller then
        catches up and schedules normally."""
        per_step = 1 + self.num_spec_tokens
        limit = self.max_positions(self.session_len)
        for seq in seqs:
            need = seq.num_computed + num_steps * per_step + self.num_draft_extra
            if need > limit or not self.bm.can_hold(seq, need):
                return False
            self.bm.grow(seq, need)
        return True

    def _preempt_for(self, seq: Sequence, num_tokens: int) -> bool:
        """Free later arrivals (recompute later) until `seq` fits; False if `seq` was the victim."""
        while not self.bm.can_hold(seq, num_tokens):
            victim = max(self.running, key=lambda s: s.arrival)
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence):
        self.running.remove(seq)
        self.bm.free(seq)
        seq.num_computed = 0
        seq.prefilled = False
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)

    # ---- results --------------------------------------------------------------------------
    def update(self, seq: Sequence, num_new_computed: int, new_tokens: list[int]) -> list[int]:
        """Record a step's result for `seq`; returns the tokens actually emitted (a stop inside
        `new_tokens` truncates there). Frees the sequence's cache when it finishes."""
        seq.num_computed += num_new_computed
        seq.prefilled = seq.prefilled or bool(new_tokens)
        emitted = []
        for token in new_tokens:
            seq.token_ids.append(token)
            emitted.append(token)
            reason = self._check_stop(seq, token)
            if reason is not None:
                self.running.remove(seq)
                self._finish(seq, reason)
                break
        return emitted

    def _check_stop(self, seq: Sequence, token: int) -> str | None:
        cfg = seq.gen_config
        if cfg.stop_token_ids and token in cfg.stop_token_ids:
            return 'stop'
        if self.stop_checker is not None and self.stop_checker(seq) is not None:
            return 'stop'
        if seq.num_generated >= cfg.max_new_tokens or len(seq.token_ids) >= self.session_len:
            return 'length'
        return None

    def _finish(self, seq: Sequence, reason: str):
        self.bm.free(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
