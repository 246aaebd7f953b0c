"""RMSNorm variants of Qwen3.5 and the SwiGLU activation, in plain PyTorch. Norms compute in
float32 (float64 for float64 inputs) and cast back, with the very ops (so the very bits)
`F.rms_norm` runs on a CPU, without its two extra copies; on the CPU the constants (1, eps) are
cached 0-dim tensors rather than Python scalars that each op would wrap anew. Both save ~7 of
~19 us per decode-row norm on one core (~50 norms in a speculative step). `add_rms_norm` is
unfused here: the reference the CUDA kernel is checked against.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype for norms, softmax and recurrent state: float64 stays, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x.to(dtype)`, skipped where x has that dtype (~1 us of a decode step's no-op casts)."""
    return x if x.dtype == dtype else x.to(dtype)


_CONSTANTS: dict[tuple[float, torch.dtype], torch.Tensor] = {}


def constant(value: float, like: torch.Tensor) -> torch.Tensor | float:
    """`value` as a cached 0-dim CPU tensor of like.dtype (an op adds or multiplies it exactly as
    the Python scalar, rounded to that dtype); elsewhere the scalar itself (nothing is created
    inside a captured CUDA graph)."""
    if like.device.type != 'cpu':
        return value
    key = (value, like.dtype)
    cached = _CONSTANTS.get(key)
    if cached is None:
        cached = _CONSTANTS[key] = torch.tensor(value, dtype=like.dtype)
    return cached


def _normalized(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] in the compute dtype -> `x * rsqrt(mean(x^2) + eps)`, contiguous (F.rms_norm
    without weight, op for op)."""
    return (x * (x * x).mean(-1, keepdim=True).add_(constant(eps, x)).rsqrt_()).contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D], weight [D] -> `x * rsqrt(mean(x^2) + eps) * (1 + w)` [..., D] in x.dtype."""
    acc = compute_dtype(x.dtype)
    weight = cast(weight, acc)
    return cast(_normalized(cast(x, acc), eps).mul_(weight + constant(1.0, weight)), x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [..., D] (same dtype), weight [D] -> (rms_norm(s), s) with s = residual + x
    rounded to x.dtype: the norm reads the rounded sum, exactly as an add followed by `rms_norm`.
    The caller must use the returned residual and treat `residual` as consumed (the CUDA kernel
    writes the sum into it)."""
    new_residual = residual + x
    return rms_norm(new_residual, weight, eps), new_residual


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                   eps: float) -> torch.Tensor:
    """x, gate [..., D], weight [D] -> `w * norm(x).to(x.dtype) * silu(gate)` [..., D] in x.dtype
    (the gate's SiLU and the product in the compute dtype)."""
    acc = compute_dtype(x.dtype)
    y = weight * cast(_normalized(cast(x, acc), eps), x.dtype)
    return cast(y * F.silu(cast(gate, acc)), x.dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim]; cos/sin [T, rotary_dim] from `nn.rotary.RotaryEmbedding`.
    `x * cos + rotate_half(x) * sin` on x[..., :rotary_dim], rotate_half(x) = [-x2, x1] as the
    roll [x2, x1] times the sign-folded sin: the very same products, each op in x.dtype. A
    partial rotary writes its rows into x (the caller's own fresh tensor) instead of
    concatenating a copy."""
    rotary_dim = cos.shape[-1]
    x_rot = x[..., :rotary_dim]
    rotated = x_rot * cos[:, None, :] + x_rot.roll(rotary_dim // 2, -1) * sin[:, None, :]
    if rotary_dim == x.shape[-1]:
        return rotated
    x_rot.copy_(rotated)
    return x


def rms_norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                  sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] -> `apply_rotary(rms_norm(x))`: attention's q/k norm, then partial RoPE."""
    return apply_rotary(rms_norm(x, weight, eps), cos, sin)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2I] (gate first) -> `silu(gate) * up` [..., I] in gate_up.dtype."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
