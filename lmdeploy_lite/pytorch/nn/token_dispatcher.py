"""Moving MoE tokens to the ranks that own their experts (expert parallelism).

Interface: `dispatch(x, topk_ids, topk_weights, capacity, low_latency) -> (expert_x, routing,
handle)` sends every (token, chosen expert) pair to the expert's rank (ids -1: a padding token,
sent nowhere); the caller runs its local experts on `expert_x` (`FusedExperts.run(expert_x,
routing)`, which says what each `routing` type means) and `combine(expert_out, handle) -> [T, H]`
brings the results home and sums them with the router weights.

Models build every EP layer with `AllToAllDispatcher` (torch.distributed, anywhere); at start-up
`EPTransport` may give them DeepEP dispatchers instead (backends/cuda/token_dispatcher.py).
Every size comes from the StepPlan (DESIGN.md invariant 1; nothing inside a forward reads a device
value on the host to size anything): `capacity`, the most tokens any rank of the EP group
dispatches in this call, is `ForwardSizes.max_tokens / tp` (model_inputs.py), the same on every
rank; DeepEP's mode is `ForwardSizes.low_latency`, passed to each call (nothing holds a mode);
its low-latency capacity is a start-up value (`dispatch_capacity`), as the CUDA graphs that hold
its kernels need.
"""
from __future__ import annotations

import importlib
import importlib.util
import logging
import os
from dataclasses import dataclass

import torch

from ..backends.cuda import token_dispatcher as deep_ep_dispatcher
from ..backends.default.moe import GroupedRows, TopKRows

logger = logging.getLogger('lmdeploy_lite')

__all__ = ['AllToAllDispatcher', 'EPTransport', 'GroupedRows', 'TopKRows', 'dispatch_capacity']

ENV_DISPATCHER = 'LMDEPLOY_LITE_EP_DISPATCHER'
ENV_CAPACITY = 'DEEPEP_MAX_TOKENS_PER_RANK'
DISPATCHERS = ('auto', 'alltoall', 'deepep')


def dispatch_capacity(max_batch_size: int, num_speculative_tokens: int, tp: int = 1) -> int:
    """Tokens per rank a low-latency dispatch holds: DEEPEP_MAX_TOKENS_PER_RANK, default
    max_batch_size x (1 + num_speculative_tokens) (a decode step's most tokens) rounded up to a
    multiple of tp, as the StepPlan rounds a rank's token count: a draft with tp=1 under a TP
    target dispatches the whole rounded count on every rank."""
    value = os.environ.get(ENV_CAPACITY)
    if value is None:
        return -(-max_batch_size * (1 + num_speculative_tokens) // tp) * tp
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f'{ENV_CAPACITY}={value!r}: must be an integer >= 1')
    return int(value)


