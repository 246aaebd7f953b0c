"""Triton RMSNorm variants and the SwiGLU activation; references in `backends/default/norm.py`.

One program per row of the last dim (the whole row in registers: D up to 8192, e.g. the hidden
size, or a 128-wide head of the gated delta net's output norm). Math in float32 (float64 for
float64 inputs), one rounding at the end, except where the reference rounds in between
(`gated_rms_norm` rounds the norm to x.dtype before the weight). No host reads, no data-dependent
shapes: safe inside a captured decode step.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[..., D] -> [R, D] with a unit stride on the last dim (a view where possible)."""
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def _launch_config(dim: int) -> tuple[int, int]:
    block = triton.next_power_of_2(dim)
    return block, min(16, max(1, block // 512))


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_out, dim, eps,
                     ACC: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < dim
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(ACC)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(ACC)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / dim + eps)
    y = x * rstd * (1.0 + w)
    tl.store(out_ptr + row * stride_out + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gated_rms_norm_kernel(x_ptr, gate_ptr, w_ptr, out_ptr, stride_x, stride_gate, stride_out,
                           dim, eps, ACC: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < dim
    x_raw = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    x = x_raw.to(ACC)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / dim + eps)
    normed = (x * rstd).to(x_raw.dtype).to(ACC)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(ACC)
    y = (w * normed).to(x_raw.dtype).to(ACC)
    gate = tl.load(gate_ptr + row * stride_gate + offs, mask=mask, other=0.0).to(ACC)
    out = y * gate / (1.0 + tl.exp(-gate))
    tl.store(out_ptr + row * stride_out + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, stride_in, stride_out, inter,
                     ACC: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    gate = tl.load(gate_up_ptr + row * stride_in + offs, mask=mask, other=0.0).to(ACC)
    up = tl.load(gate_up_ptr + row * stride_in + inter + offs, mask=mask, other=0.0).to(ACC)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_out + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def _acc(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D], weight [D] -> `x * rsqrt(mean(x^2) + eps) * (1 + w)` [..., D] in x.dtype."""
    rows = _rows(x)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        block, warps = _launch_config(rows.shape[1])
        _rms_norm_kernel[(rows.shape[0],)](rows, weight, out, rows.stride(0), out.stride(0),
                                           rows.shape[1], eps, ACC=_acc(x.dtype), BLOCK=block,
                                           num_warps=warps)
    return out.view(x.shape)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                   eps: float) -> torch.Tensor:
    """x, gate [..., D], weight [D] -> `w * norm(x).to(x.dtype) * silu(gate)` [..., D] in
    x.dtype."""
    rows, gates = _rows(x), _rows(gate)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        block, warps = _launch_config(rows.shape[1])
        _gated_rms_norm_kernel[(rows.shape[0],)](rows, gates, weight, out, rows.stride(0),
                                                 gates.stride(0), out.stride(0), rows.shape[1],
                                                 eps, ACC=_acc(x.dtype), BLOCK=block,
                                                 num_warps=warps)
    return out.view(x.shape)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2I] (gate first) -> `silu(gate) * up` [..., I] in gate_up.dtype."""
    rows = _rows(gate_up)
    inter = rows.shape[1] // 2
    out = torch.empty(rows.shape[0], inter, dtype=gate_up.dtype, device=gate_up.device)
    if rows.shape[0] and inter:
        block = min(1024, triton.next_power_of_2(inter))
        grid = (rows.shape[0], triton.cdiv(inter, block))
        _silu_mul_kernel[grid](rows, out, rows.stride(0), out.stride(0), inter,
                               ACC=_acc(gate_up.dtype), BLOCK=block, num_warps=4)
    return out.view(*gate_up.shape[:-1], inter)
