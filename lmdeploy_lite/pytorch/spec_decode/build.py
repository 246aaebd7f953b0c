"""A SpeculativeConfig turned into the engine's pieces: `SpecPlan`, plain sizes that engine/ and
the executors read (only this package and strategies/ar_spec/ know the methods), then the agent
and strategy. extract_hidden_states drafts nothing (k = 0): it names the layers each request's
file holds.
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

import torch

from lmdeploy_lite.messages import SpeculativeConfig
from lmdeploy_lite.pytorch.config import CacheConfig, DistConfig, ModelConfig
from lmdeploy_lite.pytorch.cache_engine import CacheEngine
from lmdeploy_lite.pytorch.model_agent import ModelAgent
from lmdeploy_lite.pytorch.models.loader import has_mtp_weights, load_mtp_weights
from lmdeploy_lite.pytorch.sampling import probs_dtype
from lmdeploy_lite.pytorch.spec_decode.proposers.ngram import NgramProposer
from lmdeploy_lite.pytorch.spec_decode.spec_agent import SpecAgent
from lmdeploy_lite.pytorch.spec_decode.token_map import (ReducedLMHead, load_token_map,
                                                         rows_per_rank)
from lmdeploy_lite.pytorch.strategies.ar_spec import ARSpecStrategy


def draft_dist_config(spec: SpeculativeConfig, target: DistConfig) -> DistConfig:
    """SpeculativeConfig.tp / .ep where given, else the target's; the target's dp; sequence
    parallelism the target's where the draft's tp > 1."""
    tp = target.tp if spec.tp is None else spec.tp
    return DistConfig(tp=tp, dp=target.dp, ep=target.ep if spec.ep is None else spec.ep,
                      sequence_parallel=target.sequence_parallel and tp > 1)


def check_speculative_config(spec: SpeculativeConfig, model_path: str,
                             target: DistConfig | None = None, load_format: str = 'auto'):
    """Errors a user can act on, raised before any rank starts (`target`: default one rank)."""
    target, model_config = target or DistConfig(), ModelConfig.from_pretrained(model_path)
    if spec.method == 'extract_hidden_states':
        if target.sequence_parallel:
            raise ValueError("SpeculativeConfig(method='extract_hidden_states') with "
                             'PytorchEngineConfig(sequence_parallel=True): not supported (the '
                             'captured rows are whole, sequence parallelism splits them over '
                             'the TP ranks); set sequence_parallel=False to extract')
        check_extraction(spec, model_config.num_layers)
    if spec.method != 'qwen3_5_mtp':
        return
    if spec.tp is not None and target.tp % spec.tp:
        divisors = [d for d in range(1, target.tp + 1) if target.tp % d == 0]
        raise ValueError(f"SpeculativeConfig.tp={spec.tp}: must divide the target's "
                         f"tp={target.tp} (one of {divisors}, or None for the target's)")
    path = spec.model or model_path                  # the draft's checkpoint
    if not os.path.isdir(path):
        raise ValueError(f'SpeculativeConfig.model={path!r}: no such directory')
    if spec.ep is not None and spec.ep not in (1, target.ep):
        dense = '' if model_config.is_moe else ' (the model is dense: its MTP layer has no experts)'
        raise ValueError(f"SpeculativeConfig.ep={spec.ep}: must be 1 (the MTP layer's experts "
                         f"replicated on every rank), the target's ep={target.ep}, or None{dense}")
    if load_format != 'dummy' and not has_mtp_weights(path):
        raise ValueError(f"SpeculativeConfig(method='qwen3_5_mtp'): {path} has no mtp.* tensors; "
                         f"use a Qwen3.5 checkpoint that ships its MTP head, or method='ngram'")
    if spec.draft_token_map is not None:     # the draft shares the target's LM head and vocab
        load_token_map(spec.draft_token_map, model_config.vocab_size)


def check_extraction(spec: SpeculativeConfig, num_layers: int):
    """Every layer id in 0..num_layers; a directory that exists (or is made) and takes a file."""
    ids = spec.aux_hidden_state_layer_ids
    bad = [i for i in ids if i > num_layers]
    if bad:
        raise ValueError(f'aux_hidden_state_layer_ids={list(ids)}: {bad} outside '
                         f'0..{num_layers} (0: the embedding output, 1..{num_layers - 1}: the '
                         f'input of that decoder layer, {num_layers}: the final-normed hidden '
                         f'state)')
    directory = spec.hidden_states_dir
    try:
        os.makedirs(directory, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix='.probe-'):
            pass
    except OSError as e:
        raise ValueError(f'hidden_states_dir={directory!r}: must be a directory this process can '
                         f'create and write files in ({e.strerror or e})') from None


@dataclass(frozen=True)
class DraftFootprint:
    """What the draft holds on one rank, for `plan_cache`: `num_kv_layers` KV layers at `tp`'s
    share of the KV heads, `weight_bytes` of its own weights (not the shared embedding / LM
    head; with a token map, the reduced head's rows)."""
    num_kv_layers: int
    tp: int
    weight_bytes: int


def draft_footprint(spec: SpeculativeConfig | None, model_config: ModelConfig,
                    dtype: torch.dtype, target: DistConfig, fp8=None) -> DraftFootprint:
    """Weight bytes from the head built on the meta device with the draft's layout (`fp8`: which
    of its linears and routed experts the device will hold as FP8 blocks and scales,
    loader.fp8_linears)."""
    if not uses_draft_model(spec):
        return DraftFootprint(0, target.tp, 0)
    from lmdeploy_lite.pytorch.distributed import DistContext
    from lmdeploy_lite.pytorch.models.qwen3_5_mtp import Qwen3_5MTP
    layout = draft_dist_config(spec, target)
    mtp = Qwen3_5MTP(model_config, dtype, 'meta', None, None, DistContext(layout, rank=0))
    if fp8 is not None:
        from lmdeploy_lite.pytorch.models.fp8 import to_fp8
        to_fp8(mtp, 'meta', fp8, prefix='mtp.', sizes_only=True)
    weight_bytes = sum(p.numel() * p.element_size() for p in mtp.parameters())
    if spec.draft_token_map is not None:
        token_map = load_token_map(spec.draft_token_map, model_config.vocab_size)
        rows = rows_per_rank(token_map, model_config.vocab_size, target.tp)
        weight_bytes += rows * model_config.hidden_size * dtype.itemsize
    return DraftFootprint(1, layout.tp, weight_bytes)


@dataclass(frozen=True)
class SpecPlan:
    num_spec_tokens: int = 0               # k drafts verified per decode step (0: no speculation)
    # KV positions the MTP head writes past the k + 1 a verify feeds: k - 1 (it drafts k from the
    # last accepted position); none for a host proposer (ngram)
    num_draft_extra: int = 0
    draft: DraftFootprint = DraftFootprint(0, 1, 0)     # the MTP head's KV and weights per rank
    # q [k, vocab] per state slot for verifying sampled drafts (SpecAgent.draft_probs), 4 bytes
    # each in float32, 8 in float64: ~194 MB at max_batch_size 64, k = 3 and Qwen3.5's 248k
    # vocabulary; [k, M] with a token map of M ids (~25 MB at M = 32k); 0 for host proposers,
    # whose drafts are deterministic
    draft_probs_bytes_per_slot: int = 0
    needs_host_tokens: bool = False        # host drafts read accepted tokens: no async scheduling
    proposer: str = ''                     # the method's name, for messages only
    dynamic: bool = False                  # each step's draft count chosen in 0..k (policy.py)
    # extract_hidden_states (k = 0): output_hidden_states ids kept per token, the files' dir
    aux_hidden_state_layer_ids: tuple[int, ...] = ()
    hidden_states_dir: str | None = None

    @property
    def enabled(self) -> bool:
        return self.num_spec_tokens > 0


def num_draft_tokens(spec: SpeculativeConfig | None) -> int:
    """The most drafts a step verifies (0: none, or extracting hidden states)."""
    if spec is None or spec.method == 'extract_hidden_states':
        return 0
    return spec.num_speculative_tokens


def uses_draft_model(spec: SpeculativeConfig | None) -> bool:
    return spec is not None and spec.method == 'qwen3_5_mtp'


def spec_plan(spec: SpeculativeConfig | None, model_config: ModelConfig, dtype: torch.dtype,
              target: DistConfig, fp8=None) -> SpecPlan:
    draft = draft_footprint(spec, model_config, dtype, target, fp8)
    if spec is None:
        return SpecPlan(draft=draft)
    if spec.method == 'extract_hidden_states':      # plain decoding: no draft, no proposer
        return SpecPlan(draft=draft, proposer=spec.method,
                        aux_hidden_state_layer_ids=spec.aux_hidden_state_layer_ids,
                        hidden_states_dir=spec.hidden_states_dir)
    k = spec.num_speculative_tokens
    if not uses_draft_model(spec):
        return SpecPlan(k, draft=draft, needs_host_tokens=True, proposer=spec.method,
                        dynamic=spec.dynamic)
    draft_vocab = (model_config.vocab_size if spec.draft_token_map is None else
                   len(load_token_map(spec.draft_token_map, model_config.vocab_size)))
    probs_bytes = k * draft_vocab * probs_dtype(dtype).itemsize
    return SpecPlan(k, num_draft_extra=k - 1, draft=draft, draft_probs_bytes_per_slot=probs_bytes,
                    proposer=spec.method, dynamic=spec.dynamic)


def build_spec_decoding(spec: SpeculativeConfig, model_path: str, target: ModelAgent,
                        model_config: ModelConfig, cache_config: CacheConfig, dtype: torch.dtype,
                        device: torch.device, progress: bool = True, dist_ctx=None,
                        load_format: str = 'auto', seed: int = 0, model_format: str | None = None
                        ) -> tuple[SpecAgent, ARSpecStrategy]:
    k = spec.num_speculative_tokens
    proposer, host_proposer, token_map = None, None, None
    if uses_draft_model(spec):
        from lmdeploy_lite.pytorch.models.qwen3_5_mtp import Qwen3_5MTP
        from lmdeploy_lite.pytorch.spec_decode.proposers.mtp import MTPProposer
        target_model = target.model
        layout = draft_dist_config(spec, dist_ctx.config if dist_ctx is not None else DistConfig())
        # the MTP layer at the draft's own tp / ep (tp=1: every TP rank drafts, rank 0's drafts
        # are broadcast); the shared embedding and LM head keep the target's TP
        layer_ctx = dist_ctx.draft_context(layout) if dist_ctx is not None else None
        mtp = Qwen3_5MTP(model_config, dtype, device, target_model.embed_tokens,
                         target_model.lm_head, layer_ctx)
        load_mtp_weights(mtp, spec.model or model_path, progress=progress,
                         load_format=load_format, seed=seed, model_format=model_format)
        mtp.eval()
        caches = CacheEngine(model_config, cache_config, dtype, device,
                             layer_types=('full_attention',), tp=layout.tp)
        compute_logits = target_model.compute_logits
        if spec.draft_token_map is not None:     # checked at start-up; read again here
            token_map = load_token_map(spec.draft_token_map, model_config.vocab_size).to(device)
            compute_logits = ReducedLMHead(target_model.lm_head, token_map, probs_dtype(dtype))
        proposer = MTPProposer(mtp, caches, compute_logits, k, token_map)
    else:
        host_proposer = NgramProposer(k, spec.ngram_min, spec.ngram_max)
    agent = SpecAgent(target, proposer, k, cache_config.num_state_slots, model_config.vocab_size,
                      probs_dtype(dtype), token_map, dynamic=spec.dynamic)
    return agent, ARSpecStrategy(k, host_proposer)