class EPTransport:
    """How the MoE layers on one EP group move tokens: all-to-all, or DeepEP over one buffer
    that this transport owns, sized from `capacity` (`dispatch_capacity(...)`). `num_experts`,
    `hidden_size`, `top_k`, `dtype`: the MoE layers' (target and MTP draft alike).
    LMDEPLOY_LITE_EP_DISPATCHER=auto (default) | alltoall (forces all-to-all) | deepep (raises
    instead of falling back)."""

    def __init__(self, dist_ctx, num_experts: int, hidden_size: int, top_k: int, capacity: int,
                 device: torch.device | str, dtype: torch.dtype):
        self.dist, self.dtype = dist_ctx, dtype
        self.num_experts, self.hidden_size, self.top_k = num_experts, hidden_size, top_k
        self.shared = None
        if dist_ctx.config.ep == 1 or not num_experts:      # no MoE token moves between ranks
            return
        reason = self._why_not_deep_ep(device)
        if reason is not None and os.environ.get(ENV_DISPATCHER) == 'deepep':
            raise ValueError(f'{ENV_DISPATCHER}=deepep, but DeepEP cannot be used: {reason}')
        if reason is not None and torch.device(device).type == 'cuda':
            logger.info('EP dispatch by all-to-all: %s', reason)
        self.shared = (None if reason is not None else
                       deep_ep_dispatcher.SharedBuffer(dist_ctx.ep.gloo, num_experts, capacity))

    @property
    def deep_ep(self) -> bool:
        return self.shared is not None

    def _why_not_deep_ep(self, device) -> str | None:
        choice = os.environ.get(ENV_DISPATCHER, 'auto')
        if choice not in DISPATCHERS:
            raise ValueError(f'{ENV_DISPATCHER}={choice!r}: must be one of {DISPATCHERS}')
        if choice == 'alltoall':
            return f'{ENV_DISPATCHER}=alltoall'
        if torch.device(device).type != 'cuda':
            return f'the device is {device}'
        if importlib.util.find_spec('deep_ep') is None:
            return 'deep_ep is not installed'
        reason = deep_ep_dispatcher.DeepEPDispatcher.unsupported(self.hidden_size, self.top_k,
                                                                  self.dtype)
        if reason is None:
            try:              # loads NVSHMEM: fails without its libraries
                importlib.import_module('deep_ep')
            except (ImportError, OSError) as e:
                reason = f'deep_ep does not import: {e}'
        return reason

    def attach(self, module) -> None:
        """DeepEP: every layer of `module` that dispatches all-to-all on this EP group gets a
        DeepEP dispatcher over the shared buffer, which is then allocated (at start-up, before
        the KV cache is planned, so that the plan sees its memory). No-op without DeepEP."""
        if self.shared is None:
            return
        for layer in module.modules():
            old = getattr(layer, 'dispatcher', None)
            if isinstance(old, AllToAllDispatcher) and old.group is self.dist.ep:
                layer.dispatcher = deep_ep_dispatcher.DeepEPDispatcher(
                    old.dist, self.num_experts, self.hidden_size, self.top_k, self.dtype,
                    self.shared)
        self.shared.get()

    def prepare(self, sizes) -> None:
        """Before a step's forwards, on every rank (CUDA-graph replays run no Python dispatch):
        DeepEP checks the plan's `sizes` (ModelInputs.sizes) against its low-latency capacity,
        raising on every rank alike, and cleans its low-latency region if this step runs
        low-latency after normal kernels dirtied it (a collective). No-op without DeepEP."""
        if self.shared is not None and sizes.low_latency:
            self.shared.check_capacity(-(-sizes.max_tokens // self.dist.config.tp), self.dist)
            self.shared.clean_low_latency(self.dist)


@dataclass
class DispatchHandle:
    order: torch.Tensor              # [T*k] the (token, expert) pairs sorted by destination rank
    slot: torch.Tensor               # [T*k] row of each sorted pair in the send buffer
    topk_weights: torch.Tensor       # [T, k]


class AllToAllDispatcher:
    """torch.distributed all_to_all_single (gloo or NCCL) of fixed, equal blocks (`block_rows`,
    unused rows with expert id -1): no counts exchanged or read on the host."""

    def __init__(self, dist_ctx, num_experts: int):
        self.dist, self.group = dist_ctx, dist_ctx.ep
        self.ep_size = dist_ctx.config.ep
        self.experts_per_rank = num_experts // self.ep_size
        self.first_expert = dist_ctx.ep_rank * self.experts_per_rank

    def block_rows(self, capacity: int, top_k: int) -> int:
        """Rows one rank sends to (and receives from) each rank in a call of `capacity` tokens
        per rank: a token's k experts are distinct, so at most min(k, experts_per_rank) of its
        pairs share a destination."""
        return capacity * min(top_k, self.experts_per_rank)

    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 capacity: int, low_latency: bool = False):
        """x [T, H], topk_ids/weights [T, k] (ids -1: padding, sent nowhere), T <= capacity (the
        plan's, equal on every rank) -> expert_x [ep * block, H], local ids [ep * block] (0-based
        on this rank, -1: an unused row), handle. `low_latency` is DeepEP's; ignored here."""
        num_tokens, top_k = topk_ids.shape
        if num_tokens > capacity:
            raise ValueError(f'EP dispatch: {num_tokens} tokens on rank {self.dist.rank} at step '
                             f'{self.dist.step}, but the plan\'s capacity is {capacity} per rank')
        block = self.block_rows(capacity, top_k)
        flat_ids = topk_ids.reshape(-1)
        dest = torch.where(flat_ids >= 0, flat_ids // self.experts_per_rank, self.ep_size)
        order = torch.argsort(dest, stable=True)
        slot = self._send_slots(dest[order], block)
        rows = x.new_zeros((self.ep_size * block + 1, x.shape[1]))    # + 1: where -1 pairs go
        rows[slot] = x.repeat_interleave(top_k, dim=0)[order]
        ids = flat_ids.new_full((self.ep_size * block + 1,), -1)
        ids[slot] = flat_ids[order]
        splits = [block] * self.ep_size
        expert_x = self.group.all_to_all(rows[:-1], splits, splits)
        expert_ids = self.group.all_to_all(ids[:-1], splits, splits)
        local_ids = torch.where(expert_ids >= 0, expert_ids - self.first_expert, -1)
        return expert_x, local_ids, DispatchHandle(order, slot, topk_weights)

    def _send_slots(self, sorted_dest: torch.Tensor, block: int) -> torch.Tensor:
        """sorted_dest [P] (destination rank of each pair, ascending; ep_size: none) -> the
        pair's row in the send buffer: its rank's block, in order; the last row for none."""
        counts = torch.bincount(sorted_dest, minlength=self.ep_size + 1)
        first = torch.cumsum(counts, 0) - counts
        index = torch.arange(sorted_dest.numel(), device=sorted_dest.device)
        slot = sorted_dest * block + index - first[sorted_dest]
        return torch.where(sorted_dest < self.ep_size, slot, self.ep_size * block)

    def combine(self, expert_out: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """expert_out [ep * block, H] -> [T, H] = sum over each token's k experts of weight *
        output (in top-k order; a padding pair adds weight * 0)."""
        splits = [expert_out.shape[0] // self.ep_size] * self.ep_size
        back = self.group.all_to_all(expert_out, splits, splits)
        back = torch.cat([back, back.new_zeros(1, back.shape[1])])      # the row of -1 pairs
        pairs = torch.empty((handle.slot.numel(), back.shape[1]), dtype=back.dtype,
                            device=back.device)
        pairs[handle.order] = back[handle.slot]
        num_tokens, top_k = handle.topk_weights.shape
        pairs = pairs.view(num_tokens, top_k, back.shape[-1]) * handle.topk_weights[..., None]
        return pairs.sum(1)
