"""The gated delta rule over a prefill row in chunks of CHUNK tokens, on tensor cores: what
`gated_delta_rule._recurrent_prefill_kernel` computes token by token, for the rows of several
tokens of a bf16 (or fp16) model's step, eager or captured alike. A walk pays each token's
latency (~1.5-2.7 us a token a layer on an H200); a chunk is a handful of small GEMMs and one
CHUNK-step triangular solve, so a wave of 100-token prompts no longer costs a stream several
decode steps. The math is the chunk (UT-transform) form of `backends/default/gated_delta_rule`,
per chunk with S the state before it and b the cumulative log decay inside it:

    (I + L) D = diag(beta) (V - diag(e^b) K S),   L_ij = beta_i e^(b_i - b_j) k_i.k_j  (j < i)
    O = diag(e^b) Q S + (e^(b_i - b_j) q_i.k_j  (j <= i)) D
    S' = e^(b_last) S + (diag(e^(b_last - b)) K)^T D

D by forward substitution in fp32 (exact order), the products by `tl.dot` at DOT precision
('tf32' for bf16 models: its ~1e-3 relative error is below the activations' own rounding; the
interpreter computes them in fp32). Tokens past a row's end enter as zeros with no decay, which
leave the state as it was (the same padding rule as the chunk form's).
"""
from __future__ import annotations

import triton
import triton.language as tl

# tokens a chunk: tl.dot's smallest tile, and the substitution's length
CHUNK = tl.constexpr(16)


@triton.jit
def _chunk_prefill_kernel(
        q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr, state_ptr,
        state_slots_ptr, state_index_ptr, history_lens_ptr, q_start_loc_ptr, q_lens_ptr,
        walks_ptr, stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd,
        stride_vt, stride_vh, stride_vd, stride_gt, stride_gh, stride_bt, stride_bh,
        stride_ot, stride_oh, stride_od,
        stride_s0, stride_s1, stride_s2, stride_sk, stride_sv,
        scale, HEAD_RATIO: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
        BK: tl.constexpr, BV: tl.constexpr, DOT: tl.constexpr):
    """`_recurrent_prefill_kernel`'s arguments and its ROWS=2 rule (program i takes the i-th,
    (i + P)-th, .. of the rows `walks_ptr` lists), each row in chunks."""
    i, num_walks = tl.program_id(0), tl.load(walks_ptr)
    while i < num_walks:
        _chunk_row(tl.load(walks_ptr + 1 + i), q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr,
                   state_ptr, state_slots_ptr, state_index_ptr, history_lens_ptr,
                   q_start_loc_ptr, q_lens_ptr, stride_qt, stride_qh, stride_qd, stride_kt,
                   stride_kh, stride_kd, stride_vt, stride_vh, stride_vd, stride_gt, stride_gh,
                   stride_bt, stride_bh, stride_ot, stride_oh, stride_od, stride_s0, stride_s1,
                   stride_s2, stride_sk, stride_sv, scale, HEAD_RATIO, DK, DV, BK, BV, DOT)
        i += tl.num_programs(0)


