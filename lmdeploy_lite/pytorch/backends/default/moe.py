"""Routed experts of a MoE layer in plain PyTorch (`fused_moe`: token rows with top-k ids;
`fused_moe_masked`: rows already grouped by expert). Weight layout: nn/moe.py; FP8 experts (with
`gate_up_scale` / `down_scale`) are dequantized to x's dtype first (`dequantize_blocks`), the
numbers a device's FP8 expert kernels are checked against.

`fused_moe` picks one of three ways by size. A few tokens whose pairs could reach every expert
(T * k >= E, T * E <= ALL_EXPERTS_ROWS: the embedded model's 4-token verify, its short prefills)
run ALL experts on ALL tokens in two batched GEMMs and pick each pair's row with one gather: ~10
ops whatever the routing, in place of ~5 per touched expert (one core, float32: 4 tokens x 8
experts 313 us against 381, 8 tokens 392 against 627; float64 is slower at 4-6 tokens, 579 against
429, and takes the path anyway so that the exactness tests run it). Fewer pairs (decode: 1 token
touches 2 of 8 experts) run the touched experts one at a time, grouped on the host (all 8 would
cost ~195 us against ~90-120); many tokens group rows by expert on the device. Real models (E =
256, 512) never run all experts.
"""
from __future__ import annotations

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
    if runs_all_experts(num_tokens, top_k, gate_up_proj.shape[0]):
        pairs = _all_experts(x, gate_up_proj, down_proj, topk_ids)
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
ALL_EXPERTS_ROWS = 256     # up to this many token x expert rows: run every expert on every token


def runs_all_experts(num_tokens: int, top_k: int, num_experts: int) -> bool:
    """Whether `fused_moe` runs every expert on every token: when the pairs could reach every
    expert (T * k >= E; fewer: the touched ones one at a time are cheaper) and the rows stay
    few (T * E <= ALL_EXPERTS_ROWS: larger, the E / k times the FLOPs outweigh the ops saved)."""
    return num_experts <= num_tokens * top_k and num_tokens * num_experts <= ALL_EXPERTS_ROWS


def _all_experts(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                 topk_ids: torch.Tensor) -> torch.Tensor:
    """`fused_moe`'s expert outputs with every expert run on every token (at these sizes the
    extra rows cost less than the per-expert ops they replace) -> pairs [T * k, H], row i =
    expert(x[i // k]) (zeros for id -1, whatever expert 0 gives that row). Reads no device
    value on the host."""
    gate_up = torch.matmul(x, gate_up_proj.transpose(1, 2))                 # [E, T, 2I]
    out = torch.bmm(silu_mul(gate_up), down_proj.transpose(1, 2))           # [E, T, H]
    tokens = torch.arange(x.shape[0], device=x.device)[:, None]
    pairs = out[topk_ids.clamp(min=0), tokens]                              # [T, k, H]
    return torch.where((topk_ids >= 0)[..., None], pairs, 0).flatten(0, 1)


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
