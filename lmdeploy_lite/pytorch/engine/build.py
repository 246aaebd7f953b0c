"""`build_engine`: everything an Engine is made of, built in order and handed over whole. Sizes
come from the SpecPlan (spec_decode/build.py: k, the draft's KV and weights, async scheduling or
not), the KV plan (engine/cache_plan.py, the minimum over all ranks) and, per step, the StepPlan
(engine/step_plan.py). Speculation's runtime is the engine's one handle on it.
"""
from __future__ import annotations

import dataclasses
import logging

import torch

from lmdeploy_lite.messages import PytorchEngineConfig, SpeculativeConfig
from lmdeploy_lite.pytorch.cache_engine import CacheEngine
from lmdeploy_lite.pytorch.config import CacheConfig, ModelConfig
from lmdeploy_lite.pytorch.distributed import DistContext
from lmdeploy_lite.pytorch.engine.block_manager import BlockManager
from lmdeploy_lite.pytorch.engine.cache_plan import (available_memory, plan_cache,
                                                      prefill_graph_bytes)
from lmdeploy_lite.pytorch.engine.engine import Engine
from lmdeploy_lite.pytorch.engine.hidden_states import DirectOutputs, HiddenStatesWriter
from lmdeploy_lite.pytorch.engine.scheduler import Scheduler
from lmdeploy_lite.pytorch.engine.stopping import StopChecker
from lmdeploy_lite.pytorch.model_agent import ModelAgent
from lmdeploy_lite.pytorch.model_inputs import ForwardSizes
from lmdeploy_lite.pytorch.models.fp8 import fp8_matmul_for
from lmdeploy_lite.pytorch.models.loader import build_model
from lmdeploy_lite.pytorch.nn.token_dispatcher import EPTransport, dispatch_capacity
from lmdeploy_lite.pytorch.spec_decode.runtime import (SpecPlan, build_spec_runtime,
                                                       plan_speculation)
from lmdeploy_lite.pytorch.strategies.base import dummy_table_width

logger = logging.getLogger('lmdeploy_lite')

_DTYPES = {'float32': torch.float32, 'float64': torch.float64, 'bfloat16': torch.bfloat16,
           'float16': torch.float16}


def resolve_device(device: str) -> torch.device:
    if device == 'auto':
        device = 'cuda' if torch.cuda.is_available() else 'cpu'
    if device == 'cuda' and not torch.cuda.is_available():
        raise ValueError("device='cuda': CUDA is not available on this machine; use 'cpu' or "
                         "'auto'")
    return torch.device(device)


def resolve_dtype(dtype: str, model_config: ModelConfig, device: torch.device) -> torch.dtype:
    if dtype != 'auto':
        return _DTYPES[dtype]
    if device.type == 'cpu':
        return torch.float32           # bf16 matmuls are slow on most CPUs
    text = model_config.hf_config.get('text_config') or model_config.hf_config
    name = text.get('dtype') or text.get('torch_dtype') or model_config.hf_config.get('torch_dtype')
    return _DTYPES.get(name, torch.bfloat16)


