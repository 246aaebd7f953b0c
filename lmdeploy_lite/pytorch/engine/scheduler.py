"""Continuous batching: chunked prefill under a token budget, decode, preemption by recompute.

A step is a prefill step (a sequence's last chunk samples), a decode step (every running sequence
feeds its last token, plus `num_spec_tokens` drafts) or, without speculation, a mixed step:
decode rows plus prefill chunks in prefill mode (a 1-token prefill row writes its state where a
1-token decode does). Prefill gets `max_prefill_token_num` tokens a step; while sequences decode
and `max_mixed_token_num` > 0, a step carries at most the smaller of the two, decode rows
included, so a long prompt delays each stream a bounded time per token (0: prefill first, with
the whole budget); with `max_mixed_step_cost` the budget follows measured step times
(mixed_budget.py). A verify row keeps per-token states for rollback and cannot share a forward
with a chunk: under speculation decode and chunk steps alternate instead. Blocks cover every
position a step writes, the `num_draft_extra` a draft writes past the fed tokens included (k - 1
for the MTP head); a sequence near its end still feeds k + 1, so it holds session_len + k +
num_draft_extra positions. Under async scheduling a step may be scheduled before the results of
the one it follows (`continuation`), its decode rows fed from the device. Prefix caching and
forking: prefix_cache.py, forking.py."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from lmdeploy_lite.pytorch.engine import forking, prefix_cache
from lmdeploy_lite.pytorch.engine.block_manager import BlockManager, blocks_needed
from lmdeploy_lite.pytorch.engine.mixed_budget import MixedBudget
from lmdeploy_lite.pytorch.engine.sequence import SeqStatus, Sequence
from lmdeploy_lite.pytorch.engine.stopping import StopChecker


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    q_lens: list[int]              # tokens fed per sequence this step
    is_decoding: bool
    # speculation, set once the StepPlan agreed on the step's draft count (Engine.step):
    num_spec: int = 0                      # drafts each row verifies (decoding) and makes
    row_drafts: list[int] | None = None    # decoding: real drafts each row verifies (<= num_spec)
    # device copies: prefix cache (snapshot row, slot) restored before the forward, (slot, row)
    # saved after; forking (block, its copy) and (slot, its copy), after the restores
    restores: list[tuple[int, int]] = field(default_factory=list)
    saves: list[tuple[int, int]] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    state_copies: list[tuple[int, int]] = field(default_factory=list)
    # a step carrying prompt chunks while sequences decode: how many decoded, and the chunks'
    # tokens, when it was scheduled (the adaptive mixed budget's measurements)
    decoding: int = 0
    chunk_tokens: int = 0
    # async scheduling: rows whose bookkeeping was applied when the next step was scheduled
    # (Scheduler.continue_mixed: the chunks), so their results add only a sampled token
    applied_rows: list[bool] | None = None
    # async scheduling, a step scheduled before the results of the one it follows: its first
    # rows decode, fed the token the row prev_rows[i] of that step samples (read on the device),
    # and which rows sample (set where the host does not know yet that a prompt has ended)
    prev_rows: list[int] | None = None
    samples: list[bool] | None = None

    @property
    def num_decode_rows(self) -> int:
        """Rows of sequences past their prefill (all rows of a decode step; some of a mixed one)."""
        return sum(s.prefilled for s in self.seqs)

    @property
    def sample_mask(self) -> list[bool]:
        """True where this step samples: decode rows, and prefill rows whose chunk ends it."""
        if self.samples is not None:
            return self.samples
        if self.is_decoding:
            return [True] * len(self.seqs)
        return [s.num_computed + n == len(s.token_ids) for s, n in zip(self.seqs, self.q_lens)]


class Scheduler:

    def __init__(self, block_manager: BlockManager, max_batch_size: int,
                 max_prefill_token_num: int, session_len: int, num_spec_tokens: int = 0,
                 num_draft_extra: int = 0, stop_checker: StopChecker | None = None,
                 max_mixed_token_num: int = 0, max_mixed_step_cost: float = 0.0):
        self.bm, self.max_batch_size, self.session_len = block_manager, max_batch_size, session_len
        self.max_prefill_token_num = max_prefill_token_num
        self.max_mixed_token_num = max_mixed_token_num
        self.mixed_budget = (MixedBudget(max_mixed_step_cost, max_mixed_token_num)
                             if max_mixed_step_cost and max_mixed_token_num else None)
        self.mixed_chunk = 0     # adaptive: the plan's chunk tokens beside the decode rows (0: none)
        self._prefill_turn = False      # speculation: the next step with both kinds is a prefill
        self.num_spec_tokens, self.num_draft_extra = num_spec_tokens, num_draft_extra
        self.stop_checker = stop_checker or StopChecker(())
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0          # every preemption so far (each sequence counts its own)
        self._arrivals = 0
        need = blocks_needed(self.max_positions, block_manager.block_size)
        if need > block_manager.num_usable_blocks:
            raise ValueError(
                f'the KV cache holds {block_manager.num_usable_blocks} blocks of '
                f'{block_manager.block_size} tokens, but one sequence of session_len={session_len} '
                f'needs {need}: lower session_len or raise cache_max_entry_count/num_gpu_blocks')

    @property
    def max_positions(self) -> int:
        """Cache positions one sequence may touch: the session plus speculative overhang."""
        return self.session_len + self.num_spec_tokens + self.num_draft_extra

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

    def schedule(self) -> ScheduledBatch | None:
        return forking.add_fork_copies(prefix_cache.add_state_copies(self.bm, self._schedule()))

    @property
    def num_decoding(self) -> int:
        return sum(s.prefilled for s in self.running)

    def propose_mixed_budget(self) -> int:
        """This rank's chunk tokens (beside its decode rows) for the next step, 0 with the fixed
        budget. The StepPlan agrees on one for every rank (`mixed_chunk`); DP ranks under EP
        each add their own decode rows to it."""
        if self.mixed_budget is None:
            return 0
        decoding = self.num_decoding
        return max(self.mixed_budget.propose(decoding) - decoding, 1)

    def observe_step(self, batch: ScheduledBatch | None, seconds: float, chunk_seconds: float):
        """A step's wall time, and its time from scheduling to its sampled tokens (what a step
        carrying a chunk costs the decoding streams)."""
        if self.mixed_budget is None or batch is None:
            return
        if batch.is_decoding:
            self.mixed_budget.observe_decode(len(batch.seqs), seconds)
        else:
            self.mixed_budget.observe_chunk(batch.decoding, sum(batch.q_lens) if
                                            batch.chunk_tokens else 0, chunk_seconds)

    def _schedule(self) -> ScheduledBatch | None:
        num_decoding = self.num_decoding
        if not num_decoding or not self.max_mixed_token_num:
            return self._schedule_prefill(self.max_prefill_token_num) or self._schedule_decode()
        budget = self._mixed_budget(num_decoding)
        if self.num_spec_tokens:
            batch = self._schedule_alternating(budget)
            if batch is not None and not batch.is_decoding:
                batch.decoding, batch.chunk_tokens = num_decoding, sum(batch.q_lens)
            return batch
        # decode rows count against the budget; the chunk gets the rest (at least one token,
        # so that a prompt always progresses)
        budget = max(budget - num_decoding, 1)
        decode = self._schedule_decode()
        prefill = self._schedule_prefill(budget)
        if decode is None or prefill is None:
            return decode or prefill
        # a prefill row's growth may have preempted a decode row (a later arrival), which then
        # may even have been re-admitted as a prefill row
        rows = [(s, n) for s, n in zip(decode.seqs, decode.q_lens) if s.prefilled]
        chunks = list(zip(prefill.seqs, prefill.q_lens))
        return ScheduledBatch([s for s, _ in rows + chunks], [n for _, n in rows + chunks],
                              is_decoding=False, decoding=len(rows),
                              chunk_tokens=sum(n for _, n in chunks))

    def _mixed_budget(self, num_decoding: int) -> int:
        """A step's tokens while `num_decoding` sequences decode, their rows included: the
        configured budget, or the plan's chunk beside those rows (adaptive)."""
        budget = min(self.max_mixed_token_num, self.max_prefill_token_num)
        return min(budget, num_decoding + self.mixed_chunk) if self.mixed_chunk else budget

    def _schedule_alternating(self, budget: int) -> ScheduledBatch | None:
        """Speculation: a chunk step of `budget` tokens after each decode step, if there is one."""
        batch = self._schedule_prefill(budget) if self._prefill_turn else None
        self._prefill_turn = False
        if batch is None:
            batch = self._schedule_decode()
            self._prefill_turn = batch is not None
        return batch or self._schedule_prefill(budget)

    def _schedule_prefill(self, budget: int) -> ScheduledBatch | None:
        seqs, q_lens = [], []
        # chunked prefills under way go first; they make room by preempting later arrivals
        for seq in [s for s in self.running if not s.prefilled]:
            if budget == 0:
                break
            if seq.status != SeqStatus.RUNNING:
                continue                                   # preempted in this loop
            n = self._chunk(seq, budget)
            need = seq.num_computed + n + self.num_draft_extra
            if not self.bm.can_hold(seq, need) and not self._preempt_for(seq, need):
                continue
            self.bm.grow(seq, need)
            seqs.append(seq)
            q_lens.append(n)
            budget -= n
            forking.fork_members(self, seq, seqs, q_lens)
        # then new sequences, first come first served, to the first that does not fit (passing
        # over waiting members, and members forked above and since preempted: they have a row)
        for seq in [s for s in self.waiting if s.fork.leader is None and s not in seqs]:
            if budget <= 0 or len(self.running) >= self.max_batch_size:
                break
            n = self._admit(seq, budget)
            if n is None:
                break
            seqs.append(seq)
            q_lens.append(n)
            budget -= n
            forking.fork_members(self, seq, seqs, q_lens)
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
        return (ScheduledBatch(seqs, [1 + self.num_spec_tokens] * len(seqs), is_decoding=True)
                if seqs else None)

    def reserve_ahead(self, seqs: list[Sequence], num_steps: int) -> bool:
        """Async scheduling: grow each sequence's blocks for `num_steps` more decode steps past
        what the host knows; False (the caller catches up) when a sequence would pass its
        session or the cache has no room without preempting."""
        per_step = 1 + self.num_spec_tokens
        for seq in seqs:
            need = seq.num_computed + num_steps * per_step + self.num_draft_extra
            if need > self.max_positions or not self.bm.can_hold(seq, need):
                return False
            self.bm.grow(seq, need)
        return True

    def holds_mixed(self, batch: ScheduledBatch) -> bool:
        """Async scheduling may keep a mixed step in flight, its results applied a step late
        (`continuation`): plain decoding, decode rows (first) beside chunks, a chunk that ends
        its prompt only where its sequence can decode a step before the host sees its first
        token (`_holdable`)."""
        return (not batch.is_decoding and not self.num_spec_tokens and batch.decoding > 0
                and all(i < batch.decoding or not m or self._holdable(s)
                        for i, (s, m) in enumerate(zip(batch.seqs, batch.sample_mask))))

    @staticmethod
    def _holdable(seq: Sequence) -> bool:
        """Its next step needs nothing the host learns from this one: no penalties or grammar
        (the tokens emitted so far), no fork members waiting for its prefill."""
        return (not seq.gen_config.has_penalties and seq.grammar is None
                and not seq.fork.members and seq.fork.leader is None)

    def continuation(self, batch: ScheduledBatch) -> ScheduledBatch | None:
        """Async scheduling: the step after `batch`, scheduled before its results (None: the
        caller waits for them and schedules). A decode step runs again (blocks two steps
        ahead) or, where prompts wait, takes them in beside its rows (`_continue_into_mixed`);
        a held mixed step goes on (`continue_mixed`)."""
        if not batch.is_decoding:
            return self.continue_mixed(batch)
        if self.waiting and not self.num_spec_tokens:
            return self._continue_into_mixed(batch)
        if self.waiting or not self.reserve_ahead(batch.seqs, num_steps=2):
            return None
        return batch

    def _continue_into_mixed(self, batch: ScheduledBatch) -> ScheduledBatch | None:
        """A decode step's rows again (their tokens read on the device) and the waiting prompts'
        first chunks within the mixed budget, none preempting; None where none can come in."""
        decode = list(batch.seqs)
        if not self.reserve_ahead(decode, num_steps=2):
            return None
        nxt = self._mixed_after(decode, list(range(len(decode))), [], [],
                                max(self._mixed_budget(len(decode)) - len(decode), 1))
        return None if nxt.is_decoding else nxt

    def continue_mixed(self, batch: ScheduledBatch) -> ScheduledBatch | None:
        """Async scheduling: the step after the held mixed `batch`, before its results: its
        chunks' bookkeeping applied now, its decode rows again (blocks two steps ahead, their
        tokens read on the device) and first, as in `batch`, with the rows whose chunk ended
        their prompt (they decode the token it samples), then the next chunks and waiting
        prompts within the budget. A decode step where no chunk is left. None where a chunk
        would need a preemption or a decode row nears its session end: the caller then waits
        for the results and schedules."""
        samples = batch.sample_mask
        batch.samples, batch.applied_rows = samples, [i >= batch.decoding
                                                      for i in range(len(batch.seqs))]
        rows = [(i, s) for i, (s, m) in enumerate(zip(batch.seqs, samples))
                if i < batch.decoding or m]
        chunks = [(s, n) for i, (s, n, m) in enumerate(zip(batch.seqs, batch.q_lens, samples))
                  if i >= batch.decoding and not m]
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.q_lens)):
            if i >= batch.decoding:
                self.update(seq, n, [])
        decode = [s for _, s in rows]
        if not self.reserve_ahead(decode, num_steps=2):
            return None
        budget = max(self._mixed_budget(len(decode)) - len(decode), 1)
        seqs, q_lens = [], []
        for seq, _ in chunks:
            if budget <= 0:                    # as schedule(): the later chunks wait a step
                break
            n = self._chunk(seq, budget)
            need = seq.num_computed + n + self.num_draft_extra
            if not self.bm.can_hold(seq, need) or (
                    seq.num_computed + n == len(seq.token_ids) and not self._holdable(seq)):
                return None
            self.bm.grow(seq, need)
            seqs.append(seq)
            q_lens.append(n)
            budget -= n
        return self._mixed_after(decode, [i for i, _ in rows], seqs, q_lens, budget)

    def _mixed_after(self, decode: list[Sequence], prev_rows: list[int], seqs: list[Sequence],
                     q_lens: list[int], budget: int) -> ScheduledBatch | None:
        """`decode` rows fed by the step before's rows `prev_rows`, the chunks `seqs`, and the
        waiting prompts that fit in `budget`; a decode step where no chunk is left."""
        budget -= self._admit_holdable(budget, seqs, q_lens)
        if not seqs:
            return ScheduledBatch(decode, [1] * len(decode), is_decoding=True,
                                  prev_rows=prev_rows)
        samples = [True] * len(decode) + [s.num_computed + n == len(s.token_ids)
                                          for s, n in zip(seqs, q_lens)]
        return prefix_cache.add_state_copies(self.bm, ScheduledBatch(
            decode + seqs, [1] * len(decode) + q_lens, is_decoding=False, decoding=len(decode),
            chunk_tokens=sum(q_lens), prev_rows=prev_rows, samples=samples))

    def _admit_holdable(self, budget: int, seqs: list[Sequence], q_lens: list[int]) -> int:
        """Waiting prompts, first come first served, as `_schedule_prefill` admits them, up to
        the first that does not fit or is not `_holdable`: appended to `seqs` and `q_lens`;
        returns the tokens they take."""
        taken = 0
        for seq in list(self.waiting):
            if (budget - taken <= 0 or len(self.running) >= self.max_batch_size
                    or not self._holdable(seq)):
                break
            n = self._admit(seq, budget - taken)
            if n is None:
                break
            seqs.append(seq)
            q_lens.append(n)
            taken += n
        return taken

    def _admit(self, seq: Sequence, budget: int) -> int | None:
        """A waiting `seq` running, its cached prefix taken and blocks for its first chunk of at
        most `budget` tokens grown: that chunk's length; None (nothing changed) where the cache
        has no room for its whole prompt. Admitted only with that room: a sequence admitted on a
        first chunk that then cannot grow preempts itself and is re-admitted, forever (a
        livelock when it is the newest and the cache is full)."""
        hit = prefix_cache.take_cached_prefix(self.bm, seq)
        n = self._chunk(seq, budget)
        need = seq.num_computed + n + self.num_draft_extra
        whole = min(len(seq.token_ids) + self.num_draft_extra, self.max_positions)
        if not self.bm.can_hold(seq, max(need, whole)):
            prefix_cache.drop_cached_prefix(self.bm, seq)
            return None
        prefix_cache.count_lookup(self.bm, seq, hit)
        self.bm.grow(seq, need)
        self.waiting.remove(seq)
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        return n

    def _preempt_for(self, seq: Sequence, num_tokens: int) -> bool:
        """Free later arrivals (recompute later) until `seq` fits; False if `seq` was the victim."""
        while not self.bm.can_hold(seq, num_tokens):
            victim = max(self.running, key=lambda s: s.arrival)
            victim.num_preemptions += 1
            self.num_preemptions += 1
            self.running.remove(victim)
            self.bm.free(victim)
            victim.num_computed, victim.prefilled = 0, False
            victim.status = SeqStatus.WAITING
            self.waiting.appendleft(victim)
            if victim is seq:
                return False
        return True

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """`seq`'s next chunk: the budget's share, ending at its next snapshot or fork point."""
        points = seq.prefix.snapshot_points + forking.chunk_end(seq)
        ahead = [p - seq.num_computed for p in points if p > seq.num_computed]
        return min(len(seq.token_ids) - seq.num_computed, budget, *ahead)

    def update(self, seq: Sequence, num_new_computed: int, new_tokens: list[int]) -> list[int]:
        """Record a step's result; returns the tokens emitted (a stop truncates `new_tokens`)."""
        seq.num_computed += num_new_computed
        if seq.prefix.pending_save is not None:
            prefix_cache.keep_snapshot(self.bm, seq)
        if not new_tokens:
            return []
        seq.prefilled = True
        cfg = seq.gen_config
        room = min(cfg.max_new_tokens - seq.num_generated, self.session_len - len(seq.token_ids))
        n, reason = self.stop_checker.scan(seq, new_tokens[:room])
        if reason is None and len(new_tokens) >= room:
            n, reason = room, 'length'
        emitted = new_tokens[:n]
        seq.token_ids += emitted
        if reason is not None:
            self.running.remove(seq)
            self._finish(seq, reason)
        return emitted

    def _finish(self, seq: Sequence, reason: str):
        forking.release(seq)
        self.bm.free(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
