"""Gated delta rule on CUDA: our Triton recurrent kernels for decode/verify and for short prefills
(a bf16 model's prefill rows in chunks on tensor cores, `gdn_chunk`), fla-core's chunk kernel
for longer prefills (when fla is installed). Shapes, state-slot rules and
the pure-torch reference: `backends/default/gated_delta_rule.py`.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ...model_inputs import ModelInputs
from ..default import gated_delta_rule as reference
from .gdn_chunk import chunk_walk
from .graph_runner import long_row
from .paged_attention import num_sms


# Prefill steps of at most this many tokens per sequence run `_recurrent_prefill_kernel`, which
# walks the tokens in order, ~1.5 us each at 9B heads on an H100 (0.2 ms at 128); fla's chunk
# function is faster past that but costs ~1-2 ms of host time per layer call whatever the length
# (BENCHMARKS.md, "Short prefills"). A step with a longer chunk gives its longest one to fla as
# one sequence (`long_row_prefill`), its other chunks of up to CAPTURED_PREFILL_TOKENS tokens to
# the kernel (~0.8 ms a layer at 512), eager or captured in a CUDA graph alike (the same kernels,
# the same bits); a step with two chunks over that runs fla's varlen form (eager only).
SHORT_PREFILL_TOKENS = 128
CAPTURED_PREFILL_TOKENS = 512
# fla's chunk: a long row's window covers whole chunks from the step's first token (eager: to
# the row's end, rounded up; captured: the bucket, a multiple of it), so its chunks see the same
# values either way
FLA_CHUNK = 64
# launches of at most this many (sequence, value head) programs take `decode_tiling`'s small
# tiles: measured on an H200, k=3 verify at 0.8B / 9B heads (16 / 32 value heads)
SMALL_TILE_PROGRAMS = 256
# activations whose rows of several tokens walk in chunks on tensor cores (`gdn_chunk`): a
# float32 or float64 model keeps the token-by-token walk, whose bits follow no tiling
CHUNKED_DTYPES = (torch.bfloat16, torch.float16)
# a chunk program's value columns (4 warps) and how many of them are resident a multiprocessor
CHUNK_BLOCK_V = 64
CHUNK_WALKERS_PER_SM = 4
# a prefill walk's one-warp programs resident on one multiprocessor (registers bound them);
# `_launch` starts this many a multiprocessor and each walks its rows in turn
WALKERS_PER_SM = 32


@triton.jit
def _token_inputs(tok, q_row, k_row, v_row, g_row, beta_row, stride_qt, stride_kt, stride_vt,
                  stride_gt, stride_bt, mask_k, mask_v, valid, acc: tl.constexpr):
    """q, k [BK], v [BV], g, beta of token `tok` (int64) in the math's dtype (zeros where not
    `valid`). The *_row pointers point at token 0 of the head."""
    q = tl.load(q_row + tok * stride_qt, mask=mask_k & valid, other=0.).to(acc)
    k = tl.load(k_row + tok * stride_kt, mask=mask_k & valid, other=0.).to(acc)
    v = tl.load(v_row + tok * stride_vt, mask=mask_v & valid, other=0.).to(acc)
    g = tl.load(g_row + tok * stride_gt, mask=valid, other=0.).to(acc)
    beta = tl.load(beta_row + tok * stride_bt, mask=valid, other=0.).to(acc)
    return q, k, v, g, beta


@triton.jit
def _sum_rows(x, TREE_LEVELS: tl.constexpr):
    """x [BK, C] summed over its rows -> [C]: by tl.sum, whose order follows the tiling (a
    thread's rows, then lanes, then warps), or with TREE_LEVELS = log2(BK) in a fixed binary
    tree (row r + n/2 added onto row r, n halving). A sum of two is the same bits wherever the
    two live (the kernels are compiled without FMA contraction, which would fuse one side's
    product and not the other's), so the tree gives one result for every tiling."""
    if TREE_LEVELS == 0:
        total = tl.sum(x, 0)
    else:                              # (no early return: Triton compiles the code after one)
        for _ in tl.static_range(TREE_LEVELS):
            x = tl.sum(tl.reshape(x, [2, x.shape[0] // 2, x.shape[1]]), axis=0)
        total = tl.reshape(x, [x.shape[1]])
    return total


@triton.jit
def _delta_rule_math(state, q, k, v, g, beta, out_ptr, mask_v, scale, TREE_LEVELS: tl.constexpr):
    """One token of one value head on a [BK, BV] state tile (fp32 or fp64: the math's dtype),
    from `_token_inputs`: normalises q, k; stores o_t = S_t^T q_t at out_ptr; returns S_t.
    Every sum over dk is a `_sum_rows`."""
    q = q / tl.sqrt(_sum_rows((q * q)[:, None], TREE_LEVELS) + 1e-6) * scale
    k = k / tl.sqrt(_sum_rows((k * k)[:, None], TREE_LEVELS) + 1e-6)

    state = state * tl.exp(g)
    delta = (v - _sum_rows(state * k[:, None], TREE_LEVELS)) * beta       # [BV]
    state = state + k[:, None] * delta[None, :]
    out = _sum_rows(state * q[:, None], TREE_LEVELS)
    tl.store(out_ptr, out.to(out_ptr.dtype.element_ty), mask=mask_v)
    return state


@triton.jit
def _recurrent_decode_kernel(
        q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr, state_ptr,
        state_slots_ptr, state_index_ptr, history_lens_ptr,
        stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd,
        stride_vt, stride_vh, stride_vd, stride_gt, stride_gh, stride_bt, stride_bh,
        stride_ot, stride_oh, stride_od,
        stride_s0, stride_s1, stride_s2, stride_sk, stride_sv,
        scale, NUM_TOKENS: tl.constexpr, ACC_FP64: tl.constexpr,
        HEAD_RATIO: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
        BK: tl.constexpr, BV: tl.constexpr, TREE_LEVELS: tl.constexpr):
    """One program: sequence b, value head h, value columns [BV * pid_v, +BV) of the state.
    S [DK, BV] starts at state[slot, state_index[b], h] (zero if fresh); after token t it is
    stored to state[slot, t, h]. Computes in fp32 (fp64 with ACC_FP64) whatever the state is
    stored in (fp32, or bf16 with ssm_state_dtype='bfloat16'); each token starts from the state
    as stored, so a verify of n tokens equals n one-token decodes."""
    b, h, pid_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    acc = tl.float64 if ACC_FP64 else tl.float32
    kh = h // HEAD_RATIO
    offs_k = tl.arange(0, BK)
    offs_v = pid_v * BV + tl.arange(0, BV)
    mask_k, mask_v = offs_k < DK, offs_v < DV
    mask_s = mask_k[:, None] & mask_v[None, :]

    slot = tl.load(state_slots_ptr + b).to(tl.int64)
    index = tl.load(state_index_ptr + b).to(tl.int64)
    has_history = tl.load(history_lens_ptr + b) > 0
    row = state_ptr + slot * stride_s0 + h * stride_s2
    tile = offs_k[:, None] * stride_sk + offs_v[None, :] * stride_sv
    state = tl.load(row + index * stride_s1 + tile, mask=mask_s & has_history, other=0.).to(acc)

    q_row = q_ptr + kh * stride_qh + offs_k * stride_qd
    k_row = k_ptr + kh * stride_kh + offs_k * stride_kd
    v_row, g_row = v_ptr + h * stride_vh + offs_v * stride_vd, g_ptr + h * stride_gh
    beta_row, out_row = beta_ptr + h * stride_bh, out_ptr + h * stride_oh + offs_v * stride_od
    first = (b * NUM_TOKENS).to(tl.int64)
    # unrolled, each token's inputs loaded a token ahead: the loads never wait on the math
    ahead = _token_inputs(first, q_row, k_row, v_row, g_row, beta_row, stride_qt, stride_kt,
                          stride_vt, stride_gt, stride_bt, mask_k, mask_v, True, acc)
    for t in tl.static_range(NUM_TOKENS):
        q, k, v, g, beta = ahead
        if t + 1 < NUM_TOKENS:
            ahead = _token_inputs(first + t + 1, q_row, k_row, v_row, g_row, beta_row, stride_qt,
                                  stride_kt, stride_vt, stride_gt, stride_bt, mask_k, mask_v, True,
                                  acc)
        state = _delta_rule_math(state, q, k, v, g, beta, out_row + (first + t) * stride_ot,
                                 mask_v, scale, TREE_LEVELS)
        stored = state.to(state_ptr.dtype.element_ty)
        tl.store(row + t * stride_s1 + tile, stored, mask=mask_s)
        state = stored.to(acc)         # the next token starts from the state as stored (= AR)


@triton.jit
def _recurrent_prefill_kernel(
        q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr, state_ptr,
        state_slots_ptr, state_index_ptr, history_lens_ptr, q_start_loc_ptr, q_lens_ptr,
        walks_ptr, stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd,
        stride_vt, stride_vh, stride_vd, stride_gt, stride_gh, stride_bt, stride_bh,
        stride_ot, stride_oh, stride_od,
        stride_s0, stride_s1, stride_s2, stride_sk, stride_sv,
        scale, ACC_FP64: tl.constexpr,
        HEAD_RATIO: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
        BK: tl.constexpr, BV: tl.constexpr, TREE_LEVELS: tl.constexpr, ROWS: tl.constexpr = 0,
        DOT: tl.constexpr = 'tf32'):
    """The decode kernel's program (sequence b, value head h, value columns [BV * pid_v, +BV))
    over a varlen prefill: tokens q_start_loc[b] .. + q_lens[b] (a runtime loop: one compile for
    every length), from state[slot, state_index[b], h] (zero if fresh). The state stays in the
    math's dtype between tokens (as in the chunk form); only the final one is stored, to
    state[slot, 0, h]. A sequence with no tokens (padding) leaves its row untouched. `ROWS`:
    0, every row (program b: row b); 1, rows of one token only; 2, rows of more than one token
    only, from `walks_ptr` (`_walks`: their count, then their indices), program b taking the
    b-th, (b + P)-th, .. of them (P programs: rows beyond those resident at once walk later
    either way); 3, as 2, each row in chunks (`gdn_chunk`, products at DOT precision)."""
    if ROWS >= 2:
        i, num_walks = tl.program_id(0), tl.load(walks_ptr)
        while i < num_walks:
            _walk_row(tl.load(walks_ptr + 1 + i), q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr,
                      state_ptr, state_slots_ptr, state_index_ptr, history_lens_ptr,
                      q_start_loc_ptr, q_lens_ptr, stride_qt, stride_qh, stride_qd, stride_kt,
                      stride_kh, stride_kd, stride_vt, stride_vh, stride_vd, stride_gt,
                      stride_gh, stride_bt, stride_bh, stride_ot, stride_oh, stride_od,
                      stride_s0, stride_s1, stride_s2, stride_sk, stride_sv, scale, ACC_FP64,
                      HEAD_RATIO, DK, DV, BK, BV, TREE_LEVELS, ROWS, DOT)
            i += tl.num_programs(0)
    else:
        _walk_row(tl.program_id(0), q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr, state_ptr,
                  state_slots_ptr, state_index_ptr, history_lens_ptr, q_start_loc_ptr,
                  q_lens_ptr, stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd,
                  stride_vt, stride_vh, stride_vd, stride_gt, stride_gh, stride_bt, stride_bh,
                  stride_ot, stride_oh, stride_od, stride_s0, stride_s1, stride_s2, stride_sk,
                  stride_sv, scale, ACC_FP64, HEAD_RATIO, DK, DV, BK, BV, TREE_LEVELS, ROWS, DOT)


@triton.jit
def _walk_row(b, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr, state_ptr,
              state_slots_ptr, state_index_ptr, history_lens_ptr, q_start_loc_ptr, q_lens_ptr,
              stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd,
              stride_vt, stride_vh, stride_vd, stride_gt, stride_gh, stride_bt, stride_bh,
              stride_ot, stride_oh, stride_od,
              stride_s0, stride_s1, stride_s2, stride_sk, stride_sv,
              scale, ACC_FP64: tl.constexpr,
              HEAD_RATIO: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
              BK: tl.constexpr, BV: tl.constexpr, TREE_LEVELS: tl.constexpr, ROWS: tl.constexpr,
              DOT: tl.constexpr):
    """`_recurrent_prefill_kernel`'s walk of row b (value head and columns by program id)."""
    h, pid_v = tl.program_id(1), tl.program_id(2)
    acc = tl.float64 if ACC_FP64 else tl.float32
    kh = h // HEAD_RATIO
    offs_k = tl.arange(0, BK)
    offs_v = pid_v * BV + tl.arange(0, BV)
    mask_k, mask_v = offs_k < DK, offs_v < DV
    mask_s = mask_k[:, None] & mask_v[None, :]

    num_tokens = tl.load(q_lens_ptr + b)
    if ROWS == 1:
        num_tokens = tl.where(num_tokens == 1, num_tokens, 0)
    start = tl.load(q_start_loc_ptr + b).to(tl.int64)
    slot = tl.load(state_slots_ptr + b).to(tl.int64)
    index = tl.load(state_index_ptr + b).to(tl.int64)
    has_history = tl.load(history_lens_ptr + b) > 0
    row = state_ptr + slot * stride_s0 + h * stride_s2
    tile = offs_k[:, None] * stride_sk + offs_v[None, :] * stride_sv
    state = tl.load(row + index * stride_s1 + tile, mask=mask_s & has_history & (num_tokens > 0),
                    other=0.).to(acc)

    q_row = q_ptr + kh * stride_qh + offs_k * stride_qd
    k_row = k_ptr + kh * stride_kh + offs_k * stride_kd
    v_row = v_ptr + h * stride_vh + offs_v * stride_vd
    out_row = out_ptr + h * stride_oh + offs_v * stride_od
    g_row, beta_row = g_ptr + h * stride_gh, beta_ptr + h * stride_bh
    tok, end = start, start + num_tokens
    if ROWS == 3:
        state = chunk_walk(state, tok, end, q_row, k_row, v_row, g_row, beta_row, out_row,
                           stride_qt, stride_kt, stride_vt, stride_gt, stride_bt, stride_ot,
                           mask_k, mask_v, scale, DOT)
    else:
        # each token's inputs are loaded a token ahead, so their latency overlaps the math
        # before them (a walk of 64 tokens was ~1.5 us a token, mostly waiting for loads)
        q, k, v, g, beta = _token_inputs(tok, q_row, k_row, v_row, g_row, beta_row, stride_qt,
                                         stride_kt, stride_vt, stride_gt, stride_bt, mask_k,
                                         mask_v, tok < end, acc)
        while tok < end:               # (Triton's interpreter takes no loaded bound in a range)
            q_next, k_next, v_next, g_next, beta_next = _token_inputs(
                tok + 1, q_row, k_row, v_row, g_row, beta_row, stride_qt, stride_kt, stride_vt,
                stride_gt, stride_bt, mask_k, mask_v, tok + 1 < end, acc)
            state = _delta_rule_math(state, q, k, v, g, beta, out_row + tok * stride_ot, mask_v,
                                     scale, TREE_LEVELS)
            q, k, v, g, beta = q_next, k_next, v_next, g_next, beta_next
            tok += 1
    tl.store(row + tile, state.to(state_ptr.dtype.element_ty), mask=mask_s & (num_tokens > 0))


def decode_tiling(dv: int, programs: int | None) -> tuple[int, int]:
    """(block_v, num_warps) of a launch; a program holds the [dk, block_v] state tile of one
    value head. Where the kernels sum in fixed trees (an fp32/fp64 state), `programs`
    (sequences x value heads) picks: up to SMALL_TILE_PROGRAMS, one-warp [dk, 16] tiles (4x the
    programs, no cross-warp sums: a k=3 verify's 4 tokens ~1.5x faster at batch 1); above,
    [dk, 64] tiles with four warps, which read the state in 256-byte rows at ~3.4-3.8 TB/s on
    an H200 where one-warp tiles reach ~1.9 (benchmarks/tune_gdn_decode.py). `programs` None
    (a bf16-stored state, summed by tl.sum, whose order follows the tiling): the large tiles
    always, so a request's tokens never depend on the batch it shares (tree sums cost that
    path ~2x at large batches)."""
    if programs is not None and programs <= SMALL_TILE_PROGRAMS:
        return min(triton.next_power_of_2(dv), 16), 1
    block_v = min(triton.next_power_of_2(dv), 64)
    return block_v, max(1, block_v // 16)


def _launch(kernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
            beta: torch.Tensor, state_cache: torch.Tensor, inputs: ModelInputs, *seq_ptrs,
            out: torch.Tensor | None = None, walks: torch.Tensor | None = None,
            **constexprs) -> torch.Tensor:
    """Grid (B, nv, dv / BV) as `decode_tiling`; `seq_ptrs` after history_lens -> o [T, nv, dv]
    (`out`, where given, keeps the rows of sequences without tokens). `walks` (the prefill
    kernel's `_walks` of the lengths last in `seq_ptrs`), where the sums are fixed trees: two
    launches, the rows of more than one token in one-warp tiles (a walk keeps its state in
    registers: its cost is each token's latency, no cross-warp sums), by as many programs as
    can be resident (WALKERS_PER_SM a multiprocessor), and the one-token rows in
    `decode_tiling`'s (their cost is reading the state); the same bits as one launch. With
    bf16 / fp16 activations (CHUNKED_DTYPES) the rows of several tokens go to `gdn_chunk`
    instead, whatever the state's dtype."""
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device) if out is None else out
    dk, (nv, dv) = q.shape[-1], v.shape[1:]
    batch, block_k = inputs.q_lens.numel(), triton.next_power_of_2(dk)
    tree = state_cache.dtype != torch.bfloat16
    strides = [stride for x in (q, k, v, g, beta, out, state_cache) for stride in x.stride()]
    launches = [(batch, decode_tiling(dv, batch * nv if tree else None),
                 {} if walks is None else {'ROWS': 0})]
    if walks is not None:
        seq_ptrs = (*seq_ptrs, walks)
        if v.dtype in CHUNKED_DTYPES and block_k >= 16:       # (tl.dot's smallest tile)
            walkers = min(batch, triton.cdiv(CHUNK_WALKERS_PER_SM * num_sms(q.device),
                                             nv * triton.cdiv(dv, CHUNK_BLOCK_V)))
            dot = 'ieee' if v.dtype == torch.float32 else 'tf32'     # (float32: tests only)
            launches = [(walkers, (CHUNK_BLOCK_V, CHUNK_BLOCK_V // 16), {'ROWS': 3, 'DOT': dot}),
                        (batch, decode_tiling(dv, batch * nv if tree else None), {'ROWS': 1})]
        elif tree:
            (block_v, _), sms = decode_tiling(dv, 0), num_sms(q.device)
            walkers = min(batch, triton.cdiv(WALKERS_PER_SM * sms, nv * triton.cdiv(dv, block_v)))
            launches = [(walkers, decode_tiling(dv, 0), {'ROWS': 2}),
                        (batch, decode_tiling(dv, batch * nv), {'ROWS': 1})]
    for rows, (block_v, num_warps), extra in launches:
        kernel[(rows, nv, triton.cdiv(dv, block_v))](
            q, k, v, g, beta, out, state_cache, inputs.state_slots, inputs.state_index,
            inputs.history_lens, *seq_ptrs, *strides, scale=dk ** -0.5,
            ACC_FP64=state_cache.dtype == torch.float64, HEAD_RATIO=nv // q.shape[1], DK=dk,
            DV=dv, BK=block_k, BV=block_v, TREE_LEVELS=block_k.bit_length() - 1 if tree else 0,
            num_warps=num_warps, enable_fp_fusion=not tree or extra.get('ROWS') == 3, **extra,
            **constexprs)
    return out


def _walks(lens: torch.Tensor) -> torch.Tensor:
    """[1 + B] long on the device: how many rows have more than one token, then their indices
    (the other rows' after them). Sync-free."""
    multi = lens > 1
    return torch.cat([multi.sum(0, keepdim=True), torch.argsort(~multi, stable=True)])


def gated_delta_rule_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                            beta: torch.Tensor, state_cache: torch.Tensor,
                            inputs: ModelInputs) -> torch.Tensor:
    """The default op with no host sync when every sequence has `inputs.uniform_q_len` tokens;
    steps whose sequences have different lengths take the default op, as does a float64 model
    with a narrower stored state."""
    if inputs.uniform_q_len is None or (v.dtype == torch.float64) != (
            state_cache.dtype == torch.float64):
        return reference.gated_delta_rule_decode(q, k, v, g, beta, state_cache, inputs)
    return _launch(_recurrent_decode_kernel, q, k, v, g, beta, state_cache, inputs,
                   NUM_TOKENS=inputs.uniform_q_len)


def recurrent_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                      beta: torch.Tensor, state_cache: torch.Tensor,
                      inputs: ModelInputs) -> torch.Tensor:
    """`gated_delta_rule_prefill` by `_recurrent_prefill_kernel`: token by token, so for short
    chunks only (`SHORT_PREFILL_TOKENS`); any lengths (0 included), read on the device. In a
    captured step the padding sequences (state slot 0, reserved: a bucket's spare ones) are not
    walked, whose tokens a bucket with few spare sequences piles on them; their outputs, which
    nobody reads, are zeros."""
    if v.shape[0] == 0:
        return torch.empty(v.shape, dtype=v.dtype, device=v.device)
    lens, out = inputs.q_lens, None
    if inputs.sync_free:
        lens = inputs.derived('gdn_real_lens', lambda: lens.masked_fill(inputs.state_slots == 0,
                                                                        0))
        out = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
    return _launch(_recurrent_prefill_kernel, q, k, v, g, beta, state_cache, inputs,
                   inputs.derived('gdn_q_start_loc', lambda: inputs.q_start_loc), lens, out=out,
                   walks=inputs.derived('gdn_walks', lambda: _walks(lens)))


@functools.cache
def fla_chunk_gated_delta_rule():
    """fla-core's `chunk_gated_delta_rule`, or None when fla is not installed."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    return chunk_gated_delta_rule


def gated_delta_rule_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                             beta: torch.Tensor, state_cache: torch.Tensor,
                             inputs: ModelInputs) -> torch.Tensor:
    """The default op's prefill, on CUDA with an fp32 or bf16 state by `recurrent_prefill` when
    no sequence has more than `SHORT_PREFILL_TOKENS` new tokens (the host lengths are the step's,
    read once per forward), else by `long_row_prefill` with the longest chunk as the long row
    (as a captured step has it, `inputs.long_row`) where no other is over
    CAPTURED_PREFILL_TOKENS, else by fla's varlen chunk kernel (fla normalises q/k in the kernel
    and maps value head j to key head j // (nv / nk) itself; it starts from an fp32 copy of the
    rows and returns fp32 final states, stored back in the cache's dtype); otherwise the default
    op itself (CPU, fp64 models, long chunks without fla)."""
    if not q.is_cuda or v.dtype == torch.float64 or state_cache.dtype not in (torch.float32,
                                                                              torch.bfloat16):
        return reference.gated_delta_rule_prefill(q, k, v, g, beta, state_cache, inputs)
    if inputs.sync_free and inputs.long_row is not None:
        return long_row_prefill(q, k, v, g, beta, state_cache, inputs,
                                fla_chunk_gated_delta_rule())
    if inputs.sync_free or inputs.max_q_len <= SHORT_PREFILL_TOKENS:
        return recurrent_prefill(q, k, v, g, beta, state_cache, inputs)
    chunk = fla_chunk_gated_delta_rule()
    if chunk is None:
        return reference.gated_delta_rule_prefill(q, k, v, g, beta, state_cache, inputs)
    split = inputs.derived('gdn_eager_long_row', lambda: _eager_long_row(inputs), True)
    if split is not None:        # a captured step's split over the window that covers the row
        return long_row_prefill(q, k, v, g, beta, state_cache, split[0], chunk, width=split[1])
    initial = reference.initial_states(state_cache, inputs).float()              # [B, nv, dk, dv]
    # the same tensors for every layer: fla caches what it derives from them (chunk indices,
    # via .tolist()) by identity; new ones per layer cost ~2.5 ms of host time per layer call
    # (measured: a mixed step of 0.8B spent ~50 ms on the host in fla)
    cu_seqlens, cu_seqlens_cpu = inputs.derived('fla_cu_seqlens', lambda: (
        F.pad(inputs.q_lens.cumsum(0), (1, 0)),
        torch.tensor([0, *itertools.accumulate(inputs.host_q_lens)])))
    out, final = chunk(q[None], k[None], v[None], g[None].float(), beta[None],
                       scale=q.shape[-1] ** -0.5, initial_state=initial, output_final_state=True,
                       use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens,
                       cu_seqlens_cpu=cu_seqlens_cpu)
    reference.store_states(state_cache, inputs.state_slots, slice(0, 1), final[:, None],
                           (inputs.q_lens > 0)[:, None])
    return out[0].to(v.dtype)


def _eager_long_row(inputs: ModelInputs) -> tuple[ModelInputs, int] | None:
    """`inputs` with its longest chunk as `long_row` (graph_runner.long_row: the captured
    steps' rule) and the window that covers it (`eager_width`), so eager and captured steps take
    the same kernels; None where no chunk is over SHORT_PREFILL_TOKENS or another is over
    CAPTURED_PREFILL_TOKENS (fla's varlen form)."""
    row = long_row(inputs.host_q_lens, SHORT_PREFILL_TOKENS, CAPTURED_PREFILL_TOKENS)
    if row is None:
        return None
    return (dataclasses.replace(inputs, long_row=torch.tensor([row], device=inputs.q_lens.device)),
            eager_width(inputs.host_q_lens, row))


def eager_width(q_lens: list[int], row: int) -> int:
    """An eager step's long-row window: its first tokens up to the end of `row`'s chunk, rounded
    up to whole fla chunks (a captured step's window is its bucket, a multiple of FLA_CHUNK)."""
    return -(-sum(q_lens[:row + 1]) // FLA_CHUNK) * FLA_CHUNK


def _long_window(inputs: ModelInputs, width: int):
    """`live` [W]: the window rows that are the long row's tokens; `short` [B]: the q_lens with
    the long row's zeroed, and those of padding sequences (state slot 0, reserved: a graph
    bucket's spare sequences, an idle rank's dummies), whose outputs nobody reads: they keep
    the window's (finite) rows instead of being walked token by token, up to a bucket's gap
    (127 tokens in 18 layers for 641 tokens in the 768 bucket). Host-free."""
    row = inputs.long_row
    start = inputs.derived('gdn_q_start_loc', lambda: inputs.q_start_loc)[row]
    pos = torch.arange(width, device=row.device)
    short = inputs.q_lens.masked_fill(
        (torch.arange(inputs.batch_size, device=row.device) == row) | (inputs.state_slots == 0), 0)
    return (pos >= start) & (pos < start + inputs.q_lens[row]), short


def _long_row_slot(inputs: ModelInputs) -> tuple[torch.Tensor, ...]:
    """The long row's state slot and index, whether it is fresh ([1, 1, 1, 1]: a mask for its
    state) and slot index 0, each [1] (the same in every layer of the step)."""
    row = inputs.long_row
    slot = inputs.state_slots[row]
    fresh = (inputs.history_lens[row] == 0)[:, None, None, None]
    return slot, inputs.state_index[row], fresh, torch.zeros_like(slot)


def _rows(x: torch.Tensor, n: int) -> torch.Tensor:
    """The first `n` rows of `x` (a view), zero rows past its end."""
    if n <= x.shape[0]:
        return x[:n]
    return torch.cat([x, x.new_zeros(n - x.shape[0], *x.shape[1:])])


def long_row_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, state_cache: torch.Tensor, inputs: ModelInputs,
                     chunk, width: int | None = None) -> torch.Tensor:
    """A prefill with one long chunk (`inputs.long_row`), reading no length on the host: the
    long row by `chunk` (fla's signature) as ONE sequence over the step's first `width` tokens
    (default: all T, as a captured step has it), the other tokens of that window taken with
    beta = 0 and log-decay 0, which leave the state exactly as it was (each adds
    beta * k (v - S^T k) = 0 and decays by exp(0) = 1), so the final state and the outputs at the
    row's tokens are the row's own; then the other sequences by `_recurrent_prefill_kernel`,
    which writes their outputs over the window's. The window starts at the step's first token,
    so it is the step's own tensors, not a gathered copy."""
    num_tokens = v.shape[0]
    width = width or num_tokens
    live, short = inputs.derived('gdn_long_window', lambda: _long_window(inputs, width))
    slot, index, fresh, first = inputs.derived('gdn_long_row_slot', lambda: _long_row_slot(
        inputs), from_state_index=True)
    acc = torch.promote_types(state_cache.dtype, torch.float32)
    initial = state_cache[slot, index].to(acc).masked_fill(fresh, 0)       # [1, nv, dk, dv]
    keep = live[:, None]
    o, final = chunk(_rows(q, width)[None], _rows(k, width)[None], _rows(v, width)[None],
                     torch.where(keep, _rows(g, width).to(acc), 0)[None],
                     torch.where(keep, _rows(beta, width), 0)[None], scale=q.shape[-1] ** -0.5,
                     initial_state=initial, output_final_state=True,
                     use_qk_l2norm_in_kernel=True)
    state_cache.index_put_((slot, first), final.to(state_cache.dtype))
    out = _rows(o[0].to(v.dtype), num_tokens).contiguous()
    start_loc = inputs.derived('gdn_q_start_loc', lambda: inputs.q_start_loc)
    return _launch(_recurrent_prefill_kernel, q, k, v, g, beta, state_cache, inputs, start_loc,
                   short, out=out, walks=inputs.derived('gdn_short_walks', lambda: _walks(short)))


@triton.jit
def _gating_kernel(a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, g_ptr, beta_ptr, stride_a, stride_b,
                   num_heads, BLOCK: tl.constexpr):
    """One token per program: g = -exp(A_log) * softplus(a + dt_bias) (torch's softplus:
    identity above 20), beta = sigmoid(b)."""
    row = tl.program_id(0)
    heads = tl.arange(0, BLOCK)
    mask = heads < num_heads
    a = tl.load(a_ptr + row * stride_a + heads, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + row * stride_b + heads, mask=mask, other=0.0).to(tl.float32)
    a_log = tl.load(a_log_ptr + heads, mask=mask, other=0.0).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + heads, mask=mask, other=0.0).to(tl.float32)
    x = a + dt_bias
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
    tl.store(g_ptr + row * num_heads + heads, -tl.exp(a_log) * softplus, mask=mask)
    beta = 1.0 / (1.0 + tl.exp(-b))
    tl.store(beta_ptr + row * num_heads + heads, beta.to(beta_ptr.dtype.element_ty), mask=mask)


def gdn_gating(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """`backends.default.gdn_gating` in one kernel (a, b may be row-strided views)."""
    if a.dtype == torch.float64 or a.shape[0] == 0 or a.stride(-1) != 1 or b.stride(-1) != 1:
        return reference.gdn_gating(a, b, A_log, dt_bias)
    num_tokens, num_heads = a.shape
    g = torch.empty(num_tokens, num_heads, dtype=torch.float32, device=a.device)
    beta = torch.empty(num_tokens, num_heads, dtype=b.dtype, device=b.device)
    _gating_kernel[(num_tokens,)](a, b, A_log, dt_bias, g, beta, a.stride(0), b.stride(0),
                                  num_heads, BLOCK=triton.next_power_of_2(num_heads))
    return g, beta
