"""The engine of one DP rank: schedule -> plan -> inputs -> forward -> post -> update (DESIGN.md
"One step"); `build_engine` (engine/build.py) makes one."""
from __future__ import annotations

import logging
import time
import uuid

import torch

from lmdeploy_lite.messages import GenerationConfig, PytorchEngineConfig, SpecDecodeStats
from lmdeploy_lite.pytorch.config import CacheConfig, ModelConfig
from lmdeploy_lite.pytorch.distributed import DistContext
from lmdeploy_lite.pytorch.engine import forking
from lmdeploy_lite.pytorch.engine.hidden_states import check_request_id
from lmdeploy_lite.pytorch.engine.scheduler import ScheduledBatch, Scheduler
from lmdeploy_lite.pytorch.engine.sequence import Sequence, request_error, validate_request
from lmdeploy_lite.pytorch.engine.step_output import (InFlight, StepOutput, host_logprobs,
                                                     row_logprobs)
from lmdeploy_lite.pytorch.engine.step_plan import StepPlan
from lmdeploy_lite.pytorch.grammar import Grammars, advance
from lmdeploy_lite.pytorch.model_agent import StepResult
from lmdeploy_lite.pytorch.model_inputs import ModelInputs
from lmdeploy_lite.pytorch.sampling import SamplingInputs, SamplingTables

logger = logging.getLogger('lmdeploy_lite')

WRITE_POLL_S = 0.01      # an idle engine waits this long for a hidden-states file per step


