"""Routed experts of a MoE layer in plain PyTorch: a loop over the experts that have rows.

Layout (as transformers keeps Qwen3.5's experts): `gate_up_proj [E, 2I, H]` (gate rows first),
`down_proj [E, H, I]`; expert e maps a row x to `down_e(silu(gate_e x) * up_e x)`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .norm import silu_mul


def fused_moe(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """x [T, H]; topk_weights [T, k] (x.dtype or fp32); topk_ids [T, k] in 0..E-1, or -1 for
    "no expert" (contributes 0) -> out [T, H] in x.dtype, `out[t] = sum_j w[t, j] * expert(x[t])`,
    summed over j in order (EP's combine sums the same way, so every layout gives the same numbers).
    Reads device values on the host: not for captured decode steps."""
    num_tokens, top_k = topk_ids.shape
    flat_ids = topk_ids.reshape(-1)
    pairs = torch.zeros(num_tokens * top_k, x.shape[-1], dtype=x.dtype, device=x.device)
    rows_x = x.repeat_interleave(top_k, dim=0)
    for expert in flat_ids.unique().tolist():
        if expert < 0:
            continue
        rows = torch.where(flat_ids == expert)[0]
        gate_up = F.linear(rows_x[rows], gate_up_proj[expert])
        pairs[rows] = F.linear(silu_mul(gate_up), down_proj[expert])
    out = (pairs.view(num_tokens, top_k, x.shape[-1]) * topk_weights[..., None]).sum(1)
    return out.to(x.dtype)
