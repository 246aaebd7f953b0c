"""Qwen3.5 Gated DeltaNet (linear attention) mixer: in_proj_qkv -> causal depthwise conv (kernel
K) + SiLU over `[q | k | v]` -> q, k (nk heads x dk) and v (nv heads x dv); beta =
sigmoid(in_proj_b); log decay g = -exp(A_log) * softplus(in_proj_a + dt_bias); gated delta rule;
per-head gated RMSNorm with silu(in_proj_z); out_proj. Per-sequence state: cache_engine.py.

Tensor parallel (qwen3_5.md section 2): in_proj_qkv and conv1d are split by their q, k and v
sections separately (each rank keeps `[q_r | k_r | v_r]`: nk/tp key and nv/tp value heads, so
value head j still uses key head j // (nv/nk)); z, b, a, A_log and dt_bias by value heads; the
gated norm's weight (per channel of a head) is replicated; out_proj is row-parallel. The state
caches hold only this rank's channels / heads. Sequence-parallel as GatedAttention.
"""
from __future__ import annotations

from functools import partial

import torch
from torch import nn

from ..model_inputs import ModelInputs
from .linear import ColumnParallelLinear, FusedColumnLinear, RowParallelLinear, check_divisible
from .norm import GatedRMSNorm
from .sequence_parallel import restore_rows, splits_rows
from .sharding import sharded_parameter, tp_layout


class GatedDeltaNet(nn.Module):
    def __init__(self, hidden_size: int, num_key_heads: int, num_value_heads: int,
                 key_head_dim: int, value_head_dim: int, conv_kernel: int, eps: float, backend,
                 dtype: torch.dtype, device: torch.device | str, dist_ctx=None):
        super().__init__()
        tp, _ = tp_layout(dist_ctx)
        check_divisible('num_key_heads', (num_key_heads,), tp)
        check_divisible('num_value_heads', (num_value_heads,), tp)
        key_dim, value_dim = num_key_heads * key_head_dim, num_value_heads * value_head_dim
        qkv_sections = (key_dim, key_dim, value_dim)   # [q | k | v], each split by heads
        self.key_head_dim, self.value_head_dim = key_head_dim, value_head_dim
        self.key_dim, self.value_dim = key_dim // tp, value_dim // tp       # this rank's widths
        self.backend = backend
        column = partial(ColumnParallelLinear, hidden_size, dtype=dtype, device=device,
                         dist_ctx=dist_ctx)
        self.in_proj_qkv = column(sum(qkv_sections), sections=qkv_sections)
        self.in_proj_z = column(value_dim)
        self.in_proj_b, self.in_proj_a = column(num_value_heads), column(num_value_heads)
        self.conv1d = nn.Module()   # keeps the checkpoint name `conv1d.weight` [conv_dim, 1, K]
        self.conv1d.weight = sharded_parameter((sum(qkv_sections), 1, conv_kernel), 0, dist_ctx,
                                               dtype, device, qkv_sections)
        per_head = partial(sharded_parameter, (num_value_heads,), 0, dist_ctx, dtype, device)
        self.dt_bias, self.A_log = per_head(init=torch.ones), per_head(init=torch.zeros)
        self.norm = GatedRMSNorm(value_head_dim, eps, dtype, device)   # [dv], same for every head
        self.out_proj = RowParallelLinear(value_dim, hidden_size, dtype, device, dist_ctx=dist_ctx)
        self.in_proj = None          # in_proj_qkv/z/b/a as one GEMM, after `fuse_projections`

    def fuse_projections(self, keep_parts: bool = False):
        if self.in_proj is not None:
            return
        self.in_proj = FusedColumnLinear([self.in_proj_qkv, self.in_proj_z, self.in_proj_b,
                                          self.in_proj_a], keep_parts)
        if not keep_parts:
            del self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a

    def forward(self, hidden: torch.Tensor, state_cache: tuple[torch.Tensor, torch.Tensor],
                inputs: ModelInputs) -> torch.Tensor:
        """hidden [T, H] -> [T, H] (sequence-parallel: [Tp, H] -> [Tp / tp, H])."""
        num_rows = hidden.shape[0]
        hidden = hidden[:inputs.num_tokens]        # its T real rows (of Tp, sequence-parallel)
        num_tokens = hidden.shape[0]
        if self.in_proj is not None:
            mixed, z, b, a = self.in_proj(hidden)
        else:
            mixed, z = self.in_proj_qkv(hidden), self.in_proj_z(hidden)
            b, a = self.in_proj_b(hidden), self.in_proj_a(hidden)
        z = z.view(num_tokens, -1, self.value_head_dim)
        backend, decoding = self.backend, inputs.is_decoding
        parts = (self.key_dim, self.key_dim, self.value_dim)
        if decoding:
            mixed = backend.causal_conv1d_update(mixed, self.conv1d.weight[:, 0], state_cache[0],
                                                 inputs)
            q, k, v = mixed.split_with_sizes(parts, dim=-1)
        else:                                  # q, k, v each contiguous where the backend can
            q, k, v = backend.causal_conv1d_prefill(mixed, self.conv1d.weight[:, 0],
                                                    state_cache[0], inputs, parts=parts)
        q, k = (x.view(num_tokens, -1, self.key_head_dim) for x in (q, k))
        v = v.view(num_tokens, -1, self.value_head_dim)
        g, beta = backend.gdn_gating(a, b, self.A_log, self.dt_bias)
        rule = backend.gated_delta_rule_decode if decoding else backend.gated_delta_rule_prefill
        out = rule(q, k, v, g, beta, state_cache[1], inputs)
        out = self.norm(out, z).reshape(num_tokens, -1)
        return self.out_proj(restore_rows(out, num_rows), splits_rows(inputs))
