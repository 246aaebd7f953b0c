"""Triton fused MoE (routed experts); reference in `backends/default/moe.py`.

Two grouped-GEMM kernels over "blocks" of (token, slot) pairs that share one expert:
  1. `inter[p] = silu(gate_e x_t) * up_e x_t`   (gate_up_proj [E, 2I, H], silu*mul fused)
  2. `pair_out[p] = w_p * down_e inter[p]`       (down_proj [E, H, I], fp32 out)
and `out[t] = sum_j pair_out[t, j]` (torch sum over k, fp32, then cast). Each block reads its
expert's weights once, only for the experts that were chosen; pairs with expert -1 read nothing
and contribute 0 (the EP dispatcher pads with -1).

Blocking, both without host reads or data-dependent shapes (so any call may be captured in a
CUDA graph; the choice depends only on shapes):
  * up to `UNSORTED_MAX_PAIRS` (= 64, e.g. decode of 8 tokens at top-8) pairs: one block per pair
    (a GEMV padded to tl.dot's 16 rows; no sort, no extra launches). Pairs that share an expert
    read its weights again, which matters little while pairs are few next to E.
  * more pairs: pairs sorted by expert (torch.argsort on the device) into blocks of `BLOCK_M`
    rows, each expert's run padded to a whole number of blocks; the grid covers the worst case
    `cdiv(P, BLOCK_M) + E` blocks, and blocks past the last used one exit after masked loads.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..default.moe import fused_moe as reference_fused_moe

UNSORTED_MAX_PAIRS = 64


@triton.jit
def _block_rows(block, pair_ids_ptr, block_expert_ptr, topk_ids_ptr, num_pairs, num_experts,
                SORTED: tl.constexpr, BLOCK_M: tl.constexpr):
    """-> (pair index per row [BLOCK_M], rows to store, expert (0 if none), expert valid)."""
    offs_m = tl.arange(0, BLOCK_M)
    if SORTED:
        pair = tl.load(pair_ids_ptr + block * BLOCK_M + offs_m)
        expert = tl.load(block_expert_ptr + block)
        store = pair < num_pairs
    else:
        pair = block + offs_m * 0
        expert = tl.load(topk_ids_ptr + block)
        store = offs_m == 0
    valid = (expert >= 0) & (expert < num_experts)
    pair = tl.where(store, pair, 0).to(tl.int64)
    return pair, store, tl.where(valid, expert, 0).to(tl.int64), valid


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, inter_ptr, pair_ids_ptr, block_expert_ptr, topk_ids_ptr,
                    num_pairs, num_experts, top_k, stride_x, stride_we, stride_wn, stride_wk,
                    stride_inter, HIDDEN: tl.constexpr, INTER: tl.constexpr, SORTED: tl.constexpr,
                    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr):
    pair, store, expert, valid = _block_rows(tl.program_id(0), pair_ids_ptr, block_expert_ptr,
                                             topk_ids_ptr, num_pairs, num_experts, SORTED,
                                             BLOCK_M)
    rows = store & valid
    token = pair // top_k
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < INTER
    w_gate = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn
    w_up = w_gate + INTER * stride_wn
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, HIDDEN, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < HIDDEN
        xb = tl.load(x_ptr + token[:, None] * stride_x + offs_k[None, :],
                     mask=rows[:, None] & k_ok[None, :], other=0.0)
        w_mask = valid & k_ok[:, None] & n_ok[None, :]
        wg = tl.load(w_gate + offs_k[:, None] * stride_wk, mask=w_mask, other=0.0)
        wu = tl.load(w_up + offs_k[:, None] * stride_wk, mask=w_mask, other=0.0)
        gate = tl.dot(xb, wg, gate, input_precision=DOT_PRECISION)
        up = tl.dot(xb, wu, up, input_precision=DOT_PRECISION)
    gate = gate.to(inter_ptr.dtype.element_ty).to(tl.float32)   # rounded like the reference
    up = up.to(inter_ptr.dtype.element_ty).to(tl.float32)
    act = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(inter_ptr + pair[:, None] * stride_inter + offs_n[None, :],
             act.to(inter_ptr.dtype.element_ty), mask=store[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel(inter_ptr, w_ptr, weights_ptr, out_ptr, pair_ids_ptr, block_expert_ptr,
                 topk_ids_ptr, num_pairs, num_experts, stride_inter, stride_we, stride_wn,
                 stride_wk, stride_out, HIDDEN: tl.constexpr, INTER: tl.constexpr, SORTED: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    pair, store, expert, valid = _block_rows(tl.program_id(0), pair_ids_ptr, block_expert_ptr,
                                             topk_ids_ptr, num_pairs, num_experts, SORTED,
                                             BLOCK_M)
    rows = store & valid
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < HIDDEN
    w_base = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < INTER
        a = tl.load(inter_ptr + pair[:, None] * stride_inter + offs_k[None, :],
                    mask=rows[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_base + offs_k[:, None] * stride_wk,
                    mask=valid & k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
    acc = acc.to(inter_ptr.dtype.element_ty).to(tl.float32)        # expert output in x.dtype
    scale = tl.load(weights_ptr + pair, mask=rows, other=0.0).to(tl.float32)
    tl.store(out_ptr + pair[:, None] * stride_out + offs_n[None, :], acc * scale[:, None],
             mask=store[:, None] & n_ok[None, :])


def _sort_pairs(flat_ids: torch.Tensor, num_experts: int, block_m: int):
    """flat_ids [P] -> (pair ids [num_blocks * block_m], P where padding; expert per block
    [num_blocks], E past the last used block). Pairs of one expert fill consecutive blocks; -1
    pairs are left out. Device ops of fixed shapes only."""
    num_pairs = flat_ids.numel()
    num_blocks = triton.cdiv(num_pairs, block_m) + num_experts
    key = torch.where(flat_ids >= 0, flat_ids, num_experts).long()
    order = torch.argsort(key, stable=True)
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=key.device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    first_pair = torch.cumsum(counts, 0) - counts                  # sorted position of e's 1st pair
    blocks = (counts[:num_experts] + block_m - 1) // block_m
    block_end = torch.cumsum(blocks, 0)
    first_slot = torch.cat([block_end - blocks, block_end[-1:]]) * block_m
    sorted_key = key[order]
    rank = torch.arange(num_pairs, device=key.device) - first_pair[sorted_key]
    dest = torch.where(sorted_key < num_experts, first_slot[sorted_key] + rank,
                       num_blocks * block_m)                       # -1 pairs: a trash slot
    pair_ids = torch.full((num_blocks * block_m + 1,), num_pairs, dtype=torch.int32,
                          device=key.device)
    pair_ids.scatter_(0, dest, order.to(torch.int32))
    block_expert = torch.searchsorted(block_end, torch.arange(num_blocks, device=key.device),
                                      right=True).to(torch.int32)
    return pair_ids[:-1], block_expert


def fused_moe(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """x [T, H]; gate_up_proj [E, 2I, H] (gate rows first); down_proj [E, H, I]; topk_weights
    [T, k] (x.dtype or fp32); topk_ids [T, k] in 0..E-1 or -1 (contributes 0) -> [T, H] in x.dtype,
    `out[t] = sum_j w[t, j] * down_e(silu(gate_e x_t) * up_e x_t)` with e = topk_ids[t, j]."""
    if x.dtype == torch.float64:        # no fp64 tl.dot worth having; float64 models are CPU tests
        return reference_fused_moe(x, gate_up_proj, down_proj, topk_weights, topk_ids)
    num_tokens, top_k = topk_ids.shape
    num_experts, inter_size = gate_up_proj.shape[0], down_proj.shape[2]
    hidden, num_pairs = x.shape[1], num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(x)
    x = x if x.stride(-1) == 1 else x.contiguous()
    flat_ids = topk_ids.reshape(-1).contiguous()
    flat_weights = topk_weights.reshape(-1).contiguous()
    sorted_pairs = num_pairs > UNSORTED_MAX_PAIRS
    if sorted_pairs:
        block_m = min(64, max(16, triton.next_power_of_2(num_pairs // num_experts)))
        pair_ids, block_expert = _sort_pairs(flat_ids, num_experts, block_m)
        num_blocks = block_expert.numel()
        pair_out = torch.zeros(num_pairs, hidden, dtype=torch.float32, device=x.device)
    else:
        block_m, num_blocks = 16, num_pairs
        pair_ids = block_expert = flat_ids      # unused by the unsorted kernels
        pair_out = torch.empty(num_pairs, hidden, dtype=torch.float32, device=x.device)
    inter = torch.empty(num_pairs, inter_size, dtype=x.dtype, device=x.device)
    precision = 'ieee' if x.dtype == torch.float32 else 'tf32'     # tf32: ignored for 16-bit
    block_n, block_k = (64, 64) if sorted_pairs else (32, 128)     # decode: more, longer programs
    common = dict(SORTED=sorted_pairs, DOT_PRECISION=precision, BLOCK_M=block_m, BLOCK_N=block_n,
                  BLOCK_K=block_k, num_warps=4)
    _gate_up_kernel[(num_blocks, triton.cdiv(inter_size, block_n))](
        x, gate_up_proj, inter, pair_ids, block_expert, flat_ids, num_pairs, num_experts, top_k,
        x.stride(0), *gate_up_proj.stride(), inter.stride(0), HIDDEN=hidden, INTER=inter_size,
        **common)
    _down_kernel[(num_blocks, triton.cdiv(hidden, block_n))](
        inter, down_proj, flat_weights, pair_out, pair_ids, block_expert, flat_ids, num_pairs,
        num_experts, inter.stride(0), *down_proj.stride(), pair_out.stride(0), HIDDEN=hidden,
        INTER=inter_size, **common)
    return pair_out.view(num_tokens, top_k, hidden).sum(1).to(x.dtype)
