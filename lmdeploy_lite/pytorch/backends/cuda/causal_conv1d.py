"""Causal depthwise conv1d + SiLU on CUDA: Triton kernels for prefill (any lengths, read on the
device: no host sync, capturable in a CUDA graph) and decode/verify (uniform lengths). Shapes, conv
window buffer and pure-torch reference: `backends/default/causal_conv1d.py`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...model_inputs import ModelInputs
from ..default import causal_conv1d as reference

BLOCK_C = 256      # channels per program; >= 32 * num_warps, so no channel is held by two threads
PREFILL_BLOCK_T, PREFILL_BLOCK_C = 16, 128     # the prefill body kernel's tile (tokens, channels)


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
def _out_offsets(t, c, num_tokens, num_channels, split1, split2):
    """Where output (token t, channel c) goes in a flat buffer holding channels [0, split1),
    [split1, split2) and [split2, C) as three row-major [T, part] blocks, one after another
    (split1 = split2 = C: the one [T, C] block)."""
    start = tl.where(c >= split2, split2, tl.where(c >= split1, split1, 0))
    width = tl.where(c >= split2, num_channels - split2,
                     tl.where(c >= split1, split2 - split1, split1))
    return start.to(tl.int64) * num_tokens + t.to(tl.int64) * width + (c - start)


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


@triton.jit
def _prefill_body_kernel(
        x_ptr, weight_ptr, out_ptr, cache_ptr, token_offsets_ptr, num_tokens,
        stride_xt, stride_xc, stride_wc, stride_wk, num_channels, split1, split2,
        KERNEL: tl.constexpr, ACC: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """One program: tokens [BLOCK_T * pid_t, +BLOCK_T) x channels [BLOCK_C * pid_c, +BLOCK_C),
    the tokens at offset >= K-1 in their sequence, whose K taps are all new inputs (the first
    K-1 read the window: `_prefill_head_kernel`)."""
    pid_t, pid_c = tl.program_id(0), tl.program_id(1)
    rows = tl.arange(0, BLOCK_T)
    t = pid_t * BLOCK_T + rows
    offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    offset = tl.load(token_offsets_ptr + t, mask=t < num_tokens, other=0)
    mask = ((t < num_tokens) & (offset >= KERNEL - 1))[:, None] & (offs_c < num_channels)[None, :]
    # int32 offsets from the tile's first row (64-bit addresses per element cost registers)
    x_tile = x_ptr + (pid_t * BLOCK_T).to(tl.int64) * stride_xt
    x_offs = rows[:, None] * stride_xt + offs_c[None, :] * stride_xc
    conv = tl.zeros([BLOCK_T, BLOCK_C], dtype=ACC)
    for j in tl.static_range(KERNEL):     # out[t] = sum_j w[:, j] * x[t - (K-1) + j]
        w = tl.load(weight_ptr + offs_c * stride_wc + j * stride_wk, mask=offs_c < num_channels,
                    other=0.)
        col = tl.load(x_tile + x_offs + (j - (KERNEL - 1)) * stride_xt, mask=mask, other=0.)
        # x is rounded to the cache dtype, as the default op (and the stored window) does
        conv += w.to(ACC)[None, :] * col.to(cache_ptr.dtype.element_ty).to(ACC)
    out = conv / (1. + tl.exp(-conv))
    tl.store(out_ptr + _out_offsets(t[:, None], offs_c[None, :], num_tokens, num_channels, split1,
                                    split2), out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _prefill_head_kernel(
        x_ptr, weight_ptr, out_ptr, cache_ptr, state_slots_ptr, state_index_ptr,
        history_lens_ptr, q_start_loc_ptr, q_lens_ptr, stride_xt, stride_xc, stride_wc,
        stride_wk, stride_c0, stride_cc, stride_cw, num_tokens, num_channels, split1, split2,
        KERNEL: tl.constexpr, ACC: tl.constexpr, HEAD: tl.constexpr, BLOCK: tl.constexpr):
    """One program: sequence b, channels [BLOCK * pid_c, +BLOCK). The outputs of its first
    min(n, K-1) tokens (n = q_lens[b]), which read the old window, and, if n > 0, the new
    window full[n..n+K-2], stored to columns 0..K-2 of its row after a barrier: every read of
    the old window comes first. [HEAD >= K-1, BLOCK] tiles: token or window column h."""
    b, pid_c = tl.program_id(0), tl.program_id(1)
    offs_c = (pid_c * BLOCK + tl.arange(0, BLOCK))[None, :]
    heads = tl.arange(0, HEAD)[:, None]
    mask_c = offs_c < num_channels
    num_new = tl.load(q_lens_ptr + b)
    cache_row = cache_ptr + tl.load(state_slots_ptr + b).to(tl.int64) * stride_c0
    index = tl.load(state_index_ptr + b)
    has_history = tl.load(history_lens_ptr + b) > 0
    first_token = tl.load(q_start_loc_ptr + b)
    mask_out = mask_c & (heads < KERNEL - 1) & (heads < num_new)
    conv = tl.zeros([HEAD, BLOCK], dtype=ACC)
    for j in tl.static_range(KERNEL):
        w = tl.load(weight_ptr + offs_c * stride_wc + j * stride_wk, mask=mask_c, other=0.)
        conv += w.to(ACC) * _load_full(x_ptr, cache_row, offs_c, mask_out, heads + j,
                                       first_token, index, has_history, stride_xt, stride_xc,
                                       stride_cc, stride_cw, KERNEL, ACC)
    out = conv / (1. + tl.exp(-conv))
    tl.store(out_ptr + _out_offsets(first_token + heads, offs_c, num_tokens, num_channels,
                                    split1, split2),
             out.to(out_ptr.dtype.element_ty), mask=mask_out)
    mask_window = mask_c & (heads < KERNEL - 1) & (num_new > 0)
    window = _load_full(x_ptr, cache_row, offs_c, mask_window, num_new + heads, first_token,
                        index, has_history, stride_xt, stride_xc, stride_cc, stride_cw, KERNEL,
                        ACC)
    tl.debug_barrier()
    tl.store(cache_row + offs_c * stride_cc + heads * stride_cw,
             window.to(cache_ptr.dtype.element_ty), mask=mask_window)


def _token_offsets(q_start_loc: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Token t's sequence is the last b with q_start_loc[b] <= t (a 0-length sequence shares
    its successor's start)."""
    return tokens - q_start_loc[torch.searchsorted(q_start_loc, tokens, right=True) - 1]


