"""Block-scaled FP8 GEMM for Hopper (the layout of Qwen's FP8 checkpoints, models/fp8.py):
`y = x @ dequantize(w, w_scale).T` computed as FP8 x FP8 on the tensor cores. The activations are
quantized on the fly per token and per group of 128 channels (`quantize_activations`: one scale
per (row, group), the largest magnitude mapped to FP8's 448); each 128-wide K step of the GEMM
multiplies its FP8 product by the row's activation scale and the weight block's scale and
accumulates in fp32 (DeepSeek-V3's and the peers' w8a8 block scheme). No host reads and no
data-dependent shapes: every call may be captured in a CUDA graph.

Reference: `dequantize` the weights (models/fp8.py) and the quantized activations, multiply in
float32 (tests/pytorch/backends/cuda/test_cuda_fp8_gemm.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .paged_attention import num_sms

GROUP = 128                          # the K width of a scale block, activations and weights alike
FP8_MAX = 448.0


@triton.jit
def _quantize_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, num_groups,
                     GROUP_SIZE: tl.constexpr):
    row, group = tl.program_id(0), tl.program_id(1)
    cols = group * GROUP_SIZE + tl.arange(0, GROUP_SIZE)
    ok = cols < K
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    # IEEE divisions (Triton's `/` is approximate), so the values equal models/fp8.quantize's
    scale = tl.div_rn(tl.maximum(tl.max(tl.abs(x), axis=0), 1e-12), 448.0)
    q = tl.clamp(tl.div_rn(x, scale), -448.0, 448.0)
    tl.store(q_ptr + row * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(s_ptr + row * num_groups + group, scale)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] -> (float8_e4m3fn [M, K], float32 scales [M, ceil(K / 128)])."""
    m, k = x.shape
    groups = triton.cdiv(k, GROUP)
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty((m, groups), dtype=torch.float32, device=x.device)
    if m:
        _quantize_kernel[(m, groups)](x, q, scales, k, x.stride(0), q.stride(0), groups,
                                      GROUP_SIZE=GROUP)
    return q, scales


@triton.jit
def _gemm_kernel(a_ptr, a_s_ptr, b_ptr, b_s_ptr, c_ptr, M, N, K, num_groups, groups_per_split,
                 stride_am, stride_bn, stride_bsn, stride_cs, stride_cm,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """c[split, M, N] = sum over this split's K blocks of (a_blk @ b_blk.T) * a_scale[m, kb] *
    b_scale[n // 128, kb]; a [M, K] fp8 row-major, b [N, K] fp8 row-major (the weight as
    stored), BLOCK_K = 128. One split (the whole K) writes the output itself. (Quantizing a
    inside this loop instead of in `_quantize_kernel` measured 1.7-2.8x slower at one row on an
    H100: the converted operand breaks the loads' pipelining.)"""
    pid_n, pid_m, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok, n_ok = offs_m < M, offs_n < N
    a_rows = a_ptr + offs_m[:, None].to(tl.int64) * stride_am
    b_rows = b_ptr + offs_n[None, :].to(tl.int64) * stride_bn
    b_s_rows = b_s_ptr + (offs_n // BLOCK_K) * stride_bsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first = split * groups_per_split
    for kb in range(first, tl.minimum(first + groups_per_split, num_groups)):
        k = kb * BLOCK_K + offs_k
        k_ok = k < K
        a = tl.load(a_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_rows + k[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        a_s = tl.load(a_s_ptr + offs_m * num_groups + kb, mask=m_ok, other=0.0)
        b_s = tl.load(b_s_rows + kb, mask=n_ok, other=0.0)
        acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
    c = c_ptr + split * stride_cs + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _sum_splits_kernel(src_ptr, dst_ptr, size, splits, BLOCK: tl.constexpr):
    """dst[i] = sum over s of src[s, i] (fp32), in dst's dtype: split-K's partial sums."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < size
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for split in range(splits):
        acc += tl.load(src_ptr + split * size + offs, mask=ok, other=0.0)
    tl.store(dst_ptr + offs, acc.to(dst_ptr.dtype.element_ty), mask=ok)


def gemm_config(m: int, n: int, k: int, device: torch.device) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, splits, num_warps, num_stages) for an [m, k] x [n, k].T product: a
    function of the shapes only. A grid of tiles for fewer than half the SMs (decode: few rows,
    a narrow N) splits K over up to two programs per SM, at least 4 K blocks each, whose fp32
    partial sums are added after (split-K). Above 64 rows, 128 x 128 tiles with 8 warps where
    they give two per SM, else 64 x 64. Tuned with `bench_fp8_gemm.py --sweep` on an H100 at the
    0.8B and 9B shapes (at 1-64 rows the best of a grid was within 12% of this everywhere)."""
    sms = num_sms(device)
    if m > 64:
        if triton.cdiv(n, 128) * triton.cdiv(m, 128) >= 2 * sms:
            return 128, 128, 1, 8, 4
        return 64, 64, 1, 4, 3
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    tiles = triton.cdiv(n, 64) * triton.cdiv(m, block_m)
    groups = triton.cdiv(k, GROUP)
    splits = 1 if 2 * tiles > sms else min(2 * sms // tiles, max(1, groups // 4))
    return block_m, 64, triton.cdiv(groups, triton.cdiv(groups, splits)), 4, 4


def fp8_block_matmul(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor,
                     b_scale: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16,
                     config: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """a [M, K] fp8 with a_scale [M, ceil(K/128)]; b [N, K] fp8 (a weight as an FP8 checkpoint
    stores it) with b_scale [ceil(N/128), ceil(K/128)] -> [M, N] of `out_dtype`. `config`:
    `gemm_config`'s (for benchmarks)."""
    m, k = a.shape
    n = b.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0:
        return out
    block_m, block_n, splits, warps, stages = config or gemm_config(m, n, k, a.device)
    groups = triton.cdiv(k, GROUP)
    per_split = triton.cdiv(groups, splits)
    splits = triton.cdiv(groups, per_split)
    target = out if splits == 1 else torch.empty((splits, m, n), dtype=torch.float32,
                                                 device=a.device)
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m), splits)
    _gemm_kernel[grid](a, a_scale, b, b_scale, target, m, n, k, groups, per_split,
                       a.stride(0), b.stride(0), b_scale.stride(0),
                       0 if splits == 1 else target.stride(0), n,
                       BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=GROUP,
                       num_warps=warps, num_stages=stages)
    if splits > 1:
        _sum_splits_kernel[(triton.cdiv(m * n, 1024),)](target, out, m * n, splits, BLOCK=1024)
    return out


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor
               ) -> torch.Tensor:
    """x [..., K] (bf16/fp16/fp32) @ the FP8 weight [N, K].T -> [..., N] in x's dtype."""
    lead = x.shape[:-1]
    q, scales = quantize_activations(x.reshape(-1, x.shape[-1]))
    return fp8_block_matmul(q, scales, weight, weight_scale, x.dtype).reshape(*lead, -1)
