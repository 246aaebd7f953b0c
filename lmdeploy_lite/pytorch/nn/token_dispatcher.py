"""Moving MoE tokens to the ranks that own their experts (expert parallelism).

Interface: `dispatch(x, topk_ids, topk_weights) -> (expert_x, routing, handle)` sends every
(token, chosen expert) pair to the expert's rank; the caller runs its local experts on `expert_x`
(`FusedExperts.run(expert_x, routing)`) and `combine(expert_out, handle) -> [T, H]` brings the
results home and sums them with the router weights. `routing` says how the rows are laid out:
  * local expert ids [R] (a tensor): expert_x [R, H], row r for expert routing[r]; -1 marks a
    padding row, whose output is ignored; expert_out [R, H].
  * `GroupedRows` (DeepEP low-latency, bf16): expert_x [E_local, C, H], expert e's rows are
    expert_x[e, :counts[e]] (the rest is garbage, never read); expert_out [E_local, C, H], rows
    past the counts undefined. The experts run as one masked grouped GEMM (`fused_moe_masked`)
    with cost following the counts, and write into `GroupedRows.out`, the buffer combine sends.

Two implementations, chosen by `make_dispatcher` (LMDEPLOY_LITE_EP_DISPATCHER=auto|alltoall|
deepep, default auto): `AllToAllDispatcher` below (torch.distributed, gloo or NCCL; anywhere)
and DeepEP (backends/cuda/token_dispatcher.py; CUDA with `deep_ep` importable). DeepEP runs in
normal mode (prefill) or low-latency mode (decode, CUDA graphs): `set_low_latency` switches
every DeepEP dispatcher of an EP group at once; each rank must call it with the same value before
the step's forwards. Low-latency calls hold at most `dispatch_capacity` tokens per rank.
"""
from __future__ import annotations

import importlib
import importlib.util
import logging
import os
from dataclasses import dataclass

import torch

logger = logging.getLogger('lmdeploy_lite')

ENV_DISPATCHER = 'LMDEPLOY_LITE_EP_DISPATCHER'
ENV_CAPACITY = 'DEEPEP_MAX_TOKENS_PER_RANK'
DISPATCHERS = ('auto', 'alltoall', 'deepep')


def dispatch_capacity(max_batch_size: int, num_speculative_tokens: int) -> int:
    """Tokens per rank a low-latency dispatch holds: DEEPEP_MAX_TOKENS_PER_RANK, default
    max_batch_size x (1 + num_speculative_tokens) (a decode step's most tokens)."""
    value = os.environ.get(ENV_CAPACITY)
    if value is None:
        return max_batch_size * (1 + num_speculative_tokens)
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f'{ENV_CAPACITY}={value!r}: must be an integer >= 1')
    return int(value)


def make_dispatcher(dist_ctx, num_experts: int, hidden_size: int, top_k: int,
                    max_tokens_per_rank: int | None, device: torch.device | str,
                    dtype: torch.dtype):
    """The EP dispatcher of one MoE layer: DeepEP on CUDA when `deep_ep` imports and can carry
    the layer's rows (bf16, float16 or float32), else AllToAllDispatcher. `max_tokens_per_rank`:
    `dispatch_capacity(...)` (None: unknown, no DeepEP). LMDEPLOY_LITE_EP_DISPATCHER=alltoall
    forces the fallback; =deepep raises instead of falling back."""
    choice = os.environ.get(ENV_DISPATCHER, 'auto')
    if choice not in DISPATCHERS:
        raise ValueError(f'{ENV_DISPATCHER}={choice!r}: must be one of {DISPATCHERS}')
    reason = None
    if choice == 'alltoall':
        reason = f'{ENV_DISPATCHER}=alltoall'
    elif torch.device(device).type != 'cuda':
        reason = f'the device is {device}'
    elif max_tokens_per_rank is None:
        reason = 'no per-rank token capacity was given (DistContext.max_tokens_per_rank)'
    elif importlib.util.find_spec('deep_ep') is None:
        reason = 'deep_ep is not installed'
    else:
        from ..backends.cuda.token_dispatcher import DeepEPDispatcher
        reason = DeepEPDispatcher.unsupported(hidden_size, top_k, dtype)
    if reason is None:
        try:                  # loads NVSHMEM: fails without its libraries
            importlib.import_module('deep_ep')
        except (ImportError, OSError) as e:
            reason = f'deep_ep does not import: {e}'
    if reason is None:
        return DeepEPDispatcher(dist_ctx, num_experts, hidden_size, top_k, dtype,
                                max_tokens_per_rank)
    if choice == 'deepep':
        raise ValueError(f'{ENV_DISPATCHER}=deepep, but DeepEP cannot be used: {reason}')
    if choice == 'auto' and torch.device(device).type == 'cuda':
        logger.info('EP dispatch by all-to-all: %s', reason)
    return AllToAllDispatcher(dist_ctx, num_experts)


def set_low_latency(dist_ctx, enabled: bool):
    """DeepEP mode of the EP group's dispatchers, target's and draft's: low-latency (True) or
    normal. Same value on every rank, once per step before its forwards (and True before
    capturing decode graphs). The first call allocates the shared buffer: make it once at
    start-up, after both models are built. No-op without DeepEP."""
    from ..backends.cuda.token_dispatcher import registered_buffer
    shared = registered_buffer(dist_ctx.group('ep'))
    if shared is not None:
        shared.set_low_latency(enabled, dist_ctx)


def uses_deep_ep(dist_ctx) -> bool:
    """The EP group's MoE layers dispatch through DeepEP (a shared buffer is registered)."""
    from ..backends.cuda.token_dispatcher import registered_buffer
    return registered_buffer(dist_ctx.group('ep')) is not None


@dataclass
class GroupedRows:
    """`routing` of rows grouped by local expert (see the module docstring). counts [E_local]
    int, on the device (never read on the host: capturable); out [E_local, C, W >= H] or None:
    where the experts should write their outputs (columns :H), so that combine sends it as is."""
    counts: torch.Tensor
    out: torch.Tensor | None = None


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