def build_engine(model_path: str, engine_config: PytorchEngineConfig | None = None,
                 speculative_config: SpeculativeConfig | None = None, tokenizer=None,
                 progress: bool = True, dist_ctx: DistContext | None = None) -> Engine:
    """One DP rank's engine (`dist_ctx`: this rank's place in the world; None: alone)."""
    cfg = engine_config or PytorchEngineConfig()
    dist = dist_ctx or DistContext.single()
    model_config = ModelConfig.from_pretrained(model_path)
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, model_config, device)
    session_len = cfg.session_len or model_config.max_position_embeddings
    plan = plan_speculation(speculative_config, model_path, model_config, dtype, dist.config,
                            cfg.load_format, cfg.model_format, fp8_matmul_for(device) is not None)
    if plan.aux_hidden_state_layer_ids and cfg.enable_prefix_caching:  # a cached prefix: no rows
        logger.info('extract_hidden_states: prefix caching off (every prompt token is fed)')
        cfg = dataclasses.replace(cfg, enable_prefix_caching=False)
    max_positions = session_len + plan.num_spec_tokens + plan.num_draft_extra
    model = build_model(model_path, dtype, device, progress=progress, dist_ctx=dist,
                        load_format=cfg.load_format, seed=cfg.seed, model_format=cfg.model_format)
    ep = EPTransport(dist, model_config.num_experts, model_config.hidden_size,
                     model_config.num_experts_per_tok,
                     dispatch_capacity(cfg.max_batch_size, plan.num_spec_tokens, dist.config.tp),
                     device, dtype)
    ep.attach(model)                  # DeepEP (if used): its buffer now, before the KV plan
    cache_config = _plan_cache(model_config, cfg, plan, dtype, device, dist, max_positions)
    caches = CacheEngine(model_config, cache_config, dtype, device, tp=dist.config.tp,
                         ssm_state_dtype=cfg.ssm_state_dtype)
    agent = ModelAgent(model, caches, cache_config.num_state_slots, device)
    output_stage = _output_stage(plan, dist, agent)
    spec = build_spec_runtime(speculative_config, plan, model_path, agent, model_config,
                              cache_config, dtype, device, progress, dist, cfg.load_format,
                              cfg.seed, cfg.model_format)
    for draft in spec.draft_modules():
        ep.attach(draft)
    if device.type == 'cuda' and not cfg.eager_mode:
        _enable_graphs(spec.agent, dist, ep, dtype, plan, cache_config, cfg, max_positions)
    scheduler = _scheduler(cfg, cache_config, plan, session_len, model_config, tokenizer)
    engine = Engine(dist, model_config, cfg, device, dtype, session_len, cache_config, spec,
                    scheduler, output_stage, _async_scheduling(cfg, device, plan), ep)
    logger.info('engine ready: %s, %s on %s, %d KV blocks x %d tokens', model_path, dtype, device,
                cache_config.num_blocks, cache_config.block_size)
    return engine


def _plan_cache(model_config: ModelConfig, cfg: PytorchEngineConfig, plan: SpecPlan,
                dtype: torch.dtype, device: torch.device, dist: DistContext,
                max_positions: int) -> CacheConfig:
    """This rank's KV plan, its counts the minimum over all ranks (block tables must agree)."""
    draft = plan.draft
    graph_tokens = _prefill_graph_tokens(cfg, dist, device, dtype, plan)
    graph_bytes = prefill_graph_bytes(model_config, graph_tokens, dtype, dist.config.tp)
    cache_config = plan_cache(model_config, cfg, max_positions, plan.num_spec_tokens,
                              draft.num_kv_layers, dtype,
                              available_memory(device, dist.world_size), dist.config.tp,
                              draft.tp, draft.weight_bytes, plan.draft_probs_bytes_per_slot,
                              graph_bytes)
    num_blocks, num_snapshots = dist.world.all_reduce(
        torch.tensor([cache_config.num_blocks, cache_config.num_snapshots]), op='min').tolist()
    return dataclasses.replace(cache_config, num_blocks=num_blocks, num_snapshots=num_snapshots)


def _output_stage(plan: SpecPlan, dist: DistContext, agent: ModelAgent):
    """extract_hidden_states: TP rank 0 of each DP group keeps the rows and writes the files."""
    extract = plan.aux_hidden_state_layer_ids
    if not extract or dist.tp_rank != 0:
        return DirectOutputs()
    agent.hidden_state_layer_ids = extract
    return HiddenStatesWriter(plan.hidden_states_dir, extract)


def _scheduler(cfg: PytorchEngineConfig, cache_config: CacheConfig, plan: SpecPlan,
               session_len: int, model_config: ModelConfig, tokenizer) -> Scheduler:
    block_manager = BlockManager(cache_config.num_blocks, cache_config.block_size,
                                 cache_config.num_state_slots,
                                 num_snapshots=cache_config.num_snapshots,
                                 lookahead=plan.draft.num_kv_layers > 0)
    return Scheduler(block_manager, cfg.max_batch_size, cfg.max_prefill_token_num, session_len,
                     num_spec_tokens=plan.num_spec_tokens, num_draft_extra=plan.num_draft_extra,
                     stop_checker=StopChecker(model_config.eos_token_ids, tokenizer),
                     max_mixed_token_num=cfg.max_mixed_token_num,
                     max_mixed_step_cost=cfg.max_mixed_step_cost)


