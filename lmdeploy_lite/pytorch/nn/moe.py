"""Qwen3.5 sparse MoE block: router, fused experts, sigmoid-gated shared expert.

Router: `softmax(x @ gate.weight.T)` in fp32 over all E experts, top-k, renormalised to sum 1.
Experts (fused, as transformers keeps them): `gate_up_proj [E, 2I, H]` (gate rows first) and
`down_proj [E, H, I]`; expert e computes `down_e(silu(gate_e x) * up_e x)`.
Output: `sum_i w_i expert_i(x) + sigmoid(shared_expert_gate(x)) * shared_expert(x)`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .linear import ReplicatedLinear
from .mlp import SwiGLUMLP
from .norm import compute_dtype


class TopKRouter(nn.Module):
    def __init__(self, hidden_size: int, num_experts: int, top_k: int, dtype: torch.dtype,
                 device: torch.device | str):
        super().__init__()
        self.top_k = top_k
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=dtype, device=device),
                                   requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, k] in x.dtype, expert ids [T, k] long)."""
        logits = F.linear(x, self.weight)
        probs = logits.softmax(dim=-1, dtype=compute_dtype(x.dtype))
        weights, ids = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids


class FusedExperts(nn.Module):
    """All experts' SwiGLU weights in two 3-D tensors (the EP layer will hold a slice of E)."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int,
                 dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.num_experts, self.intermediate_size = num_experts, intermediate_size
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size, dtype=dtype, device=device),
            requires_grad=False)
        self.down_proj = nn.Parameter(
            torch.empty(num_experts, hidden_size, intermediate_size, dtype=dtype, device=device),
            requires_grad=False)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, H], weights/ids [T, k] -> [T, H]."""
        out = torch.zeros_like(x)
        for expert in ids.unique().tolist():
            token_idx, slot = torch.where(ids == expert)
            gate, up = F.linear(x[token_idx], self.gate_up_proj[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[expert])
            out.index_add_(0, token_idx, y * weights[token_idx, slot, None])
        return out


class SparseMoeBlock(nn.Module):
    def __init__(self, hidden_size: int, num_experts: int, top_k: int, moe_intermediate_size: int,
                 shared_intermediate_size: int, dtype: torch.dtype, device: torch.device | str,
                 tp_group=None):
        super().__init__()
        self.gate = TopKRouter(hidden_size, num_experts, top_k, dtype, device)
        self.experts = FusedExperts(hidden_size, moe_intermediate_size, num_experts, dtype, device)
        self.shared_expert = SwiGLUMLP(hidden_size, shared_intermediate_size, dtype, device,
                                       tp_group=tp_group)
        self.shared_expert_gate = ReplicatedLinear(hidden_size, 1, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        routed = self.experts(x, weights, ids)
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return routed + shared
