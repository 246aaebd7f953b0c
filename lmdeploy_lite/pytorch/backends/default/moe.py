"""Routed experts of a MoE layer in plain PyTorch (`fused_moe`: token rows with top-k ids;
`fused_moe_masked`: rows already grouped by expert). Weight layout: nn/moe.py; FP8 experts (with
`gate_up_scale` / `down_scale`) are dequantized to x's dtype first (`dequantize_blocks`), the
numbers a device's FP8 expert kernels are checked against.

`fused_moe` on a few tokens (T * k pairs up to SMALL_BATCH_PAIRS) groups the pairs by expert on
the host and runs only the touched experts. From GROUPED_MIN_PAIRS pairs (the embedded model's
4-token verify: 8 pairs, 5-8 of its 8 experts) each expert's two GEMMs write into slices of
shared buffers and one silu_mul serves them all (`_experts_grouped`: 2 ops a touched expert, not
~6; the very bits of one expert at a time). One core, 4 tokens, float32: 289 us against 354 with
one layer's weights hot in cache, 473 against 532 cycling 9 layers' weights (27 MB, as the model
does); 8 tokens 631 against 794. Below that (decode: 1 token, 2 experts) one expert at a time is
as fast. Running ALL experts on all tokens in two batched GEMMs (no host grouping) was measured
and dropped: faster with hot weights (313 against 381 us at 4 tokens) but slower as the model
runs (740-890 against 500-580 us): it reads every expert's weights, and the step is bound by
reading weights, not by op count. Many tokens group rows by expert on the device.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .norm import cast, silu_mul

BLOCK = 128                 # FP8 weights: one float32 scale per BLOCK x BLOCK block


@dataclass
class GroupedRows:
    """`fused_moe_masked`'s rows grouped by expert (an EP dispatcher's `routing`): counts [E_local]
    int on the device (never read on the host: capturable); out [E_local, C, W >= H] or None: where
    the experts write their outputs (columns :H), for the dispatcher's combine to send as is."""
    counts: torch.Tensor
    out: torch.Tensor | None = None


@dataclass
class TopKRows:
    """`fused_moe`'s rows with their top-k routing (DeepEP normal mode with fixed shapes): ids
    [N, k] local expert ids (-1: an expert elsewhere, or a padding row), weights [N, k]; the
    experts return each row's weighted sum over its local experts [N, H]."""
    ids: torch.Tensor
    weights: torch.Tensor


def dequantize_blocks(weight: torch.Tensor, scale: torch.Tensor, dtype=torch.float32,
                      sections: int = 1) -> torch.Tensor:
    """float8 [..., N, K] x float32 scales per 128 x 128 block of each of `sections` equal row
    sections, quantized apart ([..., sections * ceil(N / sections / 128), ceil(K / 128)]) ->
    `dtype` (the product in float32, then rounded)."""
    pieces = []
    for w, s in zip(weight.chunk(sections, -2), scale.chunk(sections, -2)):
        full = s.float().repeat_interleave(BLOCK, -2).repeat_interleave(BLOCK, -1)
        pieces.append(w.float() * full[..., :w.shape[-2], :w.shape[-1]])
    return (pieces[0] if sections == 1 else torch.cat(pieces, -2)).to(dtype)


def _dequantized(x, gate_up_proj, down_proj, gate_up_scale, down_scale):
    """The experts in x's dtype: as given, or FP8 ones dequantized (gate and up apart)."""
    if gate_up_scale is None:
        return gate_up_proj, down_proj
    return (dequantize_blocks(gate_up_proj, gate_up_scale, x.dtype, sections=2),
            dequantize_blocks(down_proj, down_scale, x.dtype))


