"""The engine of one DP rank: schedule -> plan -> inputs -> forward -> post -> update (DESIGN.md
"One step"; `Engine.step` names each stage).

Where its sizes come from:
  * speculation: `SpecPlan` (spec_decode/build.py), plain data derived from the
    SpeculativeConfig: k, the draft's extra KV positions (-> max_positions, the scheduler's
    block reservations), its KV layers, tp and weights and the per-slot draft tables (-> the KV
    plan), whether proposals need the host's tokens (-> no async scheduling). The engine checks
    no method name;
  * KV blocks and state slots: `plan_cache` (engine/cache_plan.py), the minimum over all ranks;
  * every padded size of a step (graph bucket, tp-aligned token counts, EP capacity, DeepEP
    mode) and whether TP peers exchange sampled drafts' distributions: the StepPlan
    (engine/step_plan.py).
"""
from __future__ import annotations

import dataclasses
import logging
import time
import uuid

import torch

from lmdeploy_lite.messages import (GenerationConfig, PytorchEngineConfig, SpecDecodeStats,
                                    SpeculativeConfig)
from lmdeploy_lite.pytorch.config import ModelConfig
from lmdeploy_lite.pytorch.distributed import DistContext
from lmdeploy_lite.pytorch.engine.block_manager import BlockManager
from lmdeploy_lite.pytorch.engine.cache_engine import CacheEngine
from lmdeploy_lite.pytorch.engine.cache_plan import available_memory, plan_cache
from lmdeploy_lite.pytorch.engine.hidden_states import HiddenStatesWriter, check_request_id
from lmdeploy_lite.pytorch.engine.model_agent import ModelAgent, StepResult
from lmdeploy_lite.pytorch.engine.scheduler import ScheduledBatch, Scheduler
from lmdeploy_lite.pytorch.engine.sequence import Sequence, request_error, validate_request
from lmdeploy_lite.pytorch.engine.step_output import (InFlight, StepOutput, host_logprobs,
                                                     row_logprobs)
from lmdeploy_lite.pytorch.engine.step_plan import StepPlan
from lmdeploy_lite.pytorch.engine.stopping import StopChecker
from lmdeploy_lite.pytorch.model_inputs import ForwardSizes, ModelInputs
from lmdeploy_lite.pytorch.models.loader import build_model
from lmdeploy_lite.pytorch.nn.token_dispatcher import (allocate_buffers, prepare_dispatch,
                                                       uses_deep_ep)
from lmdeploy_lite.pytorch.sampling import Penalties, SamplingInputs
from lmdeploy_lite.pytorch.spec_decode.build import (build_spec_decoding,
                                                     check_speculative_config, spec_plan)
from lmdeploy_lite.pytorch.spec_decode.policy import DraftCountPolicy
from lmdeploy_lite.pytorch.strategies.ar import ARStrategy
from lmdeploy_lite.pytorch.strategies.base import dummy_table_width, to_device

logger = logging.getLogger('lmdeploy_lite')

WRITE_POLL_S = 0.01      # an idle engine waits this long for a hidden-states file per step
_DTYPES = {'float32': torch.float32, 'float64': torch.float64, 'bfloat16': torch.bfloat16,
           'float16': torch.float16}


def resolve_device(device: str) -> torch.device:
    if device == 'auto':
        device = 'cuda' if torch.cuda.is_available() else 'cpu'
    if device == 'cuda' and not torch.cuda.is_available():
        raise ValueError("device='cuda': CUDA is not available on this machine; use 'cpu' or 'auto'")
    return torch.device(device)


def resolve_dtype(dtype: str, model_config: ModelConfig, device: torch.device) -> torch.dtype:
    if dtype != 'auto':
        return _DTYPES[dtype]
    if device.type == 'cpu':
        return torch.float32           # bf16 matmuls are slow on most CPUs
    text = model_config.hf_config.get('text_config') or model_config.hf_config
    name = text.get('dtype') or text.get('torch_dtype') or model_config.hf_config.get('torch_dtype')
    return _DTYPES.get(name, torch.bfloat16)


