"""RoPE's cos/sin rows in one launch (reference: `backends/default/rotary.py`, nine launches).
On the GPU the angles go through libdevice's cosf/sinf, the functions torch's CUDA kernels call,
so the rows are torch's bits (tests/pytorch/backends/cuda/test_cuda_greedy.py); Triton's own
`tl.cos` may lower to an approximation whose error grows with the angle (positions up to 256k).
The interpreter (CPU) takes numpy's cos/sin instead."""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

BLOCK_T = 16


@triton.jit
def _rotary_kernel(pos_ptr, inv_freq_ptr, out_ptr, num_tokens, half, stride_out,
                   BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, LIBDEVICE: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    j = tl.arange(0, BLOCK_H)
    row_ok = rows < num_tokens
    pos = tl.load(pos_ptr + rows, mask=row_ok, other=0).to(tl.float32)
    freqs = pos[:, None] * tl.load(inv_freq_ptr + j, mask=j < half, other=0.0)[None, :]
    if LIBDEVICE:
        cos, sin = libdevice.cos(freqs), libdevice.sin(freqs)
    else:
        cos, sin = tl.cos(freqs), tl.sin(freqs)
    dtype = out_ptr.dtype.element_ty
    base = out_ptr + rows[:, None].to(tl.int64) * stride_out + j[None, :]
    mask = row_ok[:, None] & (j < half)[None, :]
    tl.store(base, cos.to(dtype), mask=mask)                 # cos: [f, f]
    tl.store(base + half, cos.to(dtype), mask=mask)
    tl.store(base + 2 * half, (-sin).to(dtype), mask=mask)   # sin: [-s, s]
    tl.store(base + 3 * half, sin.to(dtype), mask=mask)


def rotary_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The default op's (cos, sin) [T, R], as two views of one [T, 2R] buffer."""
    if inv_freq.dtype != torch.float32:                      # float64 models: torch's path
        from ..default.rotary import rotary_cos_sin as reference
        return reference(positions, inv_freq, dtype)
    half, num_tokens = inv_freq.numel(), positions.numel()
    out = torch.empty(num_tokens, 4 * half, dtype=dtype, device=positions.device)
    if num_tokens:
        _rotary_kernel[(triton.cdiv(num_tokens, BLOCK_T),)](
            positions, inv_freq, out, num_tokens, half, out.stride(0), BLOCK_T=BLOCK_T,
            BLOCK_H=triton.next_power_of_2(half), LIBDEVICE=positions.device.type == 'cuda',
            num_warps=1)
    return out[:, :2 * half], out[:, 2 * half:]
