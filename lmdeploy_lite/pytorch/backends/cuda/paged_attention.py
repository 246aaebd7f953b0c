"""Paged causal attention (GQA) over a block-table KV cache, in Triton. Semantics (cache layout,
which positions a query sees) are those of `backends/default/paged_attention.py`, the reference the
tests compare with. Softmax statistics, the accumulator and the dots' outputs are fp32 (fp32 inputs
multiply in IEEE fp32, not tf32). Kernels:
  * `_store_kv_kernel`: the step's k/v into their cache slots, one program per (token, KV head).
  * decode/verify (`inputs.is_decoding` with `uniform_q_len = n`): split-KV flash decoding.
    Program (b, KV head x row tile, split) takes the n * (nq / n_kv) query rows of one KV head
    (rows padded to >= 16 for tl.dot) over its share of the sequence's cache, `ceil(kv_len /
    num_splits)` rounded up to the KV tile, computed in the kernel from the device `history_lens`;
    `num_splits` depends only on shapes and the SM count, so the launch reads nothing on the host
    and can be captured in a CUDA graph. `_combine_kernel` merges the splits by log-sum-exp.
  * prefill (every other step): varlen flash attention over query tiles of the sequences of
    several new tokens, one program per (query tile, q head, split); the tile -> sequence map
    is built on the host, or on the device in a captured prefill (`inputs.sync_free`), whose
    programs are bounded by the step's shapes and each loop over the tiles in use. A step of
    few query tiles (a chunk of a long prompt beside decode rows) splits each tile's history
    over `prefill_num_splits` programs, so a chunk's attention over 8k cached tokens is not 64
    programs on 132 SMs; the splits are merged as decode's are. Its rows of one new token (a
    mixed step's decode rows) take the decode kernel (`VARLEN`) into the same splits. Scores
    never exceed one `[BLOCK_M, BLOCK_N]` tile.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ...model_inputs import ModelInputs
from ..default.paged_attention import fill_kv_cache as default_fill_kv_cache
from ..default.paged_attention import paged_attention as default_paged_attention

MAX_SPLITS = 64           # decode: most splits of one sequence's KV
LOG2E = 1.4426950408889634


@triton.jit(do_not_specialize=['stride_btb'])
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, seq_idx_ptr, offsets_ptr,
                     history_lens_ptr, block_tables_ptr,
                     stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
                     stride_kcb, stride_kcs, stride_kch, stride_kcd,
                     stride_vcb, stride_vcs, stride_vch, stride_vcd,
                     stride_btb, stride_btn,
                     HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_D: tl.constexpr,
                     Q_LEN: tl.constexpr):
    """Q_LEN > 0: every sequence has Q_LEN new tokens (seq_idx/offsets unread)."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    if Q_LEN > 0:
        seq = token // Q_LEN
        offset = token % Q_LEN
    else:
        seq = tl.load(seq_idx_ptr + token)
        offset = tl.load(offsets_ptr + token)
    pos = tl.load(history_lens_ptr + seq) + offset
    block = tl.load(block_tables_ptr + seq * stride_btb + (pos // BLOCK_SIZE) * stride_btn)
    slot = pos % BLOCK_SIZE
    d = tl.arange(0, BLOCK_D)
    d_valid = d < HEAD_DIM
    k = tl.load(k_ptr + token * stride_kt + head * stride_kh + d * stride_kd, mask=d_valid)
    v = tl.load(v_ptr + token * stride_vt + head * stride_vh + d * stride_vd, mask=d_valid)
    tl.store(k_cache_ptr + block * stride_kcb + slot * stride_kcs + head * stride_kch
             + d * stride_kcd, k.to(k_cache_ptr.dtype.element_ty), mask=d_valid)
    tl.store(v_cache_ptr + block * stride_vcb + slot * stride_vcs + head * stride_vch
             + d * stride_vcd, v.to(v_cache_ptr.dtype.element_ty), mask=d_valid)


@triton.jit
def _attend_tile(acc, m_i, l_i, q, q_pos, start, end, block_table_ptr, stride_btn,
                 k_head_ptr, stride_kb, stride_ks, stride_kd,
                 v_head_ptr, stride_vb, stride_vs, stride_vd, qk_scale, d, d_valid,
                 BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                 DOT_PRECISION: tl.constexpr):
    """One online-softmax step over cache positions start .. start + BLOCK_N - 1 (those < end).
    q [M, D] (query rows at cache positions q_pos [M]); acc [M, D], m_i, l_i [M] fp32 with
    m_i in log2 units. CAUSAL masks positions past each row's own."""
    pos = start + tl.arange(0, BLOCK_N)
    pos_valid = pos < end
    block = tl.load(block_table_ptr + (pos // BLOCK_SIZE) * stride_btn, mask=pos_valid, other=0)
    slot = pos % BLOCK_SIZE
    kv_mask = pos_valid[:, None] & d_valid[None, :]
    k = tl.load(k_head_ptr + block[:, None] * stride_kb + slot[:, None] * stride_ks
                + d[None, :] * stride_kd, mask=kv_mask, other=0.0)
    scores = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * qk_scale
    visible = pos_valid[None, :]
    if CAUSAL:
        visible = visible & (pos[None, :] <= q_pos[:, None])
    scores = tl.where(visible, scores, float('-inf'))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    m_safe = tl.where(m_new == float('-inf'), 0.0, m_new)    # a row with nothing visible yet
    probs = tl.exp2(scores - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    v = tl.load(v_head_ptr + block[:, None] * stride_vb + slot[:, None] * stride_vs
                + d[None, :] * stride_vd, mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(probs.to(q.dtype), v.to(q.dtype),
                                        input_precision=DOT_PRECISION)
    l_i = l_i * alpha + tl.sum(probs, 1)
    return acc, m_new, l_i


@triton.jit(do_not_specialize=['stride_btb'])
def _decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, history_lens_ptr,
                   span_ptr, q_start_loc_ptr, q_lens_ptr, o_ptr, lse_ptr, qk_scale,
                   stride_qt, stride_qh, stride_qd,
                   stride_kb, stride_ks, stride_kh, stride_kd,
                   stride_vb, stride_vs, stride_vh, stride_vd,
                   stride_btb, stride_btn,
                   stride_ot, stride_oh, stride_os, stride_od,
                   stride_lt, stride_lh, stride_ls,
                   Q_LEN: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr, M_TILES: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                   DOT_PRECISION: tl.constexpr, VARLEN: tl.constexpr = False):
    """Grid (B, n_kv * M_TILES, NUM_SPLITS). Row r of a KV head is new token r // GROUP, q head
    kv_head * GROUP + r % GROUP. A split covers at least span_ptr[0] positions (a multiple of
    BLOCK_N), so a short sequence's later splits are empty and a long one's are not. Each split's
    rows as `_store_split` writes them. `VARLEN` (Q_LEN 1, a prefill or mixed step's rows of one
    new token): sequence b's token is q_start_loc[b], rows of other lengths are left alone, and a
    split covers whole KV tiles of its own sequence alone (no span), as `_prefill_kernel`'s."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1) // M_TILES
    rows = (tl.program_id(1) % M_TILES) * BLOCK_M + tl.arange(0, BLOCK_M)
    split = tl.program_id(2)
    row_valid = rows < Q_LEN * GROUP
    token = seq * Q_LEN + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    d = tl.arange(0, BLOCK_D)
    d_valid = d < HEAD_DIM

    history = tl.load(history_lens_ptr + seq)
    kv_len = history + Q_LEN
    if VARLEN:
        live = tl.load(q_lens_ptr + seq) == 1
        token = tl.load(q_start_loc_ptr + seq) + rows * 0
        row_valid = row_valid & live
        kv_len = tl.where(live, kv_len, 0)
        split_len = tl.cdiv(tl.cdiv(kv_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    else:
        split_len = tl.maximum(tl.cdiv(tl.cdiv(kv_len, NUM_SPLITS), BLOCK_N) * BLOCK_N,
                               tl.load(span_ptr))
    start = split * split_len
    end = tl.minimum(start + split_len, kv_len)

    q_mask = row_valid[:, None] & d_valid[None, :]
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh
                + d[None, :] * stride_qd, mask=q_mask & (start < end), other=0.0)
    q_pos = history + rows // GROUP
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float('-inf'), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    block_table_ptr = block_tables_ptr + seq * stride_btb
    for tile_start in range(start, end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, q_pos, tile_start, end, block_table_ptr, stride_btn,
            k_cache_ptr + kv_head * stride_kh, stride_kb, stride_ks, stride_kd,
            v_cache_ptr + kv_head * stride_vh, stride_vb, stride_vs, stride_vd,
            qk_scale, d, d_valid, BLOCK_SIZE, BLOCK_N, True, DOT_PRECISION)

    _store_split(o_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh
                 + split * stride_os + d[None, :] * stride_od,
                 lse_ptr + token * stride_lt + head * stride_lh + split * stride_ls,
                 acc, m_i, l_i, q_mask, row_valid, NUM_SPLITS)


@triton.jit
def _store_split(o_ptrs, lse_ptrs, acc, m_i, l_i, q_mask, row_valid, NUM_SPLITS: tl.constexpr):
    """A split's rows normalised by their own sum and (NUM_SPLITS > 1) their log2-sum-exp; a
    split that saw no position writes -inf (its weight in `_combine_kernel`: 0, its rows not
    read), or zeros as the output itself (one split)."""
    has_sum = l_i > 0
    out = acc / tl.where(has_sum, l_i, 1.0)[:, None]
    if NUM_SPLITS > 1:
        q_mask = q_mask & has_sum[:, None]
    tl.store(o_ptrs, out.to(o_ptrs.dtype.element_ty), mask=q_mask)
    if NUM_SPLITS > 1:
        lse = tl.where(has_sum, m_i + tl.log2(tl.where(has_sum, l_i, 1.0)), float('-inf'))
        tl.store(lse_ptrs, lse, mask=row_valid)


@triton.jit
def _combine_kernel(o_split_ptr, lse_ptr, out_ptr,
                    stride_st, stride_sh, stride_ss, stride_sd,
                    stride_lt, stride_lh, stride_ls,
                    stride_ot, stride_oh, stride_od,
                    HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
                    BLOCK_D: tl.constexpr):
    """Grid (T, nq): out = sum_s w_s o_s / sum_s w_s with w_s = 2^(lse_s - max lse), over the
    splits `_store_split` wrote (a row that saw no position at all: 0)."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    written = splits < NUM_SPLITS
    lse = tl.load(lse_ptr + token * stride_lt + head * stride_lh + splits * stride_ls,
                  mask=written, other=float('-inf'))
    top = tl.max(lse, 0)
    weights = tl.exp2(lse - tl.where(top == float('-inf'), 0.0, top))
    d = tl.arange(0, BLOCK_D)
    d_valid = d < HEAD_DIM
    seen = written & (lse > float('-inf'))             # an empty split wrote no rows
    o = tl.load(o_split_ptr + token * stride_st + head * stride_sh + splits[:, None] * stride_ss
                + d[None, :] * stride_sd, mask=seen[:, None] & d_valid[None, :], other=0.0)
    total = tl.sum(weights, 0)
    out = tl.sum(o * weights[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + d * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=d_valid)


@triton.jit(do_not_specialize=['stride_btb', 'stride_tiles'])
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, o_ptr, lse_ptr, block_tables_ptr,
                    tiles_ptr, q_start_loc_ptr, q_lens_ptr, history_lens_ptr, qk_scale,
                    stride_qt, stride_qh, stride_qd,
                    stride_kb, stride_ks, stride_kh, stride_kd,
                    stride_vb, stride_vs, stride_vh, stride_vd,
                    stride_btb, stride_btn, stride_ot, stride_oh, stride_os, stride_od,
                    stride_lt, stride_lh, stride_ls, stride_tiles,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                    NUM_SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Grid (P, nq, NUM_SPLITS). tiles [2, n + 1]: (sequence, first new-token index) of each
    query tile, the number of tiles in use at [0, n]; program p takes tiles p, p + P, ... of
    those. Cache positions before the tile's first query are visible to all its rows (no
    causal mask), in NUM_SPLITS shares of whole KV tiles; the rest, up to the tile's last query,
    are masked and go to the last split. Each split's rows as `_store_split` writes them."""
    head = tl.program_id(1)
    split = tl.program_id(2)
    kv_head = head // GROUP
    d = tl.arange(0, BLOCK_D)
    d_valid = d < HEAD_DIM
    k_head_ptr = k_cache_ptr + kv_head * stride_kh
    v_head_ptr = v_cache_ptr + kv_head * stride_vh
    index = tl.program_id(0)
    num_tiles = tl.load(tiles_ptr + stride_tiles - 1)
    while index < num_tiles:           # (Triton's interpreter takes no loaded bound in a range)
        seq = tl.load(tiles_ptr + index)
        first = tl.load(tiles_ptr + stride_tiles + index)
        q_len = tl.load(q_lens_ptr + seq)
        history = tl.load(history_lens_ptr + seq)
        rows = first + tl.arange(0, BLOCK_M)
        row_valid = rows < q_len
        token = tl.load(q_start_loc_ptr + seq) + rows
        q_mask = row_valid[:, None] & d_valid[None, :]
        q = tl.load(q_ptr + token[:, None] * stride_qt + head * stride_qh
                    + d[None, :] * stride_qd, mask=q_mask, other=0.0)
        q_pos = history + rows
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], float('-inf'), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        block_table_ptr = block_tables_ptr + seq * stride_btb
        seen_by_all = history + first
        unmasked_end = (seen_by_all // BLOCK_N) * BLOCK_N
        share = tl.cdiv(unmasked_end // BLOCK_N, NUM_SPLITS) * BLOCK_N
        for tile_start in range(split * share, tl.minimum(split * share + share, unmasked_end),
                                BLOCK_N):
            acc, m_i, l_i = _attend_tile(
                acc, m_i, l_i, q, q_pos, tile_start, seen_by_all, block_table_ptr, stride_btn,
                k_head_ptr, stride_kb, stride_ks, stride_kd, v_head_ptr, stride_vb, stride_vs,
                stride_vd, qk_scale, d, d_valid, BLOCK_SIZE, BLOCK_N, False, DOT_PRECISION)
        end = tl.minimum(history + q_len, seen_by_all + BLOCK_M)
        for tile_start in range(tl.where(split == NUM_SPLITS - 1, unmasked_end, end), end,
                                BLOCK_N):
            acc, m_i, l_i = _attend_tile(
                acc, m_i, l_i, q, q_pos, tile_start, end, block_table_ptr, stride_btn,
                k_head_ptr, stride_kb, stride_ks, stride_kd, v_head_ptr, stride_vb, stride_vs,
                stride_vd, qk_scale, d, d_valid, BLOCK_SIZE, BLOCK_N, True, DOT_PRECISION)
        _store_split(o_ptr + token[:, None] * stride_ot + head * stride_oh + split * stride_os
                     + d[None, :] * stride_od, lse_ptr + token * stride_lt + head * stride_lh
                     + split * stride_ls, acc, m_i, l_i, q_mask, row_valid, NUM_SPLITS)
        index += tl.num_programs(0)


def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def _tile_sizes(q: torch.Tensor) -> tuple[int, int]:
    """(largest query-row tile, KV tile). fp32 takes small tiles: its IEEE dots run on FMA units
    with both operands in registers."""
    if q.dtype == torch.float32:
        return 32, 16
    return 64, 32 if q.shape[-1] > 128 else 64


def _decode_tiles(q: torch.Tensor, rows: int) -> tuple[int, int, int]:
    """(row tile, KV tile, row tiles) of the decode kernel for `rows` query rows per KV head
    (new tokens x GQA group), the row tile at least 16 for tl.dot."""
    max_block_m, block_n = _tile_sizes(q)
    block_m = min(max_block_m, max(16, triton.next_power_of_2(rows)))
    return block_m, block_n, triton.cdiv(rows, block_m)


# A prefill step of more tokens than this (eager: T; captured: its bucket, so both pick the same
# tiles for a step) with 16-bit heads wider than 128 takes (LONG_TILES) query and KV tiles:
# 2.4-2.7x the shipped (64, 32) at an 8k prompt, 1.75x at 2k, on an H100 at the 0.8B and 9B
# attention shapes (tune_prefill_attention.py; BENCHMARKS.md)
LONG_PREFILL_TOKENS = 512
LONG_TILES = (128, 64)


def _prefill_tile_sizes(q: torch.Tensor) -> tuple[int, int]:
    if q.dtype != torch.float32 and q.shape[-1] > 128 and q.shape[0] > LONG_PREFILL_TOKENS:
        return LONG_TILES
    return _tile_sizes(q)


def _launch_options(q: torch.Tensor, block_m: int, block_d: int) -> dict:
    """BLOCK_D, the dots' precision (fp32: IEEE, not tf32), warps for the accumulator's size; two
    pipeline stages where K/V rows are wide (fp32 at head_dim 256) or the query tile is (128
    rows), so their shared memory fits."""
    wide = q.dtype == torch.float32 or block_m * block_d >= 64 * 128
    return dict(BLOCK_D=block_d, DOT_PRECISION='ieee' if q.dtype == torch.float32 else 'tf32',
                num_warps=8 if wide else 4,
                num_stages=2 if q.element_size() * block_d > 512 or block_m > 64 else 3)


@functools.cache
def num_sms(device: torch.device) -> int:
    """SMs of a CUDA device; 4 under Triton's interpreter (CPU), to keep it to a few programs."""
    if device.type != 'cuda':
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def decode_num_splits(num_programs: int, max_kv_tiles: int, num_sms: int) -> int:
    """Splits of each sequence's KV for `num_programs` (B * n_kv * row tiles) programs: enough
    for about two waves over the SMs, at most MAX_SPLITS and at most the KV tiles a block table
    can address. Host values only (a CUDA graph replays the launch for any kv lengths)."""
    return max(1, min(MAX_SPLITS, triton.cdiv(2 * num_sms, num_programs), max_kv_tiles))


# decode: a batch's splits may number up to SPREAD x `decode_num_splits` (its even share), so
# that one long sequence among short ones is split that much finer; `split_span` keeps the
# splits of a batch of equal lengths as they were, the later ones empty
SPREAD = 4


@triton.jit
def _split_span_kernel(history_lens_ptr, span_ptr, num_seqs, splits, Q_LEN: tl.constexpr,
                       BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr):
    b = tl.arange(0, BLOCK_B)
    total = tl.sum(tl.load(history_lens_ptr + b, mask=b < num_seqs, other=0), 0)
    total += Q_LEN * num_seqs
    span = (total + splits - 1) // splits
    tl.store(span_ptr, tl.maximum((span + BLOCK_N - 1) // BLOCK_N * BLOCK_N, BLOCK_N))


def split_span(history_lens: torch.Tensor, q_len: int, splits: int,
               block_n: int) -> torch.Tensor:
    """[1] long on the device: the fewest positions a decode split covers, the batch's KV
    positions shared evenly by `splits` splits (the even share's count for every sequence),
    whole KV tiles: a batch of equal lengths splits as evenly as before, and a sequence of L
    positions takes about L / span splits (at most the launch's) wherever its length sits
    among the others'. One launch, device values only: graph-capturable."""
    span = torch.empty(1, dtype=torch.long, device=history_lens.device)
    history_lens = history_lens.contiguous()        # the kernel reads it at unit stride
    num_seqs = history_lens.numel()
    _split_span_kernel[(1,)](history_lens, span, num_seqs, splits, Q_LEN=q_len,
                             BLOCK_B=triton.next_power_of_2(max(num_seqs, 1)), BLOCK_N=block_n,
                             num_warps=1)
    return span


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             inputs: ModelInputs) -> None:
    """The default `fill_kv_cache` in one kernel (no host sync when `uniform_q_len` is set)."""
    if k.dtype == torch.float64:          # float64 (reference runs): the plain-PyTorch op
        return default_fill_kv_cache(k, v, k_cache, v_cache, inputs)
    num_tokens, n_kv, head_dim = k.shape
    q_len = inputs.uniform_q_len or 0          # uniform: the kernel derives seq and offset
    seq_idx, offsets = ((inputs.history_lens, inputs.history_lens) if q_len else
                        (inputs.token_seq_idx, inputs.token_offsets))
    _store_kv_kernel[(num_tokens, n_kv)](
        k, v, k_cache, v_cache, seq_idx, offsets, inputs.history_lens,
        inputs.block_tables, *k.stride(), *v.stride(), *k_cache.stride(), *v_cache.stride(),
        *inputs.block_tables.stride(),
        HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1], BLOCK_D=_block_d(head_dim), Q_LEN=q_len)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     inputs: ModelInputs, scale: float,
                     num_splits: int | None = None) -> torch.Tensor:
    """q [B * n, nq, d] with n = `inputs.uniform_q_len` new tokens per sequence, already in the
    caches -> [B * n, nq, d]. Sync-free and graph-capturable. `num_splits` (default SPREAD x
    `decode_num_splits`, within the block table's KV tiles) is exposed for tests."""
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, n_kv, _ = k_cache.shape
    q_len, group = inputs.uniform_q_len, num_heads // n_kv
    batch = num_tokens // q_len
    block_m, block_n, m_tiles = _decode_tiles(q, q_len * group)
    even = num_splits
    if num_splits is None:
        max_kv_tiles = triton.cdiv(inputs.block_tables.shape[1] * block_size, block_n)
        even = decode_num_splits(batch * n_kv * m_tiles, max_kv_tiles, num_sms(q.device))
        num_splits = min(MAX_SPLITS, max_kv_tiles, SPREAD * even)
    span = inputs.derived(('decode_split_span', block_n, even), lambda: split_span(
        inputs.history_lens, q_len, even * batch, block_n))
    out, o_split, lse = _split_outputs(q, num_splits)
    block_d = _block_d(head_dim)
    _decode_kernel[(batch, n_kv * m_tiles, num_splits)](
        q, k_cache, v_cache, inputs.block_tables, inputs.history_lens, span, span, span,
        o_split, lse,
        scale * LOG2E, *q.stride(), *k_cache.stride(), *v_cache.stride(),
        *inputs.block_tables.stride(), *o_split.stride(),
        *(lse.stride() if num_splits > 1 else (0, 0, 0)),
        Q_LEN=q_len, GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        NUM_SPLITS=num_splits, M_TILES=m_tiles, BLOCK_M=block_m, BLOCK_N=block_n,
        **_launch_options(q, block_m, block_d))
    if num_splits > 1:
        _combine(o_split, lse, out)
    return out


def _split_outputs(q: torch.Tensor, num_splits: int):
    """(out, the kernels' split outputs, their lse): the final output itself for one split."""
    out = torch.empty_like(q)
    if num_splits == 1:
        return out, out.unsqueeze(2), out            # lse is not written
    num_tokens, num_heads, head_dim = q.shape
    return (out, q.new_empty(num_tokens, num_heads, num_splits, head_dim, dtype=torch.float32),
            q.new_empty(num_tokens, num_heads, num_splits, dtype=torch.float32))


def _combine(o_split: torch.Tensor, lse: torch.Tensor, out: torch.Tensor) -> None:
    num_tokens, num_heads, num_splits, head_dim = o_split.shape
    _combine_kernel[(num_tokens, num_heads)](
        o_split, lse, out, *o_split.stride(), *lse.stride(), *out.stride(), HEAD_DIM=head_dim,
        NUM_SPLITS=num_splits, BLOCK_S=triton.next_power_of_2(num_splits),
        BLOCK_D=_block_d(head_dim))


def _host_tiles(inputs: ModelInputs, block_m: int) -> torch.Tensor:
    """[2, n + 1]: (sequence, first new-token index) of every query tile of the sequences of
    more than one new token, longest KV first (the programs that run longest start first), from
    the host lengths; column n holds n."""
    q_lens = torch.tensor(inputs.host_q_lens)
    histories = torch.tensor(inputs.host_kv_lens) - q_lens
    tiles_per_seq = torch.where(q_lens > 1, (q_lens + block_m - 1) // block_m, 0)
    seq = torch.repeat_interleave(torch.arange(len(q_lens)), tiles_per_seq)
    first = (torch.arange(seq.numel()) - (torch.cumsum(tiles_per_seq, 0) - tiles_per_seq)[seq])
    first = first * block_m
    longest_first = torch.argsort(histories[seq] + first, descending=True)
    count = torch.full((2, 1), seq.numel())
    return torch.cat([torch.stack([seq, first])[:, longest_first], count], 1).contiguous()


def _device_tiles(inputs: ModelInputs, block_m: int, num_tokens: int) -> torch.Tensor:
    """`_host_tiles` in sequence order, built on the device with shapes from T and B alone (a
    captured step): room for T / block_m + B tiles, the count in use in the last column."""
    q_lens = inputs.q_lens
    tiles_per_seq = torch.where(q_lens > 1, (q_lens + block_m - 1) // block_m, 0)
    ends = torch.cumsum(tiles_per_seq, 0)
    index = torch.arange(triton.cdiv(num_tokens, block_m) + q_lens.numel(), device=q_lens.device)
    seq = torch.searchsorted(ends, index, right=True).clamp_(max=q_lens.numel() - 1)
    first = (index - ends[seq] + tiles_per_seq[seq]) * block_m
    count = ends[-1:].view(1, 1).expand(2, 1)
    return torch.cat([torch.stack([seq, first]), count], 1).contiguous()


def prefill_num_splits(q: torch.Tensor) -> int:
    """Splits of each query tile's history: 16-bit steps of at most 2048 tokens, where a long
    prompt's chunk is a few query tiles, take 2-8 (about 2 programs per SM for the chunk's tiles
    at 8-16 heads); bounds at powers of two, which are CUDA graph buckets, so that an eager step
    and its captured bucket split alike. fp32 (tests): 1."""
    tokens = q.shape[0]
    if q.dtype == torch.float32 or tokens > 2048:
        return 1
    return 8 if tokens <= 512 else 4 if tokens <= 1024 else 2


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      inputs: ModelInputs, scale: float,
                      num_splits: int | None = None) -> torch.Tensor:
    """q [T, nq, d] (any q_lens and history_lens; the step's k/v already in the caches) ->
    [T, nq, d]. Rows of one new token (a mixed step's decode rows) take the decode kernel
    (`VARLEN`), the others query tiles of `_prefill_kernel`: a one-token row would fill one row
    of a tile. The tile map comes from the host lengths, or is built on the device when the step
    is captured (`inputs.sync_free`), where the programs are bounded by the shapes and loop over
    the tiles in use; the same for every layer of a forward. `num_splits` (default
    `prefill_num_splits`) is exposed for tests."""
    num_heads, head_dim = q.shape[1:]
    block_size, n_kv = k_cache.shape[1:3]
    (block_m, block_n), block_d = _prefill_tile_sizes(q), _block_d(head_dim)
    num_splits = prefill_num_splits(q) if num_splits is None else num_splits
    if inputs.sync_free:
        tiles = inputs.derived(('attention_tiles', block_m),
                               lambda: _device_tiles(inputs, block_m, q.shape[0]))
        programs = min(tiles.shape[1] - 1, triton.cdiv(q.shape[0], block_m) + triton.cdiv(
            4 * num_sms(q.device), num_heads * num_splits))
    else:
        tiles = inputs.derived(('attention_tiles', block_m),
                               lambda: _host_tiles(inputs, block_m).to(q.device))
        programs = tiles.shape[1] - 1
    out, o_split, lse = _split_outputs(q, num_splits)
    if programs:
        _prefill_kernel[(programs, num_heads, num_splits)](
            q, k_cache, v_cache, o_split, lse, inputs.block_tables, tiles, inputs.q_start_loc,
            inputs.q_lens, inputs.history_lens, scale * LOG2E, *q.stride(), *k_cache.stride(),
            *v_cache.stride(), *inputs.block_tables.stride(), *o_split.stride(),
            *(lse.stride() if num_splits > 1 else (0, 0, 0)), tiles.stride(0),
            GROUP=num_heads // n_kv, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
            NUM_SPLITS=num_splits, BLOCK_M=block_m, BLOCK_N=block_n,
            **_launch_options(q, block_m, block_d))
    if inputs.sync_free or 1 in inputs.host_q_lens:
        _one_token_rows(q, k_cache, v_cache, inputs, scale, o_split, lse, num_splits)
    if num_splits > 1:
        _combine(o_split, lse, out)
    return out


def _one_token_rows(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    inputs: ModelInputs, scale: float, o_split: torch.Tensor, lse: torch.Tensor,
                    num_splits: int) -> None:
    """`prefill_attention`'s rows of one new token, into its split outputs: the decode kernel's
    program per (sequence, KV head, split) over the GROUP query heads of the row's token."""
    num_heads, head_dim = q.shape[1:]
    n_kv = k_cache.shape[2]
    block_m, block_n, m_tiles = _decode_tiles(q, num_heads // n_kv)
    lens = inputs.history_lens
    _decode_kernel[(lens.numel(), n_kv * m_tiles, num_splits)](
        q, k_cache, v_cache, inputs.block_tables, lens, lens, inputs.q_start_loc, inputs.q_lens,
        o_split, lse, scale * LOG2E, *q.stride(), *k_cache.stride(), *v_cache.stride(),
        *inputs.block_tables.stride(), *o_split.stride(),
        *(lse.stride() if num_splits > 1 else (0, 0, 0)),
        Q_LEN=1, GROUP=num_heads // n_kv, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        NUM_SPLITS=num_splits, M_TILES=m_tiles, BLOCK_M=block_m, BLOCK_N=block_n, VARLEN=True,
        **_launch_options(q, block_m, _block_d(head_dim)))


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, inputs: ModelInputs, scale: float) -> torch.Tensor:
    """The default op. Decode/verify steps (`is_decoding` with `uniform_q_len`) take the split-KV
    kernel and keep the decode-step contract; others the varlen prefill kernel."""
    if q.shape[0] == 0:
        return torch.empty_like(q)
    if q.dtype == torch.float64:          # float64 (reference runs): the plain-PyTorch op
        return default_paged_attention(q, k, v, k_cache, v_cache, inputs, scale)
    store_kv(k, v, k_cache, v_cache, inputs)
    if inputs.is_decoding and inputs.uniform_q_len is not None:
        return decode_attention(q, k_cache, v_cache, inputs, scale)
    return prefill_attention(q, k_cache, v_cache, inputs, scale)