class Engine:

    def __init__(self, model_path: str, engine_config: PytorchEngineConfig | None = None,
                 speculative_config: SpeculativeConfig | None = None, tokenizer=None,
                 progress: bool = True, dist_ctx: DistContext | None = None):
        cfg = engine_config or PytorchEngineConfig()
        self.dist = dist_ctx or DistContext.single()
        self.model_config = ModelConfig.from_pretrained(model_path)
        self.device = resolve_device(cfg.device)
        self.dtype = resolve_dtype(cfg.dtype, self.model_config, self.device)
        self.session_len = cfg.session_len or self.model_config.max_position_embeddings
        if speculative_config is not None:
            check_speculative_config(speculative_config, model_path, self.dist.config,
                                     cfg.load_format)
        self.spec_plan = spec = spec_plan(speculative_config, self.model_config, self.dtype,
                                     self.dist.config)
        extract = spec.aux_hidden_state_layer_ids
        if extract and cfg.enable_prefix_caching:   # a cached prefix is never fed: no rows
            logger.info('extract_hidden_states: prefix caching off (every prompt token is fed)')
            cfg = dataclasses.replace(cfg, enable_prefix_caching=False)
        self.engine_config = cfg
        # n choices share their prompt's prefill (forking) unless every choice must be fed its
        # prompt (extract_hidden_states: a forked choice's file would lack the prompt's rows)
        self.share_prefill = not extract
        self.num_spec_tokens = num_spec = spec.num_spec_tokens
        max_positions = self.session_len + num_spec + spec.num_draft_extra
        model = build_model(model_path, self.dtype, self.device, progress=progress,
                            dist_ctx=self.dist, load_format=cfg.load_format, seed=cfg.seed)
        allocate_buffers(self.dist)            # a DeepEP buffer (if any), before the KV plan
        tp = self.dist.config.tp
        cache_config = plan_cache(self.model_config, cfg, max_positions, num_spec,
                                  spec.draft.num_kv_layers, self.dtype,
                                  available_memory(self.device, self.dist.world_size), tp,
                                  spec.draft.tp, spec.draft.weight_bytes,
                                  spec.draft_probs_bytes_per_slot)
        # block tables and prefix-cache decisions must agree
        num_blocks, num_snapshots = self.dist.world.all_reduce(
            torch.tensor([cache_config.num_blocks, cache_config.num_snapshots]), op='min').tolist()
        self.cache_config = dataclasses.replace(cache_config, num_blocks=num_blocks,
                                                num_snapshots=num_snapshots)
        caches = CacheEngine(self.model_config, self.cache_config, self.dtype, self.device, tp=tp,
                             ssm_state_dtype=cfg.ssm_state_dtype)
        num_slots = self.cache_config.num_state_slots
        self.agent = ModelAgent(model, caches, num_slots, self.device)
        # extract_hidden_states: TP rank 0 of each DP group keeps the rows and writes the files
        self.hidden_states = None
        if extract and self.dist.tp_rank == 0:
            self.agent.hidden_state_layer_ids = extract
            self.hidden_states = HiddenStatesWriter(spec.hidden_states_dir, extract)
        self.strategy = ARStrategy()
        # each rank's proposal of a step's draft count; the StepPlan agrees on one
        self.draft_policy = (DraftCountPolicy.from_config(num_spec, spec.dynamic)
                             if spec.enabled else None)
        if spec.enabled:
            self.agent, self.strategy = build_spec_decoding(
                speculative_config, model_path, self.agent, self.model_config, self.cache_config,
                self.dtype, self.device, progress, self.dist, load_format=cfg.load_format,
                seed=cfg.seed)
        if self.device.type == 'cuda' and not cfg.eager_mode:
            self._enable_graphs(max_positions)
        block_manager = BlockManager(self.cache_config.num_blocks, self.cache_config.block_size,
                                     num_slots, num_snapshots=self.cache_config.num_snapshots,
                                     lookahead=spec.draft.num_kv_layers > 0)
        self.scheduler = Scheduler(block_manager, cfg.max_batch_size, cfg.max_prefill_token_num,
                                   self.session_len, num_spec_tokens=num_spec,
                                   num_draft_extra=spec.num_draft_extra,
                                   stop_checker=StopChecker(self.model_config.eos_token_ids,
                                                            tokenizer),
                                   max_mixed_token_num=cfg.max_mixed_token_num)
        self._next_seq_id = 0
        self.num_steps = 0
        self.num_prefill_tokens = 0        # tokens fed in prefill rows (prompts, recomputes)
        self.stop_requested = False        # set by a driver; travels to every rank in the plan
        self.stopped = False
        self.plan_busy = False             # some rank of the plan group worked last step
        self.in_flight: InFlight | None = None           # async scheduling: a launched step
        self.num_continued_steps = 0       # decode steps launched before the host caught up
        self.async_scheduling = (cfg.async_scheduling if cfg.async_scheduling is not None
                                 else self.device.type == 'cuda')
        if self.async_scheduling and spec.needs_host_tokens:
            log = logger.warning if cfg.async_scheduling else logger.info
            log('async_scheduling: the %s proposer drafts on the host from the accepted tokens, '
                'which it needs before each step; running without async scheduling',
                spec.proposer)
            self.async_scheduling = False
        self._idle_sampling = SamplingInputs.greedy(1, self.device)    # a dummy forward's
        self._greedy_sampling: dict[int, SamplingInputs] = {}          # all-greedy batches'
        logger.info('engine ready: %s, %s on %s, %d KV blocks x %d tokens', model_path,
                    self.dtype, self.device, self.cache_config.num_blocks,
                    self.cache_config.block_size)

    def _enable_graphs(self, max_positions: int):
        """CUDA graphs for decode steps, their device collectives captured with them: TP
        all-reduces (and sequence parallelism's reduce-scatters and row gathers) on NCCL, or on
        the one-shot peer-memory all-reduce when chosen (distributed.py), and EP through
        DeepEP's low-latency kernels (decode steps in which every rank decodes; others run
        eagerly in normal mode).
        The all-to-all dispatcher (host-side counts) runs eagerly."""
        layout = self.dist.config
        if self.dtype == torch.float64:     # float64 runs the plain-PyTorch ops, not capturable
            logger.info('CUDA graphs off: float64 runs decode steps eagerly')
            return
        if self.spec_plan.aux_hidden_state_layer_ids:    # on every rank alike
            logger.info('CUDA graphs off: extract_hidden_states runs decode steps eagerly')
            return
        deep_ep = layout.ep > 1 and uses_deep_ep(self.dist)
        if layout.ep > 1 and not deep_ep:
            logger.info('CUDA graphs off: ep=%d dispatches by all-to-all (host-side counts); '
                        'decode steps run eagerly', layout.ep)
            return
        from lmdeploy_lite.pytorch.backends.cuda.graph_runner import batch_buckets
        block_size = self.cache_config.block_size
        max_blocks = max(-(-max_positions // block_size),
                         dummy_table_width(1 + self.num_spec_tokens))
        if deep_ep:             # every rank captures the same buckets in the same order
            most = self.engine_config.max_batch_size * (1 + self.num_spec_tokens)
            prepare_dispatch(self.dist, ForwardSizes.captured(most, most, layout.tp))
        self.agent.enable_graphs(batch_buckets(self.engine_config.max_batch_size), max_blocks,
                                 recorder=self.dist)

    # ---- requests -------------------------------------------------------------------------
    def validate_request(self, token_ids: list[int], gen_config: GenerationConfig):
        validate_request(token_ids, gen_config, self.model_config.vocab_size, self.session_len)

    def add_request(self, token_ids: list[int], gen_config: GenerationConfig,
                    request_id: str | None = None) -> Sequence:
        """One sequence (gen_config.n == 1; `add_group` for more). Raises ValueError for an
        invalid request; the engine is then unchanged. `request_id`: the front-end's name for
        it (extract_hidden_states names its file so; None: a random one)."""
        if isinstance(gen_config, GenerationConfig) and gen_config.n != 1:
            raise ValueError(f'n={gen_config.n}: add_request adds one sequence; add_group adds '
                             f'the n choices of a prompt')
        return self.add_group(token_ids, gen_config, [request_id])[0]

    def add_group(self, token_ids: list[int], gen_config: GenerationConfig,
                  request_ids: list[str | None] | None = None) -> list[Sequence]:
        """The gen_config.n choices of one prompt, choice i first: they share one prefill of
        the prompt (the scheduler forks choices 1.. from choice 0's, engine/scheduler.py).
        Choice i's generator is seeded with (random_seed + i) mod 2**64, or without a seed
        derived from the engine's seed and its sequence id. `request_ids`: each choice's name
        (see add_request; None: random ones). Raises ValueError for an invalid request; the
        engine is then unchanged."""
        self.validate_request(token_ids, gen_config)
        request_ids = [None] * gen_config.n if request_ids is None else request_ids
        if len(request_ids) != gen_config.n:
            raise ValueError(f'n={gen_config.n}: {len(request_ids)} request ids given, one per '
                             f'choice needed')
        request_ids = [uuid.uuid4().hex if r is None else check_request_id(r)
                       for r in request_ids]
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
        leader = seqs[0]
        if len(token_ids) > 1 and self.share_prefill:     # one token: nothing to share
            leader.forks = seqs[1:]
            for member in leader.forks:
                member.fork_from = leader
        for seq in seqs:
            self.scheduler.add(seq)
        return seqs

    def abort(self, seq: Sequence):
        self.scheduler.abort(seq)
        if self.hidden_states is not None:
            self.hidden_states.drop(seq)

    def fail_request(self, seq: Sequence, error: BaseException):
        """End one request with finish_reason 'error' and the reason (its cache freed)."""
        logger.warning('request %d failed: %s', seq.seq_id, error)
        self.abort(seq)
        seq.finish_reason, seq.error = 'error', request_error(error)

    @property
    def has_work(self) -> bool:
        return (self.scheduler.has_work or self.in_flight is not None
                or (self.hidden_states is not None and self.hidden_states.pending > 0))

    # ---- the step -------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """One forward on every rank of the plan group: schedule -> plan -> inputs -> forward ->
        post -> update. With async scheduling a decode step is launched before the host applies
        the previous step's results (they reach it here, one step late)."""
        start = time.perf_counter()
        self.dist.begin_step(self.num_steps)
        outputs, batch, continued = self._schedule()
        outputs += self._written(idle=batch is None and not self.plan_busy)
        sampling = self._sampling_inputs(batch)
        plan = self._gather_plan(batch, sampling)
        if not plan.any_work or plan.shutdown:
            return outputs + self._finish(continued)
        self.num_steps += 1
        if batch is not None and not batch.is_decoding:
            self.num_prefill_tokens += sum(n for seq, n in zip(batch.seqs, batch.q_lens)
                                           if not seq.prefilled)
        batch = self._with_draft_count(batch, plan.num_spec)
        inputs = self._make_inputs(batch, continued, plan)
        result = self.agent.step(inputs, sampling)
        result = self.strategy.post_broadcast(result, self.agent, inputs, plan, self.dist)
        self.dist.end_step()
        outputs += self._update_or_hold(batch, inputs, result, continued)
        if self.draft_policy is not None:
            self._time_step(batch, plan.num_spec, time.perf_counter() - start)
        return outputs

    def _with_draft_count(self, batch: ScheduledBatch | None, k: int
                          ) -> ScheduledBatch | None:
        """The batch at the plan's draft count k (speculation): a decode row feeds k + 1
        tokens and verifies the drafts its last step made, at most k (`row_drafts`; fewer when
        that step drafted fewer: its extra positions are never accepted); every row then drafts
        k. A new object: a continued batch is still its in-flight step's."""
        if batch is None or self.draft_policy is None:
            return batch
        seqs = batch.seqs
        if batch.is_decoding and self.spec_plan.needs_host_tokens:
            row_drafts, q_lens = [k] * len(seqs), [k + 1] * len(seqs)   # drafted on the host now
        elif batch.is_decoding:
            row_drafts = [min(s.drafts_ready, k) for s in seqs]
            q_lens = [k + 1] * len(seqs)
        else:
            row_drafts, q_lens = None, batch.q_lens
        for seq in seqs:
            seq.drafts_ready = k
        return ScheduledBatch(seqs, q_lens, batch.is_decoding, k, row_drafts, batch.restores,
                              batch.saves, batch.block_copies, batch.state_copies)

    def _time_step(self, batch: ScheduledBatch | None, k: int, seconds: float):
        """The draft-count policy learns decode steps' wall times (module policy.py)."""
        if batch is not None and batch.is_decoding:
            self.draft_policy.observe_time(len(batch.seqs), k, seconds)
        else:
            self.draft_policy.break_sequence()

    def _schedule(self) -> tuple[list[StepOutput], ScheduledBatch | None, InFlight | None]:
        """(outputs, this step's batch, the in-flight step it continues). Async scheduling runs
        the in-flight decode batch again when nothing else could be scheduled (`continued`: its
        results are applied once this step is launched); otherwise its results are applied first
        (`outputs`) and the scheduler decides. None: no batch on this rank (or a stop)."""
        pending, self.in_flight = self.in_flight, None
        if pending is not None and self._can_continue(pending):
            self.num_continued_steps += 1
            return [], pending.batch, pending
        outputs = self._finish(pending)
        return outputs, None if self.stop_requested else self.scheduler.schedule(), None

    def _can_continue(self, pending: 'InFlight') -> bool:
        """Async scheduling: run the in-flight decode batch again without the host catching up,
        when nothing else could be scheduled (no waiting or chunked request, no finished or
        aborted sequence, room for two more steps); otherwise the host applies first.
        A batch with a penalised row is never continued (it runs synchronously): its penalties
        count the tokens emitted so far, which the host sends each step (`_sampling_inputs`)
        and would not know yet."""
        seqs = pending.batch.seqs
        if (not self.async_scheduling or not pending.batch.is_decoding or self.stop_requested
                or self.scheduler.waiting or len(self.scheduler.running) != len(seqs)
                or any(s.is_finished or s.gen_config.has_penalties for s in seqs)):
            return False
        return self.scheduler.reserve_ahead(seqs, num_steps=2)

    def _sampling_inputs(self, batch: ScheduledBatch | None) -> SamplingInputs:
        """`_sampling_table`, with the logprobs the step computes when some row asks for them:
        the largest request's top-N, once for the whole batch."""
        sampling = self._sampling_table(batch)
        asked = [s.gen_config.logprobs for s in batch.seqs] if batch is not None else []
        asked = [n for n in asked if n is not None]
        return dataclasses.replace(sampling, logprobs=max(asked)) if asked else sampling

    def _sampling_table(self, batch: ScheduledBatch | None) -> SamplingInputs:
        """Rows of a prefill chunk that does not reach the sequence's end sample nothing, so
        they draw nothing from the request's generator: a seed's stream does not depend on how
        the prompt was chunked (which depends on the rest of the batch). No batch: a dummy
        forward's one greedy row. Penalised rows that sample this step add their penalties and
        token ids (the host's: `_can_continue` keeps it up to date)."""
        if batch is None:
            return self._idle_sampling
        cfgs, mask = [s.gen_config for s in batch.seqs], batch.sample_mask
        if all(c.is_greedy for c in cfgs):      # no row samples: one cached table per size
            sampling = self._greedy_sampling.get(len(cfgs))
            if sampling is None:
                sampling = self._greedy_sampling[len(cfgs)] = SamplingInputs.greedy(
                    len(cfgs), self.device)
        else:
            sampling = SamplingInputs.from_values(
                do_sample=[not c.is_greedy and m for c, m in zip(cfgs, mask)],
                temperature=[c.temperature for c in cfgs], top_k=[c.top_k for c in cfgs],
                top_p=[c.top_p for c in cfgs],
                generators=[s.generator if m else None for s, m in zip(batch.seqs, mask)],
                device=self.device)
        penalised = [c.has_penalties and m for c, m in zip(cfgs, mask)]
        if not any(penalised):
            return sampling
        seqs = batch.seqs
        penalties = Penalties.from_values(
            repetition=[c.repetition_penalty if p else 1.0 for c, p in zip(cfgs, penalised)],
            presence=[c.presence_penalty if p else 0.0 for c, p in zip(cfgs, penalised)],
            frequency=[c.frequency_penalty if p else 0.0 for c, p in zip(cfgs, penalised)],
            prompt_ids=[s.token_ids[:s.num_prompt] if p else () for s, p in zip(seqs, penalised)],
            output_ids=[s.token_ids[s.num_prompt:] if p else () for s, p in zip(seqs, penalised)],
            device=self.device)
        return dataclasses.replace(sampling, penalties=penalties)   # never the cached table

    def _gather_plan(self, batch: ScheduledBatch | None, sampling: SamplingInputs) -> StepPlan:
        """The StepPlan of the ranks that share this step's collectives; it carries the stop
        and whether any of them works (the executors poll `plan_busy`)."""
        num_spec = (self.draft_policy.propose(len(batch.seqs))
                    if batch is not None and self.draft_policy is not None else 0)
        plan = StepPlan.gather(batch, self.dist, self.stop_requested,
                               sampled=not sampling.all_greedy, num_spec=num_spec)
        self.stopped = plan.shutdown
        self.plan_busy = plan.any_work
        return plan

    def _make_inputs(self, batch: ScheduledBatch | None, continued: InFlight | None,
                     plan: StepPlan) -> ModelInputs:
        """The batch's inputs (a continued decode batch's built on the device from its last
        results), or an idle rank's dummy inputs shaped like the busiest rank's step; every
        padded size from the plan."""
        if batch is None:       # idle rank: the busy ranks' collectives, on dummy inputs
            inputs = self.strategy.make_dummy_inputs(
                plan.dummy_tokens_per_seq, plan.any_decoding, self.device, plan.num_spec)
        elif continued is not None:
            inputs = self.strategy.make_next_decode_inputs(batch, continued.inputs,
                                                           continued.result, self.device)
        else:
            inputs = self.strategy.make_model_inputs(batch, self.device)
            if batch.restores:
                inputs.state_restores = to_device(torch.tensor(batch.restores), self.device)
            if batch.saves:
                inputs.state_saves = to_device(torch.tensor(batch.saves), self.device)
            if batch.block_copies:
                inputs.block_copies = to_device(torch.tensor(batch.block_copies), self.device)
            if batch.state_copies:
                inputs.state_copies = to_device(torch.tensor(batch.state_copies), self.device)
        inputs.padded_batch_size = plan.max_batch_size       # graph bucket: same on every rank
        inputs.graphable = self.dist.config.ep == 1 or plan.all_decoding   # DeepEP mode held
        inputs.num_spec = plan.num_spec                       # drafts verified and made
        # sequence parallelism (if configured) for prefill and mixed steps only: decode steps
        # run plain TP, whose one all-reduce per sub-layer costs less (ForwardSizes)
        split = self.dist.config.sequence_parallel and not inputs.is_decoding
        inputs.sizes = plan.forward_sizes(inputs.num_tokens, inputs.batch_size, split)
        prepare_dispatch(self.dist, inputs.sizes)       # DeepEP: capacity check, clean
        return inputs

    def _update_or_hold(self, batch: ScheduledBatch | None, inputs: ModelInputs,
                        result: StepResult, continued: InFlight | None) -> list[StepOutput]:
        """Apply this step's results, or (async scheduling, a decode step) hold them in flight
        and apply the step it continued, one step late. An idle rank has nothing to apply."""
        if batch is None:
            return []
        launched = InFlight.launch(batch, inputs, result)
        if not (self.async_scheduling and batch.is_decoding):
            return self._finish(launched)
        self.in_flight = launched
        return self._finish(continued)

    def _finish(self, launched: InFlight | None) -> list[StepOutput]:
        """Wait for a launched step's results on the host and apply them (none: nothing)."""
        if launched is None:
            return []
        return self._update(launched.batch, launched.host_result(self.dist))

    def _written(self, idle: bool) -> list[StepOutput]:
        """extract_hidden_states: the last outputs of requests whose file is now written (an
        `idle` step, whose plan group did nothing last step either, waits a little for one
        instead of spinning)."""
        if self.hidden_states is None or not self.hidden_states.pending:
            return []
        return self.hidden_states.take_done(WRITE_POLL_S if idle else 0.0)

    def _update(self, batch: ScheduledBatch, result: StepResult) -> list[StepOutput]:
        """The host learns the step's tokens here (one device-to-host copy). What each row adds
        to its sequence is the strategy's (it keeps the speculative counters). A failure in one
        sequence's host work (stop checks, detokenizing) ends that request alone ('error').
        extract_hidden_states: each row's hidden states are kept by position, and a finished
        request's last output waits for its file (`_written`)."""
        tokens = result.output_tokens.tolist()
        hidden, start = result.hidden_states, 0
        logprobs = host_logprobs(result)
        verified = result.num_accepted_drafts is not None
        accepted = result.num_accepted_drafts.tolist() if verified else [None] * len(tokens)
        row_drafts = batch.row_drafts or [None] * len(tokens)
        if verified and self.draft_policy is not None and batch.row_drafts is not None:
            self.draft_policy.observe_acceptance(row_drafts, accepted)
        outputs = []
        for i, (seq, q_len, samples, row, num_accepted, num_drafts) in enumerate(zip(
                batch.seqs, batch.q_lens, batch.sample_mask, tokens, accepted, row_drafts)):
            start += q_len
            if seq.is_finished:                  # (async) finished while this step ran
                continue
            num_tokens = len(seq.token_ids)
            try:
                if hidden is not None:
                    self.hidden_states.add(seq, seq.num_computed, hidden[start - q_len:start])
                computed, emitted = self.strategy.emitted(seq, q_len, samples, row, num_accepted,
                                                          num_drafts)
                emitted = self.scheduler.update(seq, computed, emitted)
                entries = row_logprobs(logprobs, i, len(emitted), seq.gen_config.logprobs)
                if hidden is not None and seq.is_finished:
                    self.hidden_states.finish(seq, StepOutput(seq, emitted, entries))
                elif emitted or seq.is_finished:     # a non-final prefill chunk has no news
                    outputs.append(StepOutput(seq, emitted, entries))
            except Exception as e:
                del seq.token_ids[num_tokens:]   # what it emitted before this step stands
                self.fail_request(seq, e)
                outputs.append(StepOutput(seq, []))
        return outputs

    @property
    def spec_stats(self) -> SpecDecodeStats:
        """Speculative counters over every verify step (the strategy keeps them; empty without
        speculation). Settable: benchmarks reset them after a warm-up."""
        return self.strategy.stats

    @spec_stats.setter
    def spec_stats(self, stats: SpecDecodeStats):
        self.strategy.stats = stats

    # ---- convenience ----------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], gen_config: GenerationConfig) -> list[Sequence]:
        """Run prompts to completion in this thread (tests, benchmarks); with gen_config.n > 1
        each prompt's n choices, flattened (prompt_index * n + i)."""
        seqs = [seq for p in prompts for seq in self.add_group(p, gen_config)]
        while self.has_work:
            self.step()
        return seqs

