"""Qwen3.5 sparse MoE block: router, fused experts, sigmoid-gated shared expert.

Router: `softmax(x @ gate.weight.T)` in fp32 over all E experts, top-k, renormalised to sum 1.
Experts (fused, as transformers keeps them): `gate_up_proj [E, 2I, H]` (gate rows first) and
`down_proj [E, H, I]`; expert e computes `down_e(silu(gate_e x) * up_e x)`.
Output: `sum_i w_i expert_i(x) + sigmoid(shared_expert_gate(x)) * shared_expert(x)`.

Parallel layouts. The router and shared_expert_gate are replicated; the shared expert is
TP-sharded (column gate/up, row down). Routed experts: with ep == 1 and tp > 1 every expert's
intermediate dim is split over TP like a SwiGLU MLP; with ep > 1 (== world) whole experts are
sharded over EP and, under tp > 1, each TP rank dispatches only its 1/tp of the (identical)
tokens. Either way every TP rank ends with a partial sum of routed + shared, and the block
all-reduces that sum exactly once over TP. Sequence-parallel (nn/sequence_parallel.py): x is the
gathered [Tp, H] (Tp = `sizes.tokens`), the one reduction is a reduce-scatter to this rank's
[Tp / tp, H], and with EP the rows TP rank r dispatches are exactly its own token shard.
Every size of an EP forward comes from `ModelInputs.sizes`, never from module state.

FP8 experts (`FusedExperts.to_fp8`, after loading and sharding, where the device backend computes
them: models/fp8.py): float8_e4m3fn weights with float32 scales per 128 x 128 block of this rank's
shard, passed to the backend's ops beside the weights (weight-only FP8: the kernels dequantize).
"""
from __future__ import annotations

import contextlib
import contextvars

import torch
import torch.nn.functional as F
from torch import nn

from ..backends import get_backend
from ..backends.default.norm import compute_dtype
from ..model_inputs import ForwardSizes
from .linear import FusedColumnLinear, ReplicatedLinear, check_divisible
from .mlp import SwiGLUMLP
from .sequence_parallel import is_sequence_parallel
from .sharding import sharded_parameter, tp_layout
from .token_dispatcher import GroupedRows, TopKRows


class TopKRouter(nn.Module):
    def __init__(self, hidden_size: int, num_experts: int, top_k: int, dtype: torch.dtype,
                 device: torch.device | str):
        super().__init__()
        self.top_k = top_k
        weight = torch.empty(num_experts, hidden_size, dtype=dtype, device=device)
        self.weight = nn.Parameter(weight, requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, k] in x.dtype, expert ids [T, k] long)."""
        return self.route(F.linear(x, self.weight))

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Router logits [T, E] (x @ weight.T, in x.dtype) -> (weights, ids) as `forward`."""
        probs = logits.softmax(dim=-1, dtype=compute_dtype(logits.dtype))
        weights, ids = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(logits.dtype), ids


_EXPERTS_ON_META = contextvars.ContextVar('experts_on_meta', default=False)


@contextlib.contextmanager
def experts_on_meta(on: bool = True):
    """FusedExperts built inside hold their weights on the meta device until `materialize()`:
    the loader fills and converts one layer's experts at a time (models/loader.py), so an FP8
    model never holds every layer's experts in the compute dtype at once."""
    token = _EXPERTS_ON_META.set(on)
    try:
        yield
    finally:
        _EXPERTS_ON_META.reset(token)


