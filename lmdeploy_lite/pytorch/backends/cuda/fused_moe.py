"""Triton fused MoE (routed experts; reference `backends/default/moe.py`): two grouped-GEMM
kernels over "blocks" of (token, slot) pairs that share one expert:
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

`fused_moe_masked` runs the same two GEMMs on rows that arrive already grouped by expert (DeepEP's
low-latency layout `[E, C, H]` with a count per expert, DeepGEMM's "masked" grouped GEMM): no
sort, no top-k bookkeeping; program (e, row block) returns before any load when its block starts
at or past counts[e], so the cost follows the valid rows rather than E * C.

FP8 experts (weight-only: `gate_up_scale` / `down_scale`, nn/moe.py's layout): each weight tile
is loaded as float8_e4m3fn (half the bytes a memory-bound decode step reads) and dequantized in
registers, `w = (w_fp8.to(fp32) * scale[n // 128, k // 128]).to(x.dtype)`, before the same tl.dot
on x's dtype: the reference's numbers on the dequantized weights. Every BLOCK_K divides 128, so a
K tile has one scale per column. Without scales (HAS_SCALE off) the kernels are the bf16 ones.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..default import moe as reference

UNSORTED_MAX_PAIRS = 64
MASKED_BLOCK_M = 16             # fused_moe_masked: decode has few rows per expert; tl.dot min


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
def _dequantized(w, s_cols, cols_ok, k0, stride_sk, like):
    """FP8 weight tile [BLOCK_K, BLOCK_N] x its columns' block scales (s_cols [BLOCK_N] pointers
    to each column's scale row; BLOCK_K divides 128, so the tile is in one K group) -> like's
    dtype, as the reference dequantizes."""
    scale = tl.load(s_cols + (k0 // 128) * stride_sk, mask=cols_ok, other=0.0)
    return (w.to(tl.float32) * scale[None, :]).to(like.dtype)


@triton.jit
def _gate_up_act(x_rows, row_ok, w_gate, w_up, w_cols_ok, stride_wk, s_gate, s_up, stride_sk,
                 HIDDEN: tl.constexpr, HAS_SCALE: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """x_rows [BLOCK_M, 1] row pointers (row_ok [BLOCK_M]), w_gate / w_up [1, BLOCK_N] column
    pointers of the expert's gate and up rows (w_cols_ok [BLOCK_N]; HAS_SCALE: FP8, s_gate /
    s_up their scale rows) -> fp32 `silu(gate) * up`, gate and up rounded to x's dtype first
    like the reference."""
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, HIDDEN, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < HIDDEN
        xb = tl.load(x_rows + offs_k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & w_cols_ok[None, :]
        wg = tl.load(w_gate + offs_k[:, None] * stride_wk, mask=w_mask, other=0.0)
        wu = tl.load(w_up + offs_k[:, None] * stride_wk, mask=w_mask, other=0.0)
        if HAS_SCALE:
            wg = _dequantized(wg, s_gate, w_cols_ok, k0, stride_sk, xb)
            wu = _dequantized(wu, s_up, w_cols_ok, k0, stride_sk, xb)
        gate = tl.dot(xb, wg, gate, input_precision=DOT_PRECISION)
        up = tl.dot(xb, wu, up, input_precision=DOT_PRECISION)
    gate = gate.to(x_rows.dtype.element_ty).to(tl.float32)
    up = up.to(x_rows.dtype.element_ty).to(tl.float32)
    return gate / (1.0 + tl.exp(-gate)) * up


@triton.jit
def _down_dot(a_rows, row_ok, w_base, w_cols_ok, stride_wk, s_cols, stride_sk,
              INTER: tl.constexpr, HAS_SCALE: tl.constexpr, DOT_PRECISION: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """a_rows [BLOCK_M, 1] pointers to rows of inter, w_base [1, BLOCK_N] (HAS_SCALE: FP8,
    s_cols their scale rows) -> fp32 acc."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < INTER
        a = tl.load(a_rows + offs_k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_base + offs_k[:, None] * stride_wk,
                    mask=k_ok[:, None] & w_cols_ok[None, :], other=0.0)
        if HAS_SCALE:
            w = _dequantized(w, s_cols, w_cols_ok, k0, stride_sk, a)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit(do_not_specialize=['num_pairs'])     # any count: a variant per divisibility
