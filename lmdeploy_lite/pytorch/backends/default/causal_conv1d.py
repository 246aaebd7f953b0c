"""Causal depthwise conv1d + SiLU of the gated delta net, with the conv window buffer of
`model_inputs.py`: `conv_cache [num_state_slots, C, K - 1 + num_spec]` holds raw (pre-conv) inputs;
the current window of sequence b is `conv_cache[state_slots[b], :, state_index[b]:][:, :K - 1]`
(zeros when `history_lens[b] == 0`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...model_inputs import ModelInputs


def _windows(conv_cache: torch.Tensor, inputs: ModelInputs, width: int) -> torch.Tensor:
    """[B, C, width] current windows (zero for fresh sequences); a copy, so later writes are safe."""
    cols = inputs.state_index[:, None] + torch.arange(width, device=conv_cache.device)[None, :]
    rows = conv_cache[inputs.state_slots]                                # [B, C, W]
    win = torch.gather(rows, 2, cols[:, None, :].expand(-1, rows.shape[1], -1))
    fresh = (inputs.history_lens == 0)[:, None, None]
    return win.masked_fill(fresh, 0)


def _conv(full: torch.Tensor, weight: torch.Tensor, num_out: int) -> torch.Tensor:
    """full [C, K - 1 + n] raw inputs -> silu(conv) for the last n columns, [n, C]."""
    out = F.conv1d(full[None].to(weight.dtype), weight[:, None, :], groups=weight.shape[0])[0]
    return F.silu(out[:, -num_out:]).t()


def causal_conv1d_prefill(x: torch.Tensor, weight: torch.Tensor, conv_cache: torch.Tensor,
                          inputs: ModelInputs) -> torch.Tensor:
    """x [T, C] raw inputs, weight [C, K] -> [T, C]. Continues from the current window when
    `history_lens > 0` (chunked prefill); stores the last K-1 raw inputs in columns 0..K-2."""
    kernel = weight.shape[1]
    windows = _windows(conv_cache, inputs, kernel - 1)
    out = torch.empty_like(x)
    start = 0
    for b, q_len in enumerate(inputs.q_lens.tolist()):
        if q_len == 0:
            continue
        full = torch.cat([windows[b], x[start:start + q_len].t().to(conv_cache.dtype)], dim=1)
        out[start:start + q_len] = _conv(full, weight, q_len).to(x.dtype)
        conv_cache[inputs.state_slots[b], :, :kernel - 1] = full[:, -(kernel - 1):]
        start += q_len
    return out


def causal_conv1d_update(x: torch.Tensor, weight: torch.Tensor, conv_cache: torch.Tensor,
                         inputs: ModelInputs) -> torch.Tensor:
    """Decode/verify over n = q_lens[b] tokens per sequence: x [T, C] -> [T, C]. Writes
    `cat(window, x_0..x_{n-1})[:, 1:]` to columns 0..K-3+n, so that after accepting a tokens the
    window at index a - 1 is the last K-1 raw inputs up to the accepted token."""
    kernel = weight.shape[1]
    windows = _windows(conv_cache, inputs, kernel - 1)
    out = torch.empty_like(x)
    start = 0
    for b, q_len in enumerate(inputs.q_lens.tolist()):
        if q_len == 0:
            continue
        full = torch.cat([windows[b], x[start:start + q_len].t().to(conv_cache.dtype)], dim=1)
        out[start:start + q_len] = _conv(full, weight, q_len).to(x.dtype)
        conv_cache[inputs.state_slots[b], :, :kernel - 2 + q_len] = full[:, 1:]
        start += q_len
    return out
