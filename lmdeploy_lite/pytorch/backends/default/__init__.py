"""Plain-PyTorch ops, correct on any device; a step's sequences are batched (padded, varlen.py)."""
from .causal_conv1d import causal_conv1d_prefill, causal_conv1d_update
from .gated_delta_rule import gated_delta_rule_decode, gated_delta_rule_prefill, gdn_gating
from .greedy import argmax, greedy_accept
from .moe import fused_moe, fused_moe_masked
from .norm import add_rms_norm, gated_rms_norm, rms_norm, rms_norm_rope, silu_mul
from .paged_attention import fill_kv_cache, paged_attention
from .rotary import rotary_cos_sin

_OPS = (paged_attention, causal_conv1d_prefill, causal_conv1d_update, gated_delta_rule_prefill,
        gated_delta_rule_decode, gdn_gating, rms_norm, add_rms_norm, gated_rms_norm, rms_norm_rope,
        silu_mul, rotary_cos_sin, argmax, greedy_accept, fused_moe, fused_moe_masked)
DefaultBackend = type('DefaultBackend', (), {
    'store_kv': staticmethod(fill_kv_cache), **{fn.__name__: staticmethod(fn) for fn in _OPS}})