def _async_scheduling(cfg: PytorchEngineConfig, device: torch.device, plan: SpecPlan) -> bool:
    """On by default on CUDA; off where the proposer drafts on the host from accepted tokens."""
    wanted = cfg.async_scheduling if cfg.async_scheduling is not None else device.type == 'cuda'
    if wanted and plan.needs_host_tokens:
        log = logger.warning if cfg.async_scheduling else logger.info
        log('async_scheduling: the %s proposer drafts on the host from the accepted tokens, '
            'which it needs before each step; running without async scheduling', plan.proposer)
        return False
    return wanted


def _prefill_graph_tokens(cfg: PytorchEngineConfig, dist: DistContext, device: torch.device,
                          dtype: torch.dtype, plan: SpecPlan) -> int:
    """The largest prefill step captured in a CUDA graph, 0 for none: on CUDA with graphs, TP's
    all-reduces captured with the step as in decode graphs; not under sequence parallelism (its
    prefill steps split their rows over the TP ranks: eager), EP (DeepEP's normal mode), float64
    or extract_hidden_states (no graphs at all); steps with a chunk over CAPTURED_PREFILL_TOKENS
    need fla."""
    layout = dist.config
    if (device.type != 'cuda' or cfg.eager_mode or layout.sequence_parallel or layout.ep > 1
            or dtype == torch.float64 or plan.aux_hidden_state_layer_ids):
        return 0
    from lmdeploy_lite.pytorch.backends.cuda import gated_delta_rule
    most = min(cfg.max_prefill_graph_tokens, cfg.max_prefill_token_num)
    if gated_delta_rule.fla_chunk_gated_delta_rule() is None:
        return min(most, gated_delta_rule.CAPTURED_PREFILL_TOKENS)
    return most


def _enable_graphs(agent, dist: DistContext, ep: EPTransport, dtype: torch.dtype,
                   plan: SpecPlan, cache_config: CacheConfig, cfg: PytorchEngineConfig,
                   max_positions: int):
    """CUDA graphs for decode steps, their device collectives captured with them (TP on NCCL or
    the peer-memory all-reduce; EP through DeepEP's low-latency kernels, in steps where every
    rank decodes). The all-to-all dispatcher (host-side counts) runs eagerly. The target's short
    prefill and mixed steps too, where `_prefill_graph_tokens` says."""
    layout = dist.config
    if dtype == torch.float64:     # float64 runs the plain-PyTorch ops, not capturable
        logger.info('CUDA graphs off: float64 runs decode steps eagerly')
        return
    if plan.aux_hidden_state_layer_ids:    # on every rank alike
        logger.info('CUDA graphs off: extract_hidden_states runs decode steps eagerly')
        return
    deep_ep = layout.ep > 1 and ep.deep_ep
    if layout.ep > 1 and not deep_ep:
        logger.info('CUDA graphs off: ep=%d dispatches by all-to-all (host-side counts); '
                    'decode steps run eagerly', layout.ep)
        return
    from lmdeploy_lite.pytorch.backends.cuda import gated_delta_rule
    from lmdeploy_lite.pytorch.backends.cuda.graph_runner import (batch_buckets, eager_step_lens,
                                                                  prefill_buckets)
    num_spec = plan.num_spec_tokens
    max_blocks = max(-(-max_positions // cache_config.block_size), dummy_table_width(1 + num_spec))
    if deep_ep:             # every rank captures the same buckets in the same order
        most = cfg.max_batch_size * (1 + num_spec)
        ep.prepare(ForwardSizes.captured(most, most, layout.tp))
    most_tokens = _prefill_graph_tokens(cfg, dist, torch.device('cuda'), dtype, plan)
    cap, fla = gated_delta_rule.CAPTURED_PREFILL_TOKENS, gated_delta_rule.fla_chunk_gated_delta_rule()
    prefill = {} if not most_tokens else dict(
        prefill_buckets=prefill_buckets(most_tokens), max_prefill_q_len=cap,
        long_row_from=gated_delta_rule.SHORT_PREFILL_TOKENS if fla is not None else 0,
        max_seq_tokens=max_blocks * cache_config.block_size)
    agent.enable_graphs(batch_buckets(cfg.max_batch_size), max_blocks, recorder=dist, **prefill)
    if layout.tp == 1 and layout.ep == 1:       # several ranks' eager steps: not yet measured
        agent.warm_eager(eager_step_lens(cfg.max_prefill_token_num, cap), cache_config.block_size)
