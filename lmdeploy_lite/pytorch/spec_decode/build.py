"""Turn a SpeculativeConfig into the engine's speculative pieces: agent, strategy, proposer."""
from __future__ import annotations

import os

import torch

from lmdeploy_lite.messages import SpeculativeConfig
from lmdeploy_lite.pytorch.config import CacheConfig, ModelConfig
from lmdeploy_lite.pytorch.engine.cache_engine import CacheEngine
from lmdeploy_lite.pytorch.engine.model_agent import ModelAgent
from lmdeploy_lite.pytorch.models.loader import has_mtp_weights
from lmdeploy_lite.pytorch.nn.linear import fuse_projections
from lmdeploy_lite.pytorch.spec_decode.proposers.ngram import NgramProposer
from lmdeploy_lite.pytorch.spec_decode.spec_agent import SpecAgent
from lmdeploy_lite.pytorch.strategies.ar_spec import ARSpecStrategy


def draft_model_dir(spec: SpeculativeConfig, model_path: str) -> str:
    return spec.model or model_path


def draft_tp(spec: SpeculativeConfig, target_tp: int) -> int:
    return target_tp if spec.tp is None else spec.tp


def check_speculative_config(spec: SpeculativeConfig, model_path: str, target_tp: int = 1,
                             load_format: str = 'auto'):
    """Errors a user can act on, raised at startup before any request runs."""
    if spec.method != 'qwen3_5_mtp':
        return
    if draft_tp(spec, target_tp) not in (1, target_tp):
        raise ValueError(f'SpeculativeConfig.tp={spec.tp}: the draft runs with the target\'s '
                         f'tp={target_tp} or replicated with tp=1')
    path = draft_model_dir(spec, model_path)
    if not os.path.isdir(path):
        raise ValueError(f'SpeculativeConfig.model={path!r}: no such directory')
    if load_format != 'dummy' and not has_mtp_weights(path):
        raise ValueError(f"SpeculativeConfig(method='qwen3_5_mtp'): {path} has no mtp.* tensors; "
                         f"use a Qwen3.5 checkpoint that ships its MTP head, or method='ngram'")


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
        tp = draft_tp(spec, dist_ctx.config.tp if dist_ctx is not None else 1)
        # tp=1 under a TP target: the MTP layer is replicated (no TP, no EP collectives in it);
        # the shared embedding and LM head keep the target's TP, so every TP rank drafts
        layer_ctx = dist_ctx if tp > 1 or spec.tp is None else None
        mtp = Qwen3_5MTP(model_config, dtype, device, target_model.embed_tokens,
                         target_model.lm_head, layer_ctx)
        load_mtp_weights(mtp, draft_model_dir(spec, model_path), progress=progress,
                         load_format=load_format, seed=seed)
        if device.type == 'cuda':
            fuse_projections(mtp)
        mtp.eval()
        caches = CacheEngine(model_config, cache_config, dtype, device,
                             layer_types=('full_attention',), tp=tp)
        proposer = MTPProposer(mtp, caches, target_model.compute_logits, k)
    else:
        host_proposer = NgramProposer(k, spec.ngram_min, spec.ngram_max)
    agent = SpecAgent(target, proposer, k, cache_config.num_state_slots, model_config.vocab_size)
    return agent, ARSpecStrategy(k, host_proposer)