@triton.jit
def _chunk_row(b, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr, state_ptr,
               state_slots_ptr, state_index_ptr, history_lens_ptr, q_start_loc_ptr, q_lens_ptr,
               stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd,
               stride_vt, stride_vh, stride_vd, stride_gt, stride_gh, stride_bt, stride_bh,
               stride_ot, stride_oh, stride_od,
               stride_s0, stride_s1, stride_s2, stride_sk, stride_sv,
               scale, HEAD_RATIO: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
               BK: tl.constexpr, BV: tl.constexpr, DOT: tl.constexpr):
    """Row b, value head and columns by program id: its tokens chunk by chunk from
    state[slot, state_index[b], h] (zero if fresh), the final state stored to state[slot, 0, h]."""
    h, pid_v = tl.program_id(1), tl.program_id(2)
    kh = h // HEAD_RATIO
    offs_k, offs_c = tl.arange(0, BK), tl.arange(0, CHUNK)
    offs_v = pid_v * BV + tl.arange(0, BV)
    mask_k, mask_v = offs_k < DK, offs_v < DV
    mask_s = mask_k[:, None] & mask_v[None, :]
    causal = offs_c[:, None] >= offs_c[None, :]

    num_tokens = tl.load(q_lens_ptr + b)
    start = tl.load(q_start_loc_ptr + b).to(tl.int64)
    slot = tl.load(state_slots_ptr + b).to(tl.int64)
    index = tl.load(state_index_ptr + b).to(tl.int64)
    has_history = tl.load(history_lens_ptr + b) > 0
    row = state_ptr + slot * stride_s0 + h * stride_s2
    tile = offs_k[:, None] * stride_sk + offs_v[None, :] * stride_sv
    state = tl.load(row + index * stride_s1 + tile, mask=mask_s & has_history & (num_tokens > 0),
                    other=0.).to(tl.float32)

    tok, end = start, start + num_tokens
    while tok < end:                   # (Triton's interpreter takes no loaded bound in a range)
        t = tok + offs_c
        valid = t < end
        mask_qk, mask_tv = valid[:, None] & mask_k[None, :], valid[:, None] & mask_v[None, :]
        q = tl.load(q_ptr + kh * stride_qh + t[:, None] * stride_qt + offs_k[None, :] * stride_qd,
                    mask=mask_qk, other=0.).to(tl.float32)
        k = tl.load(k_ptr + kh * stride_kh + t[:, None] * stride_kt + offs_k[None, :] * stride_kd,
                    mask=mask_qk, other=0.).to(tl.float32)
        v = tl.load(v_ptr + h * stride_vh + t[:, None] * stride_vt + offs_v[None, :] * stride_vd,
                    mask=mask_tv, other=0.).to(tl.float32)
        g = tl.load(g_ptr + h * stride_gh + t * stride_gt, mask=valid, other=0.).to(tl.float32)
        beta = tl.load(beta_ptr + h * stride_bh + t * stride_bt, mask=valid,
                       other=0.).to(tl.float32)
        q = q / tl.sqrt(tl.sum(q * q, 1) + 1e-6)[:, None] * scale
        k = k / tl.sqrt(tl.sum(k * k, 1) + 1e-6)[:, None]
        decay = tl.cumsum(g, 0)                                        # [C], log, <= 0
        last = tl.sum(tl.where(offs_c == CHUNK - 1, decay, 0.), 0)
        ratio = tl.where(causal, tl.exp(tl.where(causal, decay[:, None] - decay[None, :], 0.)),
                         0.)
        lower = tl.where(offs_c[:, None] > offs_c[None, :],
                         beta[:, None] * ratio * tl.dot(k, tl.trans(k), input_precision=DOT), 0.)
        to_start = tl.exp(decay)[:, None]
        delta = beta[:, None] * (v - to_start * tl.dot(k, state, input_precision=DOT))
        for r in tl.static_range(1, CHUNK):                            # (I + L) D = R
            lower_r = tl.sum(tl.where(offs_c[:, None] == r, lower, 0.), 0)
            fix = tl.sum(lower_r[:, None] * delta, 0)
            delta = tl.where(offs_c[:, None] == r, delta - fix[None, :], delta)
        out = to_start * tl.dot(q, state, input_precision=DOT) + tl.dot(
            ratio * tl.dot(q, tl.trans(k), input_precision=DOT), delta, input_precision=DOT)
        tl.store(out_ptr + h * stride_oh + t[:, None] * stride_ot + offs_v[None, :] * stride_od,
                 out.to(out_ptr.dtype.element_ty), mask=mask_tv)
        to_end = tl.exp(last - decay)[:, None]
        state = tl.exp(last) * state + tl.dot(tl.trans(k * to_end), delta, input_precision=DOT)
        tok += CHUNK
    tl.store(row + tile, state.to(state_ptr.dtype.element_ty), mask=mask_s & (num_tokens > 0))
