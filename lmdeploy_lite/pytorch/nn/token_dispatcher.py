"""Moving MoE tokens to the ranks that own their experts (expert parallelism).

Interface: `dispatch(x, topk_ids, topk_weights) -> (expert_x, local_expert_ids, handle)` sends
every (token, chosen expert) pair to the expert's rank; the caller runs its local experts on
`expert_x`; `combine(expert_out, handle) -> [T, H]` brings the results home and sums them with
the router weights. A DeepEP implementation (normal / low-latency, fixed per-rank capacity from
the StepPlan) can replace AllToAllDispatcher without touching the model.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DispatchHandle:
    order: torch.Tensor              # [T*k] sort permutation of the (token, expert) pairs
    send_counts: list[int]
    recv_counts: list[int]
    topk_weights: torch.Tensor       # [T, k]


class AllToAllDispatcher:
    """torch.distributed all_to_all_single (gloo or NCCL): counts first, then the payload."""

    def __init__(self, dist_ctx, num_experts: int, group: str = 'ep'):
        self.dist = dist_ctx
        self.group = group
        self.ep_size = dist_ctx.config.ep
        self.experts_per_rank = num_experts // self.ep_size
        self.first_expert = dist_ctx.ep_rank * self.experts_per_rank

    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor):
        """x [T, H], topk_ids/weights [T, k] -> expert_x [R, H], local ids [R] (0-based on this
        rank), handle."""
        top_k = topk_ids.shape[1]
        flat_ids = topk_ids.reshape(-1)
        dest = flat_ids // self.experts_per_rank
        order = torch.argsort(dest, stable=True)
        send_counts = torch.bincount(dest, minlength=self.ep_size)
        recv_counts = self.dist.all_to_all(send_counts, [1] * self.ep_size, [1] * self.ep_size,
                                           self.group)
        send, recv = send_counts.tolist(), recv_counts.tolist()
        rows = x.repeat_interleave(top_k, dim=0)[order]
        expert_x = self.dist.all_to_all(rows, send, recv, self.group)
        expert_ids = self.dist.all_to_all(flat_ids[order], send, recv, self.group)
        return expert_x, expert_ids - self.first_expert, DispatchHandle(order, send, recv,
                                                                        topk_weights)

    def combine(self, expert_out: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """expert_out [R, H] -> [T, H] = sum over each token's k experts of weight * output."""
        back = self.dist.all_to_all(expert_out, handle.recv_counts, handle.send_counts,
                                    self.group)
        pairs = torch.empty_like(back)
        pairs[handle.order] = back
        num_tokens, top_k = handle.topk_weights.shape
        pairs = pairs.view(num_tokens, top_k, back.shape[-1]) * handle.topk_weights[..., None]
        return pairs.sum(1)
