"""Op selection. Models call ops only through the object `get_backend(device)` returns, so a
device backend (e.g. `backends/cuda`, Triton kernels) can replace the plain-PyTorch one.

Every backend provides (see `backends/default` for shapes and semantics):
    paged_attention(q, k, v, k_cache, v_cache, inputs, scale) -> [T, nq, head_dim]
    causal_conv1d_prefill(x, weight, conv_cache, inputs) -> [T, C]
    causal_conv1d_update(x, weight, conv_cache, inputs) -> [T, C]
    gated_delta_rule_prefill(q, k, v, g, beta, state_cache, inputs) -> [T, nv, dv]
    gated_delta_rule_decode(q, k, v, g, beta, state_cache, inputs) -> [T, nv, dv]
"""
from __future__ import annotations

import torch


def get_backend(device: torch.device | str):
    """The op backend for `device`; only the default (pure PyTorch) backend exists so far."""
    from .default import DefaultBackend
    return DefaultBackend