def fused_moe(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              gate_up_scale: torch.Tensor | None = None,
              down_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, H]; topk_weights [T, k] (x.dtype or fp32); topk_ids [T, k] in 0..E-1, or -1 for
    "no expert" (contributes 0) -> out [T, H] in x.dtype, `out[t] = sum_j w[t, j] * expert(x[t])`,
    summed over j in order (EP's combine sums the same way, so every layout gives the same numbers).
    Reads device values on the host: not for captured decode steps."""
    gate_up_proj, down_proj = _dequantized(x, gate_up_proj, down_proj, gate_up_scale, down_scale)
    num_tokens, top_k = topk_ids.shape
    if GROUPED_MIN_PAIRS <= num_tokens * top_k <= SMALL_BATCH_PAIRS:
        pairs = _experts_grouped(x, gate_up_proj, down_proj, topk_ids)
    elif 0 < num_tokens * top_k <= SMALL_BATCH_PAIRS:
        pairs = _experts_by_pair_list(x, gate_up_proj, down_proj, topk_ids)
    else:
        pairs = torch.zeros(num_tokens * top_k, x.shape[-1], dtype=x.dtype, device=x.device)
        flat_ids = topk_ids.reshape(-1)
        rows_x = x.repeat_interleave(top_k, dim=0)
        for expert in flat_ids[flat_ids >= 0].unique().tolist():
            rows = torch.where(flat_ids == expert)[0]
            gate_up = F.linear(rows_x[rows], gate_up_proj[expert])
            pairs[rows] = F.linear(silu_mul(gate_up), down_proj[expert])
    out = (pairs.view(num_tokens, top_k, x.shape[-1]) * topk_weights[..., None]).sum(1)
    return cast(out, x.dtype)


SMALL_BATCH_PAIRS = 64     # up to this many (token, expert) pairs: group them on the host
GROUPED_MIN_PAIRS = 6      # from this many pairs: the touched experts' GEMMs into one buffer


def _experts_grouped(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                     topk_ids: torch.Tensor) -> torch.Tensor:
    """`_experts_by_pair_list`'s pairs [T * k, H] (zeros for id -1), the same bits, in fewer
    ops: the pairs sorted by expert on the host, each expert's rows one GEMM into a slice of one
    gate_up buffer, ONE silu_mul over all of them, the down GEMMs likewise, then the pairs put
    back in order: 2 ops a touched expert instead of ~6, ~6 fixed."""
    top_k, ids = topk_ids.shape[1], topk_ids.reshape(-1).tolist()
    order = sorted((expert, pair) for pair, expert in enumerate(ids) if expert >= 0)
    spans = _spans([expert for expert, _ in order])
    tokens = [pair // top_k for _, pair in order]
    if all(stop - start == 1 for _, start, stop in spans):     # one row an expert: slice x
        rows = [x.narrow(0, tokens[start], 1) for _, start, _ in spans]
    else:
        gathered = x.index_select(0, torch.tensor(tokens, dtype=torch.long, device=x.device))
        rows = [gathered[start:stop] for _, start, stop in spans]
    gate_up = x.new_empty(len(order), gate_up_proj.shape[1])
    for (expert, start, stop), rows_x in zip(spans, rows):
        torch.mm(rows_x, gate_up_proj[expert].t(), out=gate_up[start:stop])
    act = silu_mul(gate_up)
    out = x.new_empty(len(order), down_proj.shape[1])
    for expert, start, stop in spans:
        torch.mm(act[start:stop], down_proj[expert].t(), out=out[start:stop])
    sorted_pairs = [pair for _, pair in order]
    if len(order) < len(ids):
        index = torch.tensor(sorted_pairs, dtype=torch.long, device=x.device)
        return x.new_zeros(len(ids), x.shape[-1]).index_copy_(0, index, out)
    if sorted_pairs == list(range(len(ids))):
        return out
    position = [0] * len(ids)
    for i, pair in enumerate(sorted_pairs):
        position[pair] = i
    return out.index_select(0, torch.tensor(position, dtype=torch.long, device=x.device))


def _spans(experts: list[int]) -> list[tuple[int, int, int]]:
    """Sorted expert ids -> (expert, start, stop) of each run of equal ids."""
    spans, start = [], 0
    for expert, run in itertools.groupby(experts):
        stop = start + len(list(run))
        spans.append((expert, start, stop))
        start = stop
    return spans


def _experts_by_pair_list(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                          topk_ids: torch.Tensor) -> torch.Tensor:
    """`fused_moe`'s expert outputs for a few pairs (decode): the ids read once and grouped by
    expert in Python, a lone row sliced rather than gathered -> pairs [T * k, H], row i =
    expert(x[i // k]) (zeros for id -1)."""
    top_k, ids = topk_ids.shape[1], topk_ids.reshape(-1).tolist()
    by_expert: dict[int, list[int]] = {}
    for pair, expert in enumerate(ids):
        if expert >= 0:
            by_expert.setdefault(expert, []).append(pair)
    rows: list[torch.Tensor | None] = [None] * len(ids)
    for expert in sorted(by_expert):
        pairs = by_expert[expert]
        if len(pairs) == 1:
            rows_x = x.narrow(0, pairs[0] // top_k, 1)
        else:
            rows_x = x.index_select(0, torch.tensor([p // top_k for p in pairs], device=x.device))
        out = F.linear(silu_mul(F.linear(rows_x, gate_up_proj[expert])), down_proj[expert])
        for i, pair in enumerate(pairs):
            rows[pair] = out[i:i + 1]
    if any(row is None for row in rows):        # (not `None in rows`: that compares tensors)
        zero = x.new_zeros(1, x.shape[-1])
        rows = [zero if row is None else row for row in rows]
    return torch.cat(rows)


def fused_moe_masked(x: torch.Tensor, counts: torch.Tensor, gate_up_proj: torch.Tensor,
                     down_proj: torch.Tensor, out: torch.Tensor | None = None,
                     gate_up_scale: torch.Tensor | None = None,
                     down_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Experts on rows grouped by expert (DeepEP's low-latency layout): x [E, C, H], counts [E]
    int: expert e's rows are x[e, :counts[e]]; out: optional [E, C, >= H] in x.dtype to write
    into -> [E, C, H] in x.dtype (`out[..., :H]` when given), `expert_e(x[e, c])` for
    c < counts[e]. Rows past a count are undefined for callers (here: computed from zeros, so
    whatever they held is never read). Reads no device value on the host: capturable, at the
    cost of computing all E * C rows."""
    gate_up_proj, down_proj = _dequantized(x, gate_up_proj, down_proj, gate_up_scale, down_scale)
    num_experts, capacity, hidden = x.shape
    out = torch.empty_like(x) if out is None else out
    valid = torch.arange(capacity, device=x.device)[None, :] < counts[:, None]     # [E, C]
    for expert in range(num_experts):
        rows = torch.where(valid[expert, :, None], x[expert], 0)
        gate_up = F.linear(rows, gate_up_proj[expert])
        out[expert, :, :hidden] = F.linear(silu_mul(gate_up), down_proj[expert])
    return out[..., :hidden]