def _gate_up_kernel(x_ptr, w_ptr, inter_ptr, pair_ids_ptr, block_expert_ptr, topk_ids_ptr,
                    num_pairs, num_experts, top_k, stride_x, stride_we, stride_wn, stride_wk,
                    stride_inter, s_ptr, stride_se, stride_sn, stride_sk, up_scale_row,
                    HIDDEN: tl.constexpr, INTER: tl.constexpr, SORTED: tl.constexpr,
                    HAS_SCALE: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pair, store, expert, valid = _block_rows(tl.program_id(0), pair_ids_ptr, block_expert_ptr,
                                             topk_ids_ptr, num_pairs, num_experts, SORTED,
                                             BLOCK_M)
    token = pair // top_k
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < INTER
    w_gate = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn
    s_gate = s_ptr + expert * stride_se + offs_n // 128 * stride_sn
    act = _gate_up_act(x_ptr + token[:, None] * stride_x, store & valid, w_gate,
                       w_gate + INTER * stride_wn, n_ok & valid, stride_wk, s_gate,
                       s_gate + up_scale_row * stride_sn, stride_sk, HIDDEN, HAS_SCALE,
                       DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
    tl.store(inter_ptr + pair[:, None] * stride_inter + offs_n[None, :],
             act.to(inter_ptr.dtype.element_ty), mask=store[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=['num_pairs'])
def _down_kernel(inter_ptr, w_ptr, weights_ptr, out_ptr, pair_ids_ptr, block_expert_ptr,
                 topk_ids_ptr, num_pairs, num_experts, stride_inter, stride_we, stride_wn,
                 stride_wk, stride_out, s_ptr, stride_se, stride_sn, stride_sk,
                 HIDDEN: tl.constexpr, INTER: tl.constexpr, SORTED: tl.constexpr,
                 HAS_SCALE: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pair, store, expert, valid = _block_rows(tl.program_id(0), pair_ids_ptr, block_expert_ptr,
                                             topk_ids_ptr, num_pairs, num_experts, SORTED,
                                             BLOCK_M)
    rows = store & valid
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < HIDDEN
    acc = _down_dot(inter_ptr + pair[:, None] * stride_inter, rows,
                    w_ptr + expert * stride_we + offs_n[None, :] * stride_wn, n_ok & valid,
                    stride_wk, s_ptr + expert * stride_se + offs_n // 128 * stride_sn,
                    stride_sk, INTER, HAS_SCALE, DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
    acc = acc.to(inter_ptr.dtype.element_ty).to(tl.float32)        # expert output in x.dtype
    scale = tl.load(weights_ptr + pair, mask=rows, other=0.0).to(tl.float32)
    tl.store(out_ptr + pair[:, None] * stride_out + offs_n[None, :], acc * scale[:, None],
             mask=store[:, None] & n_ok[None, :])


@triton.jit
def _masked_block(counts_ptr, capacity, BLOCK_M: tl.constexpr):
    """Program (e * cdiv(C, BLOCK_M) + b, n) -> (expert e (int64), its first row b * BLOCK_M,
    the expert's valid row count (clamped to C))."""
    blocks_per_expert = tl.cdiv(capacity, BLOCK_M)
    expert = tl.program_id(0) // blocks_per_expert
    count = tl.minimum(tl.load(counts_ptr + expert), capacity)
    return expert.to(tl.int64), tl.program_id(0) % blocks_per_expert * BLOCK_M, count


@triton.jit
def _masked_gate_up_kernel(x_ptr, counts_ptr, w_ptr, inter_ptr, capacity, stride_xe, stride_xc,
                           stride_we, stride_wn, stride_wk, stride_ie, stride_ic, s_ptr,
                           stride_se, stride_sn, stride_sk, up_scale_row, HIDDEN: tl.constexpr,
                           INTER: tl.constexpr, HAS_SCALE: tl.constexpr,
                           DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    expert, row0, count = _masked_block(counts_ptr, capacity, BLOCK_M)
    if row0 >= count:                   # past the expert's rows: no loads at all
        return
    offs_m = row0 + tl.arange(0, BLOCK_M)
    rows = offs_m < count
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < INTER
    w_gate = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn
    s_gate = s_ptr + expert * stride_se + offs_n // 128 * stride_sn
    act = _gate_up_act(x_ptr + expert * stride_xe + offs_m[:, None] * stride_xc, rows,
                       w_gate, w_gate + INTER * stride_wn, n_ok, stride_wk, s_gate,
                       s_gate + up_scale_row * stride_sn, stride_sk, HIDDEN, HAS_SCALE,
                       DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
    tl.store(inter_ptr + expert * stride_ie + offs_m[:, None] * stride_ic + offs_n[None, :],
             act.to(inter_ptr.dtype.element_ty), mask=rows[:, None] & n_ok[None, :])


@triton.jit
def _masked_down_kernel(inter_ptr, counts_ptr, w_ptr, out_ptr, capacity, stride_ie, stride_ic,
                        stride_we, stride_wn, stride_wk, stride_oe, stride_oc, s_ptr, stride_se,
                        stride_sn, stride_sk, HIDDEN: tl.constexpr, INTER: tl.constexpr,
                        HAS_SCALE: tl.constexpr, DOT_PRECISION: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    expert, row0, count = _masked_block(counts_ptr, capacity, BLOCK_M)
    if row0 >= count:
        return
    offs_m = row0 + tl.arange(0, BLOCK_M)
    rows = offs_m < count
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < HIDDEN
    acc = _down_dot(inter_ptr + expert * stride_ie + offs_m[:, None] * stride_ic, rows,
                    w_ptr + expert * stride_we + offs_n[None, :] * stride_wn, n_ok, stride_wk,
                    s_ptr + expert * stride_se + offs_n // 128 * stride_sn, stride_sk, INTER,
                    HAS_SCALE, DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
    tl.store(out_ptr + expert * stride_oe + offs_m[:, None] * stride_oc + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=rows[:, None] & n_ok[None, :])


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


def _scale_args(weight: torch.Tensor, scale: torch.Tensor | None) -> tuple:
    """A kernel's (scale, its three strides), HAS_SCALE; without scales the weight and zero
    strides stand in (never read)."""
    if scale is None:
        return (weight, 0, 0, 0), dict(HAS_SCALE=False)
    return (scale, *scale.stride()), dict(HAS_SCALE=True)


def moe_config(num_pairs: int, num_experts: int) -> tuple[int, int, int, int, int]:
    """`fused_moe`'s (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) for `num_pairs` (token, slot)
    pairs: one pair a block up to `UNSORTED_MAX_PAIRS` (decode: more, longer programs), else
    blocks of about the pairs an expert gets. BLOCK_K is FP8's 128-wide scale group: at the
    35B-A3B's shapes on an H100, 16-256 tokens, FP8 weights, within 3% of the best of a grid,
    where BLOCK_K 64 was 4-26% slower (bench_fused_moe.py --sweep)."""
    if num_pairs <= UNSORTED_MAX_PAIRS:
        return 16, 32, 128, 4, 3
    return min(64, max(16, triton.next_power_of_2(num_pairs // num_experts))), 64, 128, 4, 3


def fused_moe(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              gate_up_scale: torch.Tensor | None = None,
              down_scale: torch.Tensor | None = None,
              config: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """The default op's routed experts, with no host reads (module docstring); FP8 weights with
    their block scales (`gate_up_scale` / `down_scale`) are dequantized tile by tile. `config`:
    `moe_config`'s (for benchmarks; BLOCK_M counts only where pairs are sorted)."""
    if x.dtype == torch.float64:        # no fp64 tl.dot worth having; float64 models are CPU tests
        return reference.fused_moe(x, gate_up_proj, down_proj, topk_weights, topk_ids,
                                   gate_up_scale, down_scale)
    num_tokens, top_k = topk_ids.shape
    num_experts, inter_size = gate_up_proj.shape[0], down_proj.shape[2]
    hidden, num_pairs = x.shape[1], num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(x)
    x = x if x.stride(-1) == 1 else x.contiguous()
    flat_ids, flat_weights = (t.reshape(-1).contiguous() for t in (topk_ids, topk_weights))
    sorted_pairs = num_pairs > UNSORTED_MAX_PAIRS
    block_m, block_n, block_k, warps, stages = config or moe_config(num_pairs, num_experts)
    if sorted_pairs:
        pair_ids, block_expert = _sort_pairs(flat_ids, num_experts, block_m)
        num_blocks = block_expert.numel()
        pair_out = torch.zeros(num_pairs, hidden, dtype=torch.float32, device=x.device)
    else:
        block_m, num_blocks = 16, num_pairs
        pair_ids = block_expert = flat_ids      # unused by the unsorted kernels
        pair_out = torch.empty(num_pairs, hidden, dtype=torch.float32, device=x.device)
    inter = torch.empty(num_pairs, inter_size, dtype=x.dtype, device=x.device)
    precision = 'ieee' if x.dtype == torch.float32 else 'tf32'     # tf32: ignored for 16-bit
    common = dict(SORTED=sorted_pairs, DOT_PRECISION=precision, BLOCK_M=block_m, BLOCK_N=block_n,
                  BLOCK_K=block_k, num_warps=warps, num_stages=stages)
    gate_up_s, has_scale = _scale_args(gate_up_proj, gate_up_scale)
    _gate_up_kernel[(num_blocks, triton.cdiv(inter_size, block_n))](
        x, gate_up_proj, inter, pair_ids, block_expert, flat_ids, num_pairs, num_experts, top_k,
        x.stride(0), *gate_up_proj.stride(), inter.stride(0), *gate_up_s,
        _up_scale_row(gate_up_scale), HIDDEN=hidden, INTER=inter_size, **has_scale, **common)
    down_s, has_scale = _scale_args(down_proj, down_scale)
    _down_kernel[(num_blocks, triton.cdiv(hidden, block_n))](
        inter, down_proj, flat_weights, pair_out, pair_ids, block_expert, flat_ids, num_pairs,
        num_experts, inter.stride(0), *down_proj.stride(), pair_out.stride(0), *down_s,
        HIDDEN=hidden, INTER=inter_size, **has_scale, **common)
    return pair_out.view(num_tokens, top_k, hidden).sum(1).to(x.dtype)


def _up_scale_row(gate_up_scale: torch.Tensor | None) -> int:
    """The up half's first scale row: gate and up are quantized apart (nn/moe.py)."""
    return 0 if gate_up_scale is None else gate_up_scale.shape[1] // 2


def fused_moe_masked(x: torch.Tensor, counts: torch.Tensor, gate_up_proj: torch.Tensor,
                     down_proj: torch.Tensor, out: torch.Tensor | None = None,
                     gate_up_scale: torch.Tensor | None = None,
                     down_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The default op's experts on rows grouped by expert (module docstring); x and out need
    stride(-1) == 1 only (x may be the first H columns of a [E, C, W] buffer). Rows c >= counts[e]
    of x are not read, nor those of out written. Grid (E * cdiv(C, BLOCK_M), cdiv(N, BLOCK_N));
    no host reads, shapes from shapes only: capturable. FP8 weights as `fused_moe`."""
    if x.dtype == torch.float64:        # as fused_moe: the reference
        return reference.fused_moe_masked(x, counts, gate_up_proj, down_proj, out, gate_up_scale,
                                          down_scale)
    (num_experts, capacity, hidden), inter_size = x.shape, down_proj.shape[2]
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    elif (out.dtype != x.dtype or out.shape[:2] != x.shape[:2] or out.shape[2] < hidden
          or out.stride(-1) != 1):
        raise ValueError(f'out {tuple(out.shape)} {out.dtype}: must be [{num_experts}, '
                         f'{capacity}, >= {hidden}] {x.dtype} with contiguous rows')
    out = out[..., :hidden]
    if x.numel() == 0:
        return out
    x = x if x.stride(-1) == 1 else x.contiguous()
    inter = torch.empty(num_experts, capacity, inter_size, dtype=x.dtype, device=x.device)
    precision = 'ieee' if x.dtype == torch.float32 else 'tf32'     # tf32: ignored for 16-bit
    block_m, block_n, block_k = MASKED_BLOCK_M, 32, 128             # as fused_moe's decode path
    row_blocks = num_experts * triton.cdiv(capacity, block_m)
    common = dict(DOT_PRECISION=precision, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                  num_warps=4)
    gate_up_s, has_scale = _scale_args(gate_up_proj, gate_up_scale)
    _masked_gate_up_kernel[(row_blocks, triton.cdiv(inter_size, block_n))](
        x, counts, gate_up_proj, inter, capacity, x.stride(0), x.stride(1),
        *gate_up_proj.stride(), inter.stride(0), inter.stride(1), *gate_up_s,
        _up_scale_row(gate_up_scale), HIDDEN=hidden, INTER=inter_size, **has_scale, **common)
    down_s, has_scale = _scale_args(down_proj, down_scale)
    _masked_down_kernel[(row_blocks, triton.cdiv(hidden, block_n))](
        inter, counts, down_proj, out, capacity, inter.stride(0), inter.stride(1),
        *down_proj.stride(), out.stride(0), out.stride(1), *down_s, HIDDEN=hidden,
        INTER=inter_size, **has_scale, **common)
    return out
