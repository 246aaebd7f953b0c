"""Causal depthwise conv1d + SiLU of the gated delta net over the conv window buffer
`conv_cache [num_state_slots, C, K - 1 + num_spec]` of raw (pre-conv) inputs (model_inputs.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...model_inputs import ModelInputs
from .norm import cast
from .varlen import seq_groups


def _conv(x: torch.Tensor, weight: torch.Tensor, conv_cache: torch.Tensor, inputs: ModelInputs,
          store_from: torch.Tensor, store_count: torch.Tensor) -> torch.Tensor:
    """silu(causal conv) of x [T, C] continuing each sequence's window, batched per group of
    sequences padded to their longest run: `full [n, C, K - 1 + max_q] = cat(window, x_b)`.
    Then stores `full[b, :, store_from[b] + c]` to column c of the sequence's conv row for
    c < store_count[b] (other columns keep their values; nothing is stored for q_lens[b] == 0)."""
    kernel, cols = weight.shape[1], torch.arange(conv_cache.shape[2], device=x.device)
    # current windows [B, C, K - 1] (a copy, so later writes are safe), zero for fresh sequences
    cached = conv_cache[inputs.state_slots]                             # [B, C, W]
    index = inputs.state_index[:, None, None] + cols[:kernel - 1]       # [B, 1, K - 1]
    windows = torch.gather(cached, 2, index.expand(-1, cached.shape[1], -1))
    windows = windows.masked_fill((inputs.history_lens == 0)[:, None, None], 0)
    out = torch.empty_like(x)
    groups = seq_groups(inputs, lambda n, max_q, _: n * x.shape[1] * (kernel - 1 + max_q))
    for group in groups:
        if group.max_q_len == 0:
            continue
        seqs = group.seqs
        padded = group.pad(x[group.tokens].to(conv_cache.dtype)).transpose(1, 2)   # [n, C, max_q]
        full = torch.cat([windows[seqs], padded], dim=2)
        conv = F.conv1d(full.to(weight.dtype), weight[:, None, :], groups=weight.shape[0])
        out[group.tokens] = group.unpad(F.silu(conv).transpose(1, 2)).to(x.dtype)
        src = (store_from[seqs, None] + cols).clamp(max=full.shape[2] - 1)           # [n, W]
        new = torch.gather(full, 2, src[:, None, :].expand(-1, full.shape[1], -1))
        keep = (cols[None, :] >= store_count[seqs, None]) | (group.q_lens == 0)[:, None]
        rows = inputs.state_slots[seqs]
        conv_cache[rows] = torch.where(keep[:, None, :], conv_cache[rows], new)
    return out


def causal_conv1d_prefill(x: torch.Tensor, weight: torch.Tensor, conv_cache: torch.Tensor,
                          inputs: ModelInputs, parts: tuple[int, int, int] | None = None):
    """x [T, C] raw inputs, weight [C, K] -> [T, C] (with `parts`, channel sizes: the three
    [T, part] pieces). Continues from the current window when `history_lens > 0` (chunked
    prefill); stores the last K-1 raw inputs in columns 0..K-2."""
    out = _conv(x, weight, conv_cache, inputs, store_from=inputs.q_lens,
                store_count=torch.full_like(inputs.q_lens, weight.shape[1] - 1))
    return out.split_with_sizes(parts, dim=-1) if parts else out


def _update_uniform(x: torch.Tensor, weight: torch.Tensor, conv_cache: torch.Tensor,
                    inputs: ModelInputs, num_new: int) -> torch.Tensor:
    """`causal_conv1d_update` when every sequence has `num_new` tokens (decode, verify): the
    rows read whole, the window taken at `state_index` only when the row holds more than one
    (speculative columns), the K taps as a multiply-sum over an unfolded window, one store."""
    kernel, width = weight.shape[1], conv_cache.shape[2]
    num_seqs, channels = inputs.q_lens.shape[0], x.shape[1]
    window = conv_cache.index_select(0, inputs.state_slots)                     # [B, C, W]
    if width > kernel - 1 and inputs.state_index_zero:
        window = window[:, :, :kernel - 1]
    elif width > kernel - 1:                # the same columns for every layer of the step
        cols = inputs.derived(('conv_window', kernel, channels), lambda: (
            inputs.state_index[:, None] + torch.arange(kernel - 1, device=x.device)
        )[:, None, :].expand(-1, channels, -1), from_state_index=True)
        window = torch.gather(window, 2, cols)
    if inputs.has_fresh_seqs:
        window = window.masked_fill((inputs.history_lens == 0)[:, None, None], 0)
    new = cast(x.view(num_seqs, num_new, channels).transpose(1, 2), conv_cache.dtype)
    full = torch.cat([window, new], dim=2)                                       # [B, C, K - 1 + n]
    conv = (cast(full.unfold(2, kernel, 1), weight.dtype) * weight[:, None, :]).sum(-1)  # [B, C, n]
    if kernel - 2 + num_new == width:                       # the whole row is rewritten
        conv_cache.index_copy_(0, inputs.state_slots, full[:, :, 1:])
    else:
        conv_cache[inputs.state_slots, :, :kernel - 2 + num_new] = full[:, :, 1:]
    return cast(F.silu(conv).transpose(1, 2).reshape(x.shape), x.dtype)


def causal_conv1d_update(x: torch.Tensor, weight: torch.Tensor, conv_cache: torch.Tensor,
                         inputs: ModelInputs) -> torch.Tensor:
    """Decode/verify over n = q_lens[b] tokens per sequence: x [T, C] -> [T, C]. Writes
    `cat(window, x_0..x_{n-1})[:, 1:]` to columns 0..K-3+n, so that after accepting a tokens the
    window at index a - 1 is the last K-1 raw inputs up to the accepted token."""
    if inputs.uniform_q_len:
        return _update_uniform(x, weight, conv_cache, inputs, inputs.uniform_q_len)
    return _conv(x, weight, conv_cache, inputs, store_from=torch.ones_like(inputs.q_lens),
                 store_count=inputs.q_lens + weight.shape[1] - 2)
