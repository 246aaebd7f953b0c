"""Causal depthwise conv1d + SiLU on CUDA: a Triton kernel for decode/verify, the default op for
prefill. Shapes, conv window buffer and pure-torch reference: `backends/default/causal_conv1d.py`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...model_inputs import ModelInputs
from ..default import causal_conv1d as reference

causal_conv1d_prefill = reference.causal_conv1d_prefill
BLOCK_C = 256      # channels per program; >= 32 * num_warps, so no channel is held by two threads


@triton.jit
def _load_full(x_ptr, cache_row, offs_c, mask_c, i, first_token, index, has_history,
               stride_xt, stride_xc, stride_cc, stride_cw, KERNEL: tl.constexpr, ACC: tl.constexpr):
    """Column i of `full = cat(window, x_0..x_{n-1})` for the block's channels, in ACC: window
    column i < K-1 is cache column index + i (zero if the sequence is fresh); else token
    i - (K-1) of the sequence."""
    in_window = i < KERNEL - 1
    cached = tl.load(cache_row + offs_c * stride_cc + (index + i) * stride_cw,
                     mask=mask_c & in_window & has_history, other=0.)
    tok = first_token + i - (KERNEL - 1)
    new = tl.load(x_ptr + tok * stride_xt + offs_c * stride_xc, mask=mask_c & (i >= KERNEL - 1),
                  other=0.)
    # x is rounded to the cache dtype, as the default op (and the stored window) does
    return tl.where(in_window, cached.to(ACC), new.to(cache_row.dtype.element_ty).to(ACC))


@triton.jit
def _conv_update_kernel(
        x_ptr, weight_ptr, out_ptr, cache_ptr, state_slots_ptr, state_index_ptr, history_lens_ptr,
        stride_xt, stride_xc, stride_wc, stride_wk, stride_ot, stride_oc,
        stride_c0, stride_cc, stride_cw, num_channels, NUM_TOKENS: tl.constexpr,
        KERNEL: tl.constexpr, ACC: tl.constexpr, BLOCK: tl.constexpr):
    """One program: sequence b, channels [BLOCK * pid_c, +BLOCK). Every cache column is read
    before it is written, by the thread that owns the channel (stores go to columns 0.. in order;
    column c is read at step c - index - 1 < c)."""
    b, pid_c = tl.program_id(0), tl.program_id(1)
    offs_c = pid_c * BLOCK + tl.arange(0, BLOCK)
    mask_c = offs_c < num_channels
    slot = tl.load(state_slots_ptr + b).to(tl.int64)
    index = tl.load(state_index_ptr + b).to(tl.int64)
    has_history = tl.load(history_lens_ptr + b) > 0
    cache_row = cache_ptr + slot * stride_c0
    first_token = (b * NUM_TOKENS).to(tl.int64)

    for t in range(NUM_TOKENS):
        conv = tl.zeros([BLOCK], dtype=ACC)
        for j in tl.static_range(KERNEL):
            w = tl.load(weight_ptr + offs_c * stride_wc + j * stride_wk, mask=mask_c, other=0.)
            col = _load_full(x_ptr, cache_row, offs_c, mask_c, t + j, first_token, index,
                             has_history, stride_xt, stride_xc, stride_cc, stride_cw, KERNEL, ACC)
            conv += w.to(ACC) * col
        out = conv / (1. + tl.exp(-conv))
        tl.store(out_ptr + (first_token + t) * stride_ot + offs_c * stride_oc,
                 out.to(out_ptr.dtype.element_ty), mask=mask_c)

    # columns 0..K-3+n <- full[1..K-2+n]
    for column in range(KERNEL - 2 + NUM_TOKENS):
        col = _load_full(x_ptr, cache_row, offs_c, mask_c, column + 1, first_token, index,
                         has_history, stride_xt, stride_xc, stride_cc, stride_cw, KERNEL, ACC)
        tl.store(cache_row + offs_c * stride_cc + column * stride_cw,
                 col.to(cache_ptr.dtype.element_ty), mask=mask_c)


def causal_conv1d_update(x: torch.Tensor, weight: torch.Tensor, conv_cache: torch.Tensor,
                         inputs: ModelInputs) -> torch.Tensor:
    """The default op with no host sync when every sequence has `inputs.uniform_q_len` tokens
    (decode, verify); steps whose sequences have different lengths take the default op."""
    if inputs.uniform_q_len is None:
        return reference.causal_conv1d_update(x, weight, conv_cache, inputs)
    num_channels = x.shape[1]
    out = torch.empty_like(x)
    grid = (inputs.q_lens.numel(), triton.cdiv(num_channels, BLOCK_C))
    _conv_update_kernel[grid](
        x, weight, out, conv_cache, inputs.state_slots, inputs.state_index, inputs.history_lens,
        *x.stride(), *weight.stride(), *out.stride(), *conv_cache.stride(),
        num_channels, NUM_TOKENS=inputs.uniform_q_len,
        KERNEL=weight.shape[1], BLOCK=BLOCK_C, num_warps=4,
        ACC=tl.float64 if conv_cache.dtype == torch.float64 else tl.float32)
    return out