def causal_conv1d_prefill(x: torch.Tensor, weight: torch.Tensor, conv_cache: torch.Tensor,
                          inputs: ModelInputs, parts: tuple[int, int, int] | None = None):
    """The default op's prefill for any lengths (0 included) read on the device: launch sizes
    come from T, C and B alone, so a step can be captured in a CUDA graph and replayed with other
    lengths of the same totals. Accumulates in fp32 (fp64 for fp64 x or cache). With `parts`,
    each part of the channels is written as its own contiguous [T, part] tensor (what the
    gated delta rule's kernels read, so no copy is made of them)."""
    (num_tokens, num_channels), num_seqs = x.shape, inputs.q_lens.numel()
    flat = torch.empty(num_tokens * num_channels, dtype=x.dtype, device=x.device)
    split1, split2 = (parts[0], parts[0] + parts[1]) if parts else (num_channels, num_channels)
    out = (tuple(flat[num_tokens * start:num_tokens * end].view(num_tokens, end - start)
                 for start, end in ((0, split1), (split1, split2), (split2, num_channels)))
           if parts else flat.view(num_tokens, num_channels))
    if num_tokens == 0:           # then every q_len is 0: nothing to store
        return out
    q_start_loc = inputs.derived('gdn_q_start_loc', lambda: inputs.q_start_loc)
    # each token's index among its sequence's new tokens, with static shapes (no host sync)
    token_offsets = inputs.derived(('conv_token_offsets', num_tokens), lambda: _token_offsets(
        q_start_loc, torch.arange(num_tokens, device=x.device)))
    acc = tl.float64 if torch.float64 in (x.dtype, conv_cache.dtype) else tl.float32
    kernel = weight.shape[1]
    grid = (triton.cdiv(num_tokens, PREFILL_BLOCK_T), triton.cdiv(num_channels, PREFILL_BLOCK_C))
    _prefill_body_kernel[grid](
        x, weight, flat, conv_cache, token_offsets, num_tokens, *x.stride(), *weight.stride(),
        num_channels, split1, split2, KERNEL=kernel, ACC=acc, BLOCK_T=PREFILL_BLOCK_T,
        BLOCK_C=PREFILL_BLOCK_C, num_warps=4)
    _prefill_head_kernel[(num_seqs, triton.cdiv(num_channels, BLOCK_C))](
        x, weight, flat, conv_cache, inputs.state_slots, inputs.state_index, inputs.history_lens,
        q_start_loc, inputs.q_lens, *x.stride(), *weight.stride(), *conv_cache.stride(),
        num_tokens, num_channels, split1, split2, KERNEL=kernel, ACC=acc,
        HEAD=triton.next_power_of_2(max(kernel - 1, 1)), BLOCK=BLOCK_C, num_warps=4)
    return out