class FusedExperts(nn.Module):
    """Experts `first_expert .. first_expert + num_local - 1` (all of them without EP) as two
    3-D tensors; the loader reads that slice of the checkpoint's experts (`expert_range`).
    With a `dist_ctx` of tp > 1 each expert keeps I / tp of its intermediate dim (gate_up's gate
    and up halves split separately, down_proj by columns) and `forward` returns partial sums."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int,
                 dtype: torch.dtype, device: torch.device | str, first_expert: int = 0,
                 num_local: int | None = None, dist_ctx=None):
        super().__init__()
        num_local = num_experts if num_local is None else num_local
        check_divisible('moe_intermediate_size', (intermediate_size,), tp_layout(dist_ctx)[0])
        self.backend, self.device = get_backend(device), torch.device(device)
        inter, at = intermediate_size, 'meta' if _EXPERTS_ON_META.get() else device
        self.gate_up_proj = sharded_parameter((num_local, 2 * inter, hidden_size), 1, dist_ctx,
                                              dtype, at, sections=(inter, inter))
        self.down_proj = sharded_parameter((num_local, hidden_size, inter), 2, dist_ctx, dtype, at)
        for param in (self.gate_up_proj, self.down_proj):
            param.expert_range = (first_expert, num_local, num_experts)
        self.gate_up_scale = self.down_scale = None     # FP8 (`to_fp8`): float32 block scales

    def materialize(self) -> None:
        """Weights built on the meta device (`experts_on_meta`) allocated on the module's
        device, uninitialised (to be filled), keeping their loading attributes."""
        for name in ('gate_up_proj', 'down_proj'):
            meta = getattr(self, name)
            if meta.is_meta:
                param = nn.Parameter(torch.empty(meta.shape, dtype=meta.dtype, device=self.device),
                                     requires_grad=False)
                param.__dict__.update(meta.__dict__)            # expert_range, shard
                setattr(self, name, param)

    def to_fp8(self, quantize, chunk: int = 16) -> None:
        """`quantize(weight) -> (fp8 weight, block scales)` on this rank's shard: gate_up_scale
        [E, 2 * ceil(I / 128), ceil(H / 128)], gate and up quantized apart (no block straddles
        them; with I % 128 == 0, every released shape, the checkpoint's layout), down_scale
        [E, ceil(H / 128), ceil(I / 128)]. `chunk` experts at a time bound quantize's float32
        temporaries."""
        inter = self.down_proj.shape[2]
        for name, rows in (('gate_up_proj', inter), ('down_proj', self.down_proj.shape[1])):
            weights, scales = [], []
            for experts in getattr(self, name).data.split(chunk):
                parts = [quantize(part) for part in experts.split(rows, 1)]
                weights.append(torch.cat([q for q, _ in parts], 1))
                scales.append(torch.cat([scale for _, scale in parts], 1))
            setattr(self, name, nn.Parameter(torch.cat(weights), requires_grad=False))
            setattr(self, name.replace('proj', 'scale'),
                    nn.Parameter(torch.cat(scales), requires_grad=False))

    def _fp8(self) -> dict:
        return ({} if self.gate_up_scale is None else
                dict(gate_up_scale=self.gate_up_scale, down_scale=self.down_scale))

    def run(self, x: torch.Tensor, routing: torch.Tensor | GroupedRows | TopKRows) -> torch.Tensor:
        """Outputs of the rows a dispatcher hands over: x [R, H] with local expert ids
        `routing [R]` (-1: none, gives 0) -> [R, H] unweighted; x [E_local, C, H] grouped by
        expert (`GroupedRows`) -> [E_local, C, H] unweighted (in `routing.out` when given; rows
        past the counts undefined); x [N, H] with top-k ids and weights (`TopKRows`) -> [N, H],
        each row's weighted sum over its local experts."""
        if isinstance(routing, GroupedRows):
            return self.backend.fused_moe_masked(x, routing.counts, self.gate_up_proj,
                                                 self.down_proj, out=routing.out, **self._fp8())
        if isinstance(routing, TopKRows):
            return self.backend.fused_moe(x, self.gate_up_proj, self.down_proj, routing.weights,
                                          routing.ids, **self._fp8())
        ones = torch.ones(x.shape[0], 1, dtype=x.dtype, device=x.device)
        return self.backend.fused_moe(x, self.gate_up_proj, self.down_proj, ones, routing[:, None],
                                      **self._fp8())

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, H], weights/ids [T, k] -> [T, H], summed over k in the same order as EP's
        combine so that every layout gives the same numbers."""
        return self.backend.fused_moe(x, self.gate_up_proj, self.down_proj, weights, ids,
                                      **self._fp8())


class SparseMoeBlock(nn.Module):
    def __init__(self, hidden_size: int, num_experts: int, top_k: int, moe_intermediate_size: int,
                 shared_intermediate_size: int, dtype: torch.dtype, device: torch.device | str,
                 dist_ctx=None, dispatcher=None):
        super().__init__()
        self.dist_ctx = dist_ctx
        self.tp, self.tp_rank = tp_layout(dist_ctx)
        self.sequence_parallel = self.tp > 1 and is_sequence_parallel(dist_ctx)
        self.gate = TopKRouter(hidden_size, num_experts, top_k, dtype, device)
        self.dispatcher = dispatcher            # None: all experts local (no EP)
        first, local = ((dispatcher.first_expert, dispatcher.experts_per_rank) if dispatcher
                        else (0, num_experts))
        self.experts = FusedExperts(hidden_size, moe_intermediate_size, num_experts, dtype, device,
                                    first, local, dist_ctx=None if dispatcher else dist_ctx)
        self.shared_expert = SwiGLUMLP(hidden_size, shared_intermediate_size, dtype, device,
                                       dist_ctx=dist_ctx, reduce_output=False)
        self.shared_expert_gate = ReplicatedLinear(hidden_size, 1, dtype, device)
        self.in_proj = None     # router, shared gate and shared gate/up as one GEMM (CPU)

    def fuse_projections(self, keep_parts: bool = False):
        """With `keep_parts`: the router, the shared expert's gate and its gate/up read x in one
        GEMM. Otherwise only the shared expert fuses its gate/up (its own `fuse_projections`)."""
        if not keep_parts or self.in_proj is not None:
            return
        mlp = self.shared_expert
        if mlp.gate_up_proj is not None:
            return
        self.in_proj = FusedColumnLinear([self.gate, self.shared_expert_gate, mlp.gate_proj,
                                          mlp.up_proj], keep_parts=True, outputs=[1, 1, 2])
        mlp.fused_by_parent = True

    def forward(self, x: torch.Tensor, sizes: ForwardSizes | None = None) -> torch.Tensor:
        """x [T, H] -> [T, H] (sequence-parallel: [Tp, H] -> [Tp / tp, H]); `sizes`: the
        step's (ModelInputs.sizes), required with EP, says whether this forward splits its rows."""
        if self.in_proj is not None:
            logits, shared_gate, shared_gate_up = self.in_proj(x)
            weights, ids = self.gate.route(logits)
            shared = self.shared_expert.forward_fused(shared_gate_up)
        else:
            weights, ids = self.gate(x)
            shared_gate, shared = self.shared_expert_gate(x), self.shared_expert(x)
        if self.dispatcher is None:
            routed = self.experts(x, weights, ids)
        else:
            routed = self._routed_by_ep(x, weights, ids, sizes)
        out = routed + torch.sigmoid(shared_gate) * shared
        # the one reduction (routed and shared partial sums together), to this rank's token
        # shard when the rows are split
        if self.sequence_parallel and sizes is not None and sizes.sequence_parallel:
            return self.dist_ctx.tp.reduce_scatter(out)
        return self.dist_ctx.tp.all_reduce(out) if self.tp > 1 else out

    def _routed_by_ep(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                      sizes: ForwardSizes | None) -> torch.Tensor:
        """EP: tokens travel to their experts' ranks and back (collectives inside). The TP ranks
        of a DP group hold the same tokens; padded to the plan's `sizes.tokens` rows (padding
        routes to expert -1, weight 0), TP rank r sends rows [r * share, (r + 1) * share),
        share = tokens / tp, with capacity `sizes.max_tokens / tp` and DeepEP mode
        `sizes.low_latency`; the other rows stay 0 until the TP all-reduce."""
        if sizes is None:
            raise ValueError('an EP forward needs ModelInputs.sizes (the StepPlan\'s '
                             'ForwardSizes, engine/step_plan.py), got None')
        num_rows = x.shape[0]
        pad = sizes.tokens - num_rows
        if pad < 0 or sizes.tokens % self.tp:
            raise ValueError(f'ForwardSizes.tokens={sizes.tokens}: must be a multiple of tp='
                             f'{self.tp} and >= this forward\'s {num_rows} tokens')
        if pad:
            x, weights = F.pad(x, (0, 0, 0, pad)), F.pad(weights, (0, 0, 0, pad))
            ids = F.pad(ids, (0, 0, 0, pad), value=-1)
        share = sizes.tokens // self.tp
        mine = slice(self.tp_rank * share, (self.tp_rank + 1) * share)
        expert_x, routing, handle = self.dispatcher.dispatch(
            x[mine], ids[mine], weights[mine], sizes.max_tokens // self.tp, sizes.low_latency)
        out = self.dispatcher.combine(self.experts.run(expert_x, routing), handle)
        if self.tp == 1:
            return out[:num_rows]
        routed = x.new_zeros(sizes.tokens, x.shape[1])
        routed[mine] = out
        return routed[:num_rows]
