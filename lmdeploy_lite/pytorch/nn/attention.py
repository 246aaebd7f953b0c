"""Qwen3.5 gated full attention: `q_proj` gives per head `[q_h | gate_h]` (2 * head_dim); q/k get
a per-head zero-centred RMSNorm, then partial RoPE; paged causal GQA attention (scale
head_dim^-0.5); the result is multiplied by `sigmoid(gate)` and projected by `o_proj`.

Tensor parallel: each rank keeps num_heads / tp query heads (whole `[q_h | gate_h]` blocks of
q_proj) and num_kv_heads / tp KV heads (its KV cache holds only those); where tp is a multiple of
num_kv_heads above it, the one KV head its query heads read, computed and cached on each of the
tp / num_kv_heads ranks that share it (`head_replicas`); o_proj is row-parallel
(sequence-parallel: [Tp, H] in, [Tp / tp, H] out; nn/sequence_parallel.py).
"""
from __future__ import annotations

from functools import partial

import torch
from torch import nn

from ..config import head_replicas
from ..model_inputs import ModelInputs
from .linear import ColumnParallelLinear, FusedColumnLinear, RowParallelLinear
from .norm import RMSNorm
from .sequence_parallel import restore_rows, splits_rows
from .sharding import tp_layout


class GatedAttention(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 eps: float, backend, dtype: torch.dtype, device: torch.device | str,
                 dist_ctx=None):
        super().__init__()
        self.head_dim, self.backend, self.scale = head_dim, backend, head_dim ** -0.5
        column = partial(ColumnParallelLinear, hidden_size, dtype=dtype, device=device,
                         dist_ctx=dist_ctx)
        self.q_proj = column(num_heads * head_dim * 2)
        kv = partial(column, num_kv_heads * head_dim,
                     replicas=head_replicas('num_kv_heads', num_kv_heads, tp_layout(dist_ctx)[0]))
        self.k_proj, self.v_proj = kv(), kv()
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden_size, dtype, device,
                                        dist_ctx=dist_ctx)
        self.q_norm = RMSNorm(head_dim, eps, dtype, device)
        self.k_norm = RMSNorm(head_dim, eps, dtype, device)
        self.qkv_proj = None         # q/k/v_proj as one GEMM, after `fuse_projections`

    def fuse_projections(self, keep_parts: bool = False):
        if self.qkv_proj is not None:
            return
        self.qkv_proj = FusedColumnLinear([self.q_proj, self.k_proj, self.v_proj], keep_parts)
        if not keep_parts:
            del self.q_proj, self.k_proj, self.v_proj

    def _project(self, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
                 ) -> tuple[torch.Tensor, ...]:
        """hidden [T, H] -> q, gate [T, heads, d]; k (normed, rotated), v [T, kv_heads, d]."""
        num_tokens = hidden.shape[0]
        if self.qkv_proj is not None:
            q_gate, k, v = self.qkv_proj(hidden)
        else:
            q_gate, k, v = self.q_proj(hidden), self.k_proj(hidden), self.v_proj(hidden)
        q_gate = q_gate.view(num_tokens, -1, 2 * self.head_dim)
        k = self._norm_rope(self.k_norm, k.view(num_tokens, -1, self.head_dim), rope)
        return (*q_gate.split(self.head_dim, -1), k, v.view(num_tokens, -1, self.head_dim))

    def _project_kv(self, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`_project`'s k and v only, where the parts are kept (the CPU's fused GEMM keeps them;
        q and its gate are 2/3 of its rows), else from the whole projection."""
        if not hasattr(self, 'k_proj'):
            return self._project(hidden, rope)[2:]
        num_tokens = hidden.shape[0]
        k = self._norm_rope(self.k_norm, self.k_proj(hidden).view(num_tokens, -1, self.head_dim),
                            rope)
        return k, self.v_proj(hidden).view(num_tokens, -1, self.head_dim)

    def _norm_rope(self, norm: RMSNorm, x: torch.Tensor, rope) -> torch.Tensor:
        return self.backend.rms_norm_rope(x, norm.weight, norm.eps, *rope)

    def forward(self, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                kv_cache: tuple[torch.Tensor, torch.Tensor], inputs: ModelInputs) -> torch.Tensor:
        """hidden [T, H] ([Tp, H] sequence-parallel: T real rows, then padding); rope (cos, sin)
        [T, rotary_dim]; kv_cache (k_cache, v_cache) with this rank's KV heads."""
        num_rows = hidden.shape[0]
        hidden = hidden[:inputs.num_tokens]        # its T real rows (of Tp, sequence-parallel)
        num_tokens = hidden.shape[0]
        q, gate, k, v = self._project(hidden, rope)
        q = self._norm_rope(self.q_norm, q, rope)
        out = self.backend.paged_attention(q, k, v, kv_cache[0], kv_cache[1], inputs, self.scale)
        # the gate is a strided view: sigmoid reads it in place (no copy of it to reshape)
        out = out.reshape(num_tokens, -1) * torch.sigmoid(gate).reshape(num_tokens, -1)
        return self.o_proj(restore_rows(out, num_rows), splits_rows(inputs))

    def store_kv(self, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                 kv_cache: tuple[torch.Tensor, torch.Tensor], *steps: ModelInputs):
        """Only the cache writes of `forward` (the same k/v), without attention or o_proj; the
        rows of several steps' tokens one after another, each step's written by its inputs."""
        k, v = self._project_kv(hidden, rope)
        if len(steps) == 1:          # no slicing, so no token count read (graph captures)
            self.backend.store_kv(k, v, kv_cache[0], kv_cache[1], steps[0])
            return
        start = 0
        for inputs in steps:
            end = start + inputs.num_tokens
            self.backend.store_kv(k[start:end], v[start:end], kv_cache[0], kv_cache[1], inputs)
            start = end
