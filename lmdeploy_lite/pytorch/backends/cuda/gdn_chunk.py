"""The gated delta rule over a prefill row in chunks of CHUNK tokens, on tensor cores: what
`gated_delta_rule._walk_row` computes token by token, for the rows of several tokens of a bf16
(or fp16) model's step, eager or captured alike (`_recurrent_prefill_kernel` with ROWS=3). A
walk pays each token's latency (~1.5-2.7 us a token a layer on an H200); a chunk is a handful of
small GEMMs and one CHUNK-step triangular solve. The math is the chunk (UT-transform) form of
`backends/default/gated_delta_rule`, per chunk with S the state before it and b the cumulative
log decay inside it:

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
def chunk_walk(state, tok, end, q_row, k_row, v_row, g_row, beta_row, out_row, stride_qt,
               stride_kt, stride_vt, stride_gt, stride_bt, stride_ot, mask_k, mask_v, scale,
               DOT: tl.constexpr):
    """State [BK, BV] (fp32) after tokens tok .. end - 1 of one value head, their outputs
    stored; the *_row pointers as `_walk_row` has them (token 0 of the head, [BK] or [BV]
    columns)."""
    offs_c = tl.arange(0, CHUNK)
    causal = offs_c[:, None] >= offs_c[None, :]
    while tok < end:                   # (Triton's interpreter takes no loaded bound in a range)
        t = tok + offs_c
        valid = t < end
        mask_qk, mask_tv = valid[:, None] & mask_k[None, :], valid[:, None] & mask_v[None, :]
        q = tl.load(q_row[None, :] + t[:, None] * stride_qt, mask=mask_qk, other=0.).to(tl.float32)
        k = tl.load(k_row[None, :] + t[:, None] * stride_kt, mask=mask_qk, other=0.).to(tl.float32)
        v = tl.load(v_row[None, :] + t[:, None] * stride_vt, mask=mask_tv, other=0.).to(tl.float32)
        g = tl.load(g_row + t * stride_gt, mask=valid, other=0.).to(tl.float32)
        beta = tl.load(beta_row + t * stride_bt, mask=valid, other=0.).to(tl.float32)
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
        tl.store(out_row[None, :] + t[:, None] * stride_ot, out.to(out_row.dtype.element_ty),
                 mask=mask_tv)
        to_end = tl.exp(last - decay)[:, None]
        state = tl.exp(last) * state + tl.dot(tl.trans(k * to_end), delta, input_precision=DOT)
        tok += CHUNK
    return state
