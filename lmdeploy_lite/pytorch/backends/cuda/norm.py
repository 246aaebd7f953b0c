"""Triton RMSNorm variants (plain, residual add + norm, gated) and the SwiGLU activation;
references in `backends/default/norm.py`. One program per row (the whole row in registers: D up to
8192, e.g. the hidden size or a 128-wide head of the gated delta net's output norm). Math in
float32 (float64 for float64 inputs), rounded once at the end except where the reference rounds in
between (`gated_rms_norm`: the norm to x.dtype before the weight; `add_rms_norm`: the sum before
the norm). No host reads, no data-dependent shapes: safe inside a captured decode step.

`add_rms_norm` fuses the residual add into the next norm (one launch, the sum not read back) and
writes the sum into `residual` in place. Under CUDA graphs that is safe because `residual` is the
embedding's (or the MTP head's `fc`'s) output or a sum this op returned: intermediates from the
graph's pool that nothing reads after they are overwritten, each replay repeating the same writes.
On a graph's static input buffer a second replay would read the sum instead of the input, so
callers never pass one: `residual` is consumed, only the returned tensor is used afterwards (where
its rows are not one strided view, the sum goes to a copy instead).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[..., D] -> [R, D] with a unit stride on the last dim (a view where possible)."""
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


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
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, stride_x, stride_res, stride_out, dim, eps,
                         ACC: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < dim
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(ACC)
    res = tl.load(res_ptr + row * stride_res + offs, mask=mask, other=0.0).to(ACC)
    # the sum rounded to the activation dtype (a 16-bit add done in fp32 and rounded once is the
    # correctly rounded 16-bit sum, as torch computes it), then the norm from the rounded sum
    total = (res + x).to(res_ptr.dtype.element_ty)
    tl.store(res_ptr + row * stride_res + offs, total, mask=mask)
    total = total.to(ACC)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(ACC)
    rstd = tl.rsqrt(tl.sum(total * total, axis=0) / dim + eps)
    y = total * rstd * (1.0 + w)
    tl.store(out_ptr + row * stride_out + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def _heads(t: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """[..., D] -> (t, token stride, head stride, heads) with a unit last stride: row r of the
    [R, D] rows is head r % heads of token r // heads, read in place where t is a strided
    [T, heads, D] view (a split of a projection's output) rather than copied to rows."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    if t.dim() >= 3:
        t = t.reshape(-1, *t.shape[-2:])              # leading dims only: a view where possible
        return t, t.stride(0), t.stride(1), t.shape[1]
    t = t.reshape(-1, t.shape[-1])
    return t, t.stride(0), 0, 1


@triton.jit
def _row_offset(row, heads, stride_t, stride_h):
    return (row // heads) * stride_t + (row % heads) * stride_h


@triton.jit
def _gated_rms_norm_kernel(x_ptr, gate_ptr, w_ptr, out_ptr, stride_x, stride_gate, stride_gh,
                           gate_heads, stride_out, dim, eps, ACC: tl.constexpr,
                           BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < dim
    x_raw = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    x = x_raw.to(ACC)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / dim + eps)
    normed = (x * rstd).to(x_raw.dtype).to(ACC)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(ACC)
    y = (w * normed).to(x_raw.dtype).to(ACC)
    gate_row = gate_ptr + _row_offset(row, gate_heads, stride_gate, stride_gh)
    gate = tl.load(gate_row + offs, mask=mask, other=0.0).to(ACC)
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


def _norm(kernel, rows: list[torch.Tensor], weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Launch a norm kernel on `rows` ([R, D] each, x first) -> out [R, D] in x's dtype."""
    num_rows, dim = rows[0].shape
    out = torch.empty(rows[0].shape, dtype=rows[0].dtype, device=rows[0].device)
    if num_rows:
        block = triton.next_power_of_2(dim)
        kernel[(num_rows,)](*rows, weight, out, *(r.stride(0) for r in rows), out.stride(0), dim,
                            eps, ACC=_acc(out.dtype), BLOCK=block,
                            num_warps=min(16, max(1, block // 512)))
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _norm(_rms_norm_kernel, [_rows(x)], weight, eps).view(x.shape)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The default op's (rms_norm(s), s), s = residual + x, with `s` written into `residual` in
    place (module docstring): use the returned tensor, not `residual`, afterwards."""
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f'add_rms_norm: residual {tuple(residual.shape)} {residual.dtype} must '
                         f'match x {tuple(x.shape)} {x.dtype}')
    res_rows = _rows(residual)
    out = _norm(_add_rms_norm_kernel, [_rows(x), res_rows], weight, eps)
    return out.view(x.shape), res_rows.view(x.shape)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                   eps: float) -> torch.Tensor:
    rows = _rows(x)
    gate_rows, stride_t, stride_h, heads = _heads(gate)
    if gate_rows.numel() != rows.numel():
        raise ValueError(f'gated_rms_norm: gate {tuple(gate.shape)} must match x {tuple(x.shape)}')
    out = torch.empty_like(rows)
    if rows.shape[0]:
        block = triton.next_power_of_2(rows.shape[1])
        _gated_rms_norm_kernel[(rows.shape[0],)](
            rows, gate_rows, weight, out, rows.stride(0), stride_t, stride_h, heads, out.stride(0),
            rows.shape[1], eps, ACC=_acc(out.dtype), BLOCK=block,
            num_warps=min(16, max(1, block // 512)))
    return out.view(x.shape)


@triton.jit
def _rms_norm_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, stride_xt, stride_xh, heads,
                          stride_cos, stride_sin, stride_out, dim, eps, ACC: tl.constexpr,
                          ROTARY: tl.constexpr, BLOCK: tl.constexpr):
    """`_rms_norm_kernel` of one head's row, rounded, then the partial rotary of its first
    ROTARY channels as `apply_rotary` computes it, each product and the sum rounded to the dtype
    (the interpreter gives torch's bits; a GPU build may fuse a product with the sum: on an
    H100 ~5% of bf16 values are one unit of the last place apart). The rolled partner of
    channel j is normalised from its own input: the same bits as the norm's output there."""
    row = tl.program_id(0).to(tl.int64)
    token = row // heads
    x_row = x_ptr + _row_offset(row, heads, stride_xt, stride_xh)
    offs = tl.arange(0, BLOCK)
    mask = offs < dim
    x = tl.load(x_row + offs, mask=mask, other=0.0).to(ACC)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / dim + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(ACC)
    dtype = out_ptr.dtype.element_ty
    y = (x * rstd * (1.0 + w)).to(dtype)
    rot = offs < ROTARY
    partner = tl.where(offs < ROTARY // 2, offs + ROTARY // 2, offs - ROTARY // 2)
    xp = tl.load(x_row + partner, mask=rot, other=0.0).to(ACC)
    wp = tl.load(w_ptr + partner, mask=rot, other=0.0).to(ACC)
    yp = (xp * rstd * (1.0 + wp)).to(dtype)
    cos = tl.load(cos_ptr + token * stride_cos + offs, mask=rot, other=0.0).to(ACC)
    sin = tl.load(sin_ptr + token * stride_sin + offs, mask=rot, other=0.0).to(ACC)
    a = (y.to(ACC) * cos).to(dtype)
    b = (yp.to(ACC) * sin).to(dtype)
    rotated = (a.to(ACC) + b.to(ACC)).to(dtype)
    tl.store(out_ptr + row * stride_out + offs, tl.where(rot, rotated, y), mask=mask)


def rms_norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                  sin: torch.Tensor) -> torch.Tensor:
    """The default op's `apply_rotary(rms_norm(x))` in one launch, x [T, heads, D] read in place
    (a strided split of a projection's output), out contiguous [T, heads, D]."""
    rows, stride_t, stride_h, heads = _heads(x)
    num_rows, dim = rows.shape[0] * heads, rows.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if num_rows:
        block = triton.next_power_of_2(dim)
        _rms_norm_rope_kernel[(num_rows,)](
            rows, weight, cos, sin, out, stride_t, stride_h, heads, cos.stride(0), sin.stride(0),
            out.stride(1), dim, eps, ACC=_acc(x.dtype), ROTARY=cos.shape[-1], BLOCK=block,
            num_warps=min(16, max(1, block // 512)))
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    rows = _rows(gate_up)
    inter = rows.shape[1] // 2
    out = torch.empty(rows.shape[0], inter, dtype=gate_up.dtype, device=gate_up.device)
    if rows.shape[0] and inter:
        block = min(1024, triton.next_power_of_2(inter))
        grid = (rows.shape[0], triton.cdiv(inter, block))
        _silu_mul_kernel[grid](rows, out, rows.stride(0), out.stride(0), inter,
                               ACC=_acc(gate_up.dtype), BLOCK=block, num_warps=4)
    return out.view(*gate_up.shape[:-1], inter)
