"""CUDA ops: Triton kernels checked against `backends/default` (tests/pytorch/backends/cuda), and
fla-core's chunk kernel for prefill gated delta rule chunks longer than
`gated_delta_rule.SHORT_PREFILL_TOKENS` where fla is installed (imported lazily; optional).
Decode-path ops keep the decode-step contract of `backends/__init__.py`, so `graph_runner.py` can
capture them. Ops without a kernel here are the default backend's. `fp8_experts`: the MoE ops
take FP8 experts (models/fp8.fp8_experts_for).
"""
from __future__ import annotations

import functools


@functools.cache
def cuda_backend():
    from ..default import DefaultBackend
    from .causal_conv1d import causal_conv1d_prefill, causal_conv1d_update
    from .fp8_gemm import fp8_linear
    from .fused_moe import fused_moe, fused_moe_masked
    from .gated_delta_rule import gated_delta_rule_decode, gated_delta_rule_prefill, gdn_gating
    from .greedy import argmax, greedy_accept
    from .norm import add_rms_norm, gated_rms_norm, rms_norm, rms_norm_rope, silu_mul
    from .paged_attention import paged_attention, store_kv
    from .rotary import rotary_cos_sin
    ops = (add_rms_norm, argmax, causal_conv1d_prefill, causal_conv1d_update, fp8_linear,
           fused_moe, fused_moe_masked, gated_delta_rule_decode, gated_delta_rule_prefill,
           gdn_gating, gated_rms_norm, greedy_accept, rms_norm, rms_norm_rope, rotary_cos_sin,
           silu_mul, paged_attention, store_kv)
    return type('CudaBackend', (DefaultBackend,), {
        'fp8_experts': True, **{fn.__name__: staticmethod(fn) for fn in ops}})