class Engine:
    """`spec`: speculation's runtime (spec_decode/runtime.py); `output_stage`: where finished
    outputs wait (hidden-state files); `ep`: how MoE tokens move (nn/token_dispatcher.py)."""

    def __init__(self, dist: DistContext, model_config: ModelConfig,
                 engine_config: PytorchEngineConfig, device: torch.device, dtype: torch.dtype,
                 session_len: int, cache_config: CacheConfig, spec, scheduler: Scheduler,
                 output_stage, async_scheduling: bool, ep):
        self.dist, self.model_config, self.engine_config = dist, model_config, engine_config
        self.device, self.dtype, self.session_len = device, dtype, session_len
        self.cache_config = cache_config
        self.spec, self.scheduler, self.output_stage, self.ep = spec, scheduler, output_stage, ep
        self.agent, self.strategy = spec.agent, spec.strategy
        self.spec_plan, self.num_spec_tokens = spec.plan, spec.plan.num_spec_tokens
        # extract_hidden_states feeds every choice its prompt (a fork's file would lack its rows)
        self.share_prefill = not spec.plan.aux_hidden_state_layer_ids
        self.async_scheduling = async_scheduling
        self.sampling = SamplingTables(device, scheduler.stop_checker.stop_ids)
        self.grammars = Grammars(scheduler.stop_checker.tokenizer, model_config.vocab_size,
                                 model_config.eos_token_ids)
        self._next_seq_id = 0
        self.num_steps = 0
        self.num_prefill_tokens = 0        # tokens fed in prefill rows (prompts, recomputes)
        self.stop_requested = False        # set by a driver; travels to every rank in the plan
        self.stopped = False
        self.plan_busy = False             # some rank of the plan group worked last step
        self.in_flight: InFlight | None = None           # async scheduling: a launched step
        self.next_batch: ScheduledBatch | None = None    # scheduled, runs in the next step
        self.num_continued_steps = 0       # decode steps launched before the host caught up
        # the driver's inbox events received so far, and the fewest any TP peer had at the last
        # plan: what every peer may admit (engine/step_plan.py; executor/rank_worker.py)
        self.num_events_seen = self.num_events_agreed = 0

    @property
    def draft_policy(self):
        return self.spec.policy

    def add_request(self, token_ids: list[int], gen_config: GenerationConfig,
                    request_id: str | None = None) -> Sequence:
        """One sequence (gen_config.n == 1); `request_id` names its hidden-states file."""
        if isinstance(gen_config, GenerationConfig) and gen_config.n != 1:
            raise ValueError(f'n={gen_config.n}: add_request adds one sequence; add_group adds '
                             f'the n choices of a prompt')
        return self.add_group(token_ids, gen_config, [request_id])[0]

    def add_group(self, token_ids: list[int], gen_config: GenerationConfig,
                  request_ids: list[str | None] | None = None) -> list[Sequence]:
        """The gen_config.n choices of one prompt, sharing its prefill (engine/forking.py); choice
        i seeded with (random_seed + i) mod 2**64, else from the engine's seed and its sequence
        id. An invalid request raises ValueError and leaves the engine unchanged."""
        validate_request(token_ids, gen_config, self.model_config.vocab_size, self.session_len)
        request_ids = [None] * gen_config.n if request_ids is None else request_ids
        if len(request_ids) != gen_config.n:
            raise ValueError(f'n={gen_config.n}: {len(request_ids)} request ids given, one per '
                             f'choice needed')
        request_ids = [uuid.uuid4().hex if r is None else check_request_id(r) for r in request_ids]
        grammar = (None if gen_config.response_format is None
                   else self.grammars.compile(gen_config.response_format, token_ids))
        seqs = []
        for i in range(gen_config.n):
            if gen_config.random_seed is not None:
                seed = gen_config.random_seed + i
            else:                       # derived per sequence
                seed = self.engine_config.seed * 1_000_003 + self._next_seq_id
            generator = torch.Generator(self.device).manual_seed(seed % 2**64)   # 0..2**64-1
            seqs.append(Sequence(seq_id=self._next_seq_id, token_ids=list(token_ids),
                                 num_prompt=len(token_ids), gen_config=gen_config, arrival=0,
                                 generator=generator, request_id=request_ids[i]))
            self._next_seq_id += 1
        if grammar is not None:
            stop_ids = self.scheduler.stop_checker.stop_ids
            for seq in seqs:
                seq.grammar = self.grammars.matcher(grammar, stop_ids(seq))
        if self.share_prefill:
            forking.link_group(seqs)
        for seq in seqs:
            self.scheduler.add(seq)
        return seqs

    def abort(self, seq: Sequence):
        self.scheduler.abort(seq)
        self.output_stage.drop(seq)

    @property
    def has_work(self) -> bool:
        return (self.scheduler.has_work or self.in_flight is not None
                or self.next_batch is not None or self.output_stage.pending > 0)

    def step(self) -> list[StepOutput]:
        """One forward on every rank of the plan group. With async scheduling a decode step is
        launched before the host applies the previous step's results (one step late)."""
        start = time.perf_counter()
        self.dist.begin_step(self.num_steps)
        outputs, batch, continued = self._schedule()
        scheduled = time.perf_counter()           # the step before is done unless continued
        outputs += self.output_stage.take_done(
            WRITE_POLL_S if batch is None and not self.plan_busy else 0.0)
        sampling = self.sampling.for_batch(batch)
        plan = self._gather_plan(batch, sampling)
        if not plan.any_work or plan.shutdown:
            return outputs + self._finish(continued)
        self.num_steps += 1
        if batch is not None and not batch.is_decoding:    # rows past prev_rows': chunks
            rows = list(zip(batch.seqs, batch.q_lens))[len(batch.prev_rows or ()):]
            self.num_prefill_tokens += sum(n for seq, n in rows if not seq.prefilled)
        batch = self.spec.with_draft_count(batch, plan.num_spec)
        inputs = self._make_inputs(batch, continued, plan)
        result = self.agent.step(inputs, sampling)
        result = self.strategy.post_broadcast(result, self.agent, inputs, plan, self.dist)
        self.dist.end_step()
        outputs += self._update_or_hold(batch, inputs, result, continued)
        end = time.perf_counter()
        self.spec.observe_time(batch, plan.num_spec, end - start)
        self.scheduler.observe_step(batch, end - start, end - scheduled)
        return outputs

    def _schedule(self) -> tuple[list[StepOutput], ScheduledBatch | None, InFlight | None]:
        """(outputs, this step's batch or None, the in-flight step it continues): the in-flight
        batch runs again when it can (its results applied once this step is launched), else its
        results are applied first and the scheduler decides."""
        pending, self.in_flight = self.in_flight, None
        if self.next_batch is not None:       # scheduled when the step before went out
            batch, self.next_batch = self.next_batch, None
            return [], batch, None
        if pending is not None and self._can_continue(pending):
            batch = self.scheduler.continuation(pending.batch)
            if batch is not None:
                self.num_continued_steps += 1
                return [], batch, pending
        outputs = self._finish(pending)
        batch = None if self.stop_requested else self.scheduler.schedule()
        if pending is not None and self.dist.config.dp == 1 and (
                batch is None or not self._held(batch)):
            # its tokens go out now, not after a step the host waits for (a held one is only
            # launched first); ranks with other batches, dp > 1, would miss that in the plan
            self.next_batch = batch
            return outputs, None, None
        return outputs, batch, None

    def _held(self, batch: ScheduledBatch) -> bool:
        """Async scheduling: the step's results are applied a step late (it is not waited for)."""
        return self.async_scheduling and (batch.is_decoding or self.scheduler.holds_mixed(batch))

    def _can_continue(self, pending: InFlight) -> bool:
        """When its rows are all that runs and none has finished (`Scheduler.continuation`
        says what follows). Never with a penalised or constrained row: its penalties or grammar
        mask need the tokens emitted so far, which the host would not know yet."""
        seqs = pending.batch.seqs
        if (not self.async_scheduling or self.stop_requested
                or len(self.scheduler.running) != len(seqs)
                or any(s.is_finished or s.gen_config.has_penalties or s.grammar is not None
                       for s in seqs)):
            return False
        return pending.batch.is_decoding or pending.result.hidden_states is None

    def _gather_plan(self, batch: ScheduledBatch | None, sampling: SamplingInputs) -> StepPlan:
        """The StepPlan of the ranks that share this step's collectives."""
        plan = StepPlan.gather(batch, self.dist, self.stop_requested,
                               sampled=not sampling.all_greedy,
                               num_spec=self.spec.choose_k(batch),
                               mixed_budget=self.scheduler.propose_mixed_budget(),
                               num_events=self.num_events_seen)
        if self.dist.config.tp > 1:
            self.num_events_agreed = plan.fewest_events(self.dist.plan.ranks, self.dist.tp.ranks)
        if plan.mixed_budget:                     # the next step's, the same on every rank
            self.scheduler.mixed_chunk = plan.mixed_budget
        self.stopped = plan.shutdown
        self.plan_busy = plan.any_work
        return plan

    def _make_inputs(self, batch: ScheduledBatch | None, continued: InFlight | None,
                     plan: StepPlan) -> ModelInputs:
        """The batch's inputs, or an idle rank's dummy ones; every padded size from the plan."""
        if batch is None:       # idle rank: the busy ranks' collectives, on dummy inputs
            inputs = self.strategy.make_dummy_inputs(
                plan.dummy_tokens_per_seq, plan.any_decoding, self.device, plan.num_spec)
        elif continued is not None and batch.is_decoding:
            inputs = self.strategy.make_next_decode_inputs(batch, continued.inputs,
                                                           continued.result, self.device)
        elif continued is not None:
            inputs = self.strategy.make_next_mixed_inputs(batch, continued.result, self.device)
        else:
            inputs = self.strategy.batch_inputs(batch, self.device)
        inputs.padded_batch_size = plan.max_batch_size       # graph bucket: same on every rank
        inputs.graphable = self.dist.config.ep == 1 or plan.all_decoding   # DeepEP mode held
        inputs.num_spec = plan.num_spec                       # drafts verified and made
        # sequence parallelism for prefill and mixed steps only: plain TP costs decode less
        split = self.dist.config.sequence_parallel and not inputs.is_decoding
        inputs.sizes = plan.forward_sizes(inputs.num_tokens, inputs.batch_size, split)
        self.ep.prepare(inputs.sizes)       # DeepEP: capacity check, clean
        return inputs

    def _update_or_hold(self, batch: ScheduledBatch | None, inputs: ModelInputs,
                        result: StepResult, continued: InFlight | None) -> list[StepOutput]:
        """Apply this step's results, or (async: decoding, or a mixed step the scheduler holds)
        hold them and apply the continued one."""
        if batch is None:
            return []
        launched = InFlight.launch(batch, inputs, result)
        if not self._held(batch):
            return self._finish(continued) + self._finish(launched)
        self.in_flight = launched
        return self._finish(continued)

    def _finish(self, launched: InFlight | None) -> list[StepOutput]:
        """Wait for a launched step's results on the host and apply them (none: nothing)."""
        if launched is None:
            return []
        return self._update(launched.batch, launched.host_result(self.dist))

    def _update(self, batch: ScheduledBatch, result: StepResult) -> list[StepOutput]:
        """The host learns the step's tokens (one device-to-host copy); the strategy says what
        each row adds. A failure in one sequence's host work (stop checks, detokenizing) ends
        that request alone ('error')."""
        tokens = result.output_tokens.tolist()
        hidden, start = result.hidden_states, 0
        logprobs = host_logprobs(result)
        verified = result.num_accepted_drafts is not None
        accepted = result.num_accepted_drafts.tolist() if verified else [None] * len(tokens)
        self.spec.observe_acceptance(batch, accepted if verified else None)
        row_drafts = batch.row_drafts or [None] * len(tokens)
        outputs = []
        for i, (seq, q_len, samples, row, num_accepted, num_drafts) in enumerate(zip(
                batch.seqs, batch.q_lens, batch.sample_mask, tokens, accepted, row_drafts)):
            start += q_len
            applied = batch.applied_rows is not None and batch.applied_rows[i]
            if seq.is_finished or (applied and not samples):
                continue          # (async) finished while this step ran; a chunk applied
            num_tokens = len(seq.token_ids)
            try:
                if hidden is not None:
                    self.output_stage.add(seq, seq.num_computed, hidden[start - q_len:start])
                computed, emitted = self.strategy.emitted(seq, q_len, samples, row, num_accepted,
                                                          num_drafts)
                computed *= not applied                     # (a prompt's end applied early)
                emitted = self.scheduler.update(seq, computed, emitted)
                if seq.grammar is not None:
                    advance(seq.grammar, emitted)
                if emitted or seq.is_finished:     # a non-final prefill chunk has no news
                    entries = row_logprobs(logprobs, i, len(emitted), seq.gen_config.logprobs)
                    outputs += self.output_stage.emit(seq, StepOutput(seq, emitted, entries))
            except Exception as e:
                del seq.token_ids[num_tokens:]   # what it emitted before this step stands
                logger.warning('request %d failed: %s', seq.seq_id, e)
                self.abort(seq)
                seq.finish_reason, seq.error = 'error', request_error(e)
                outputs.append(StepOutput(seq, []))
        return outputs

    @property
    def spec_stats(self) -> SpecDecodeStats:
        """Counters over every verify step (settable: benchmarks reset them after a warm-up)."""
        return self.strategy.stats

    @spec_stats.setter
    def spec_stats(self, stats: SpecDecodeStats):
        self.strategy.stats = stats

    def generate(self, prompts: list[list[int]], gen_config: GenerationConfig) -> list[Sequence]:
        """Run prompts to completion (tests, benchmarks); n choices flattened (prompt * n + i)."""
        seqs = [seq for p in prompts for seq in self.add_group(p, gen_config)]
        while self.has_work:
            self.step()
        return seqs
