"""Op selection. Models call ops only through the object `get_backend(device)` returns, so a
device backend (`backends/cuda`, Triton kernels) can replace the plain-PyTorch one.

Every backend provides (see `backends/default` for shapes and semantics):
    paged_attention(q, k, v, k_cache, v_cache, inputs, scale) -> [T, nq, head_dim]
    store_kv(k, v, k_cache, v_cache, inputs) -> None   (the step's k/v into the paged caches only)
    causal_conv1d_prefill | _update(x, weight, conv_cache, inputs) -> [T, C]
                              (prefill with parts=(a, b, c): three [T, part] tensors)
    gated_delta_rule_prefill | _decode(q, k, v, g, beta, state_cache, inputs) -> [T, nv, dv]
    gdn_gating(a, b, A_log, dt_bias) -> (g, beta)   (log decay and write strength, [T, nv])
    rms_norm(x, weight, eps) -> x.shape          (zero-centred: x / rms(x) * (1 + w))
    add_rms_norm(x, residual, weight, eps) -> (rms_norm(s), s), s = residual + x; residual consumed
    gated_rms_norm(x, gate, weight, eps) -> x.shape   (w * x / rms(x) * silu(gate))
    rms_norm_rope(x, weight, eps, cos, sin) -> [T, heads, D]   (rms_norm, then partial RoPE)
    silu_mul(gate_up) -> [..., I]                (silu(gate_up[..., :I]) * gate_up[..., I:])
    rotary_cos_sin(positions, inv_freq, dtype) -> (cos, sin)   (RoPE rows [T, R], sin sign-folded)
    argmax(logits) -> [...] long                 (first maximum of each row, as torch.argmax)
    greedy_accept(target_argmax, draft_tokens, num_drafts) -> (output_tokens, num_accepted)
    fused_moe(x, gate_up_proj, down_proj, topk_weights, topk_ids) -> [T, H]
    fused_moe_masked(x, counts, gate_up_proj, down_proj, out=None) -> [E, C, H]  (x[e, :counts[e]])
                              (both: gate_up_scale=, down_scale= with FP8 experts, models/fp8.py)

Decode-step contract (what lets `graph_runner` capture a step in a CUDA graph): when
`inputs.is_decoding`, or in a captured prefill step (`inputs.sync_free`, any lengths), an op
reads no device value on the host (no `.item()`, `.tolist()`, `host_q_lens`, `max_kv_len`,
`seq_groups`) and allocates nothing whose shape depends on device data; `inputs.uniform_q_len`
(a host int) and tensor shapes are allowed.
"""
from __future__ import annotations

import importlib.util
import os

import torch


def get_backend(device: torch.device | str):
    """The CUDA backend (Triton kernels) on a CUDA device when Triton imports; else the default.
    `LMDEPLOY_LITE_BACKEND=default` forces the plain-PyTorch ops on CUDA (for comparisons)."""
    if (torch.device(device).type == 'cuda'
            and os.environ.get('LMDEPLOY_LITE_BACKEND', 'auto') != 'default'
            and importlib.util.find_spec('triton') is not None):
        from .cuda import cuda_backend
        return cuda_backend()
    from .default import DefaultBackend
    return DefaultBackend
