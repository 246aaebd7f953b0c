"""Turn a SpeculativeConfig into the engine's speculative pieces: agent, strategy, proposer."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from lmdeploy_lite.messages import SpeculativeConfig
from lmdeploy_lite.pytorch.config import CacheConfig, DistConfig, ModelConfig
from lmdeploy_lite.pytorch.engine.cache_engine import CacheEngine
from lmdeploy_lite.pytorch.engine.model_agent import ModelAgent
from lmdeploy_lite.pytorch.models.loader import has_mtp_weights
from lmdeploy_lite.pytorch.nn.linear import fuse_projections
from lmdeploy_lite.pytorch.spec_decode.proposers.ngram import NgramProposer
from lmdeploy_lite.pytorch.spec_decode.spec_agent import SpecAgent
from lmdeploy_lite.pytorch.strategies.ar_spec import ARSpecStrategy


def draft_model_dir(spec: SpeculativeConfig, model_path: str) -> str:
    return spec.model or model_path


def draft_dist_config(spec: SpeculativeConfig, target: DistConfig) -> DistConfig:
    """The draft's own layout: SpeculativeConfig.tp / .ep where given, else the target's; dp is
    always the target's."""
    return DistConfig(tp=target.tp if spec.tp is None else spec.tp, dp=target.dp,
                      ep=target.ep if spec.ep is None else spec.ep)


def check_speculative_config(spec: SpeculativeConfig, model_path: str,
                             target: DistConfig | None = None, load_format: str = 'auto'):
    """Errors a user can act on, raised at startup before any rank starts. `target`: the
    target's layout (default one rank)."""
    if spec.method != 'qwen3_5_mtp':
        return
    target = target or DistConfig()
    if spec.tp is not None and target.tp % spec.tp:
        divisors = [d for d in range(1, target.tp + 1) if target.tp % d == 0]
        raise ValueError(f"SpeculativeConfig.tp={spec.tp}: must divide the target's "
                         f"tp={target.tp} (one of {divisors}, or None for the target's)")
    path = draft_model_dir(spec, model_path)
    if not os.path.isdir(path):
        raise ValueError(f'SpeculativeConfig.model={path!r}: no such directory')
    if spec.ep is not None and spec.ep not in (1, target.ep):
        dense = not ModelConfig.from_pretrained(model_path).is_moe
        raise ValueError(f"SpeculativeConfig.ep={spec.ep}: must be 1 (the MTP layer's experts "
                         f"replicated on every rank), the target's ep={target.ep}, or None"
                         + (' (the model is dense: its MTP layer has no experts)' if dense
                            else ''))
    if load_format != 'dummy' and not has_mtp_weights(path):
        raise ValueError(f"SpeculativeConfig(method='qwen3_5_mtp'): {path} has no mtp.* tensors; "
                         f"use a Qwen3.5 checkpoint that ships its MTP head, or method='ngram'")


@dataclass(frozen=True)
class DraftFootprint:
    """What the draft holds on one rank, for `plan_cache`: `num_kv_layers` full-attention KV
    layers at `tp`'s share of the KV heads, and `weight_bytes` of its own weights (the MTP
    layer, fc and norms at the draft's tp / ep; the shared embedding and LM head are the
    target's)."""
    num_kv_layers: int
    tp: int
    weight_bytes: int


def draft_footprint(spec: SpeculativeConfig | None, model_config: ModelConfig,
                    dtype: torch.dtype, target: DistConfig) -> DraftFootprint:
    """The MTP head's per-rank footprint; nothing for no draft or a host proposer (ngram). The
    weight bytes are those of the head built on the meta device with the draft's layout: the
    exact shapes a rank allocates (every rank's shard has the same shape)."""
    if spec is None or spec.method != 'qwen3_5_mtp':
        return DraftFootprint(0, target.tp, 0)
    from lmdeploy_lite.pytorch.distributed import DistContext
    from lmdeploy_lite.pytorch.models.qwen3_5_mtp import Qwen3_5MTP
    layout = draft_dist_config(spec, target)
    mtp = Qwen3_5MTP(model_config, dtype, 'meta', None, None, DistContext(layout, rank=0))
    weight_bytes = sum(p.numel() * p.element_size() for p in mtp.parameters())
    return DraftFootprint(1, layout.tp, weight_bytes)


def build_spec_decoding(spec: SpeculativeConfig, model_path: str, target: ModelAgent,
                        model_config: ModelConfig, cache_config: CacheConfig, dtype: torch.dtype,
                        device: torch.device, progress: bool = True, dist_ctx=None,
                        load_format: str = 'auto', seed: int = 0
                        ) -> tuple[SpecAgent, ARSpecStrategy]:
    k = spec.num_speculative_tokens
    proposer, host_proposer = None, None
    if spec.method == 'qwen3_5_mtp':
        from lmdeploy_lite.pytorch.models.loader import load_mtp_weights
        from lmdeploy_lite.pytorch.models.qwen3_5_mtp import Qwen3_5MTP
        from lmdeploy_lite.pytorch.spec_decode.proposers.mtp import MTPProposer
        target_model = target.model
        layout = draft_dist_config(spec, dist_ctx.config if dist_ctx is not None else DistConfig())
        # the MTP layer runs on the draft's own tp / ep (a draft tp=1 layer is whole on every
        # rank, so every TP rank drafts; TP rank 0's drafts are broadcast in post_broadcast);
        # the shared embedding and LM head keep the target's TP
        layer_ctx = dist_ctx.draft_context(layout) if dist_ctx is not None else None
        mtp = Qwen3_5MTP(model_config, dtype, device, target_model.embed_tokens,
                         target_model.lm_head, layer_ctx)
        load_mtp_weights(mtp, draft_model_dir(spec, model_path), progress=progress,
                         load_format=load_format, seed=seed)
        if device.type == 'cuda':
            fuse_projections(mtp)
        mtp.eval()
        caches = CacheEngine(model_config, cache_config, dtype, device,
                             layer_types=('full_attention',), tp=layout.tp)
        proposer = MTPProposer(mtp, caches, target_model.compute_logits, k)
    else:
        host_proposer = NgramProposer(k, spec.ngram_min, spec.ngram_max)
    agent = SpecAgent(target, proposer, k, cache_config.num_state_slots, model_config.vocab_size)
    return agent, ARSpecStrategy(k, host_proposer)
