"""FP8 weights in the layout of Qwen's released `-FP8` checkpoints: block-wise `float8_e4m3fn`
with one float32 `weight_scale_inv` per 128 x 128 block (the edge blocks may be partial), as
`quantization_config` = {"quant_method": "fp8", "weight_block_size": [128, 128], ...} declares
(no `weight_block_size` means [128, 128], as in transformers). Which modules stay unquantized the
tensors themselves tell (no scale, a bf16 dtype), whatever `modules_to_not_convert` lists (an FP8
weight it names is dequantized all the same, as transformers does); a weight with a scale must be
FP8 (a ValueError otherwise: transformers would multiply whatever it holds by the scales).

Reading one (`Fp8Weights.load`), each FP8 tensor is dequantized once, to float32: the weights
every backend computes with for now, and the reference an FP8 GEMM path is checked against.
`model_format='fp8'` quantizes a bf16 checkpoint's linear weights at load exactly as a released
checkpoint stores them (`quantize`), and dequantizes them again: the same numbers as loading the
pre-quantized checkpoint.

On a GPU with FP8 tensor cores (the CUDA backend's `fp8_linear`, sm_89+) `to_fp8` then quantizes
each such linear again, on the device and after TP sharding, before its projections are fused,
and the routed experts (nn/moe.FusedExperts, where the backend has `fp8_experts`: gate and up
quantized apart, so their shards' blocks never straddle the two, whatever I / tp is):
where the shard's blocks are the checkpoint's (every released shape: sections and shards are
multiples of 128), that gives back the checkpoint's FP8 values exactly (a dequantized value is
within bf16's 2^-9 of q * s, far inside FP8's 2^-4 half-spacing) and scales within 2^-9 of its.
"""
from __future__ import annotations

import json
import os

import torch
from safetensors import SafetensorError, safe_open

from ..backends.default.moe import BLOCK, dequantize_blocks

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max                       # 448
SCALE_SUFFIX = '_scale_inv'
# never quantized online (Qwen's FP8 releases keep them in bf16): embeddings, the LM head,
# routers and the small gates, the MTP head's fc, the vision tower
KEEP = ('embed_tokens.', 'lm_head.', 'mlp.gate.', 'shared_expert_gate.', 'mtp.fc.',
        'linear_attn.in_proj_a.', 'linear_attn.in_proj_b.', 'visual.')


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., N, K] -> (float8_e4m3fn [..., N, K], float32 scale [..., ceil(N/128), ceil(K/128)]):
    each 128 x 128 block scaled so that its largest magnitude is FP8's largest (448): scale =
    amax / 448, q = w / scale. (transformers' Fp8Quantize stores 1 / (448 / amax) and rounds
    w * (448 / amax): scales an ulp apart at times, ~0.1% of the codes one step apart.)"""
    *lead, n, k = weight.shape
    nb, kb = -(-n // BLOCK), -(-k // BLOCK)
    padded = torch.zeros(*lead, nb * BLOCK, kb * BLOCK, dtype=torch.float32, device=weight.device)
    padded[..., :n, :k] = weight.float()
    blocks = padded.view(*lead, nb, BLOCK, kb, BLOCK)
    scale = blocks.abs().amax(dim=(-3, -1)) / FP8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (blocks / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(*lead, nb * BLOCK, kb * BLOCK)[..., :n, :k].contiguous(), scale


def dequantize(weight: torch.Tensor, scale: torch.Tensor, where: str = '') -> torch.Tensor:
    """float8 [..., N, K] x its block scales [..., ceil(N/128), ceil(K/128)] -> float32;
    ValueError naming `where` (file: tensor) when the scales do not fit the weight."""
    if weight.dim() < 2:
        raise ValueError(f'{where}: float8 of shape {list(weight.shape)}; block scales need a '
                         f'matrix (or a stack of them)')
    *lead, n, k = weight.shape
    expected = (*lead, -(-n // BLOCK), -(-k // BLOCK))
    if tuple(scale.shape) != expected:
        raise ValueError(f'{where}: scales of shape {list(scale.shape)} for a weight of shape '
                         f'{list(weight.shape)}; 128 x 128 blocks need {list(expected)}')
    return dequantize_blocks(weight, scale)


class Fp8Weights:
    """How the tensors of one checkpoint are read when it is FP8 (or quantized online);
    `of()` is None for a plain checkpoint read as it is."""

    def __init__(self, files: dict[str, list[str]], online: bool):
        self.online = online
        self.scales = {name: path for path, names in files.items() for name in names
                       if name.endswith(SCALE_SUFFIX)}

    @classmethod
    def of(cls, model_dir: str, files: dict[str, list[str]],
           model_format: str | None = None) -> 'Fp8Weights | None':
        """ValueError naming config.json and the field for a quantization this cannot read."""
        path, quant = quantization_config(model_dir)
        if quant is None:
            return cls(files, online=True) if model_format == 'fp8' else None
        kind, block = quant.get('quant_method'), quant.get('weight_block_size', [BLOCK, BLOCK])
        if kind != 'fp8':
            raise ValueError(f'{path}: quantization_config.quant_method={kind!r}: only "fp8" '
                             f'(block-wise, as Qwen\'s FP8 releases) is supported')
        if list(block or ()) != [BLOCK, BLOCK]:
            raise ValueError(f'{path}: quantization_config.weight_block_size={block!r}: only '
                             f'[{BLOCK}, {BLOCK}] is supported')
        if quant.get('fmt', 'e4m3') != 'e4m3':
            raise ValueError(f'{path}: quantization_config.fmt={quant["fmt"]!r}: only "e4m3" '
                             f'is supported')
        return cls(files, online=False)

    def wanted(self, name: str) -> bool:
        """False for the scales: they are read with their weights."""
        return not name.endswith(SCALE_SUFFIX)

    def load(self, f, path: str, name: str) -> torch.Tensor:
        """Tensor `name` of the open file `f` (at `path`), dequantized if FP8; ValueError naming
        both when a weight and its scale disagree (either missing, wrong shapes, not FP8)."""
        tensor = f.get_tensor(name)
        where = f'{path}: tensor {name!r}'
        scale_path = self.scales.get(name + SCALE_SUFFIX)
        if scale_path is not None and tensor.dtype != FP8:
            raise ValueError(f'{where} is {tensor.dtype} but the checkpoint has '
                             f'{name + SCALE_SUFFIX!r}: a weight with block scales is stored as '
                             f'float8_e4m3fn')
        if tensor.dtype == FP8:
            if scale_path is None:
                raise ValueError(f'{where} is float8_e4m3fn but the checkpoint has no '
                                 f'{name + SCALE_SUFFIX!r}')
            return dequantize(tensor, self._scale(f, path, name, scale_path), where)
        if tensor.dtype.is_floating_point and tensor.element_size() == 1:
            raise ValueError(f'{where} is {tensor.dtype}; only float8_e4m3fn weights are read')
        if self.online and quantizable(name, tensor):
            return dequantize(*quantize(tensor))
        return tensor

    @staticmethod
    def _scale(f, path: str, name: str, scale_path: str) -> torch.Tensor:
        """Weight `name`'s scales, from `f` (at `path`) or from the shard the index names for
        them; ValueError naming that file when it cannot give them (a shard that lacks them)."""
        key = name + SCALE_SUFFIX
        try:
            if scale_path == path:
                return f.get_tensor(key)
            with safe_open(scale_path, 'pt', device='cpu') as other:
                return other.get_tensor(key)
        except SafetensorError as e:
            raise ValueError(f'{scale_path}: tensor {key!r} (the scales of {name!r}) cannot be '
                             f'read: {e}') from e


def quantization_config(model_dir: str) -> tuple[str, dict | None]:
    """(config.json's path, its `quantization_config`, top level or text_config's)."""
    path = os.path.join(model_dir, 'config.json')
    with open(path) as f:
        config = json.load(f)
    return path, config.get('quantization_config') or config.get('text_config', {}).get(
        'quantization_config')


def _fp8_device(device: torch.device | str) -> bool:
    """False on GPUs before sm_89 (no FP8 conversions or tensor cores)."""
    device = torch.device(device)
    return device.type != 'cuda' or torch.cuda.get_device_capability(device) >= (8, 9)


def fp8_matmul_for(device: torch.device | str):
    """The device backend's block-scaled FP8 GEMM, or None where there is none (CPU, GPUs before
    sm_89: the weights stay dequantized there)."""
    from ..backends import get_backend
    matmul = getattr(get_backend(device), 'fp8_linear', None)
    return matmul if matmul is not None and _fp8_device(device) else None


def fp8_experts_for(device: torch.device | str) -> bool:
    """Whether the device backend's MoE ops take FP8 experts with their scales (`fp8_experts`:
    the CUDA backend on sm_89+); elsewhere the experts stay dequantized."""
    from ..backends import get_backend
    return bool(getattr(get_backend(device), 'fp8_experts', False)) and _fp8_device(device)


def to_fp8(module: torch.nn.Module, device: torch.device | str, which, prefix: str = '',
           fp8_matmul=None, sizes_only: bool = False, experts: bool | None = None) -> int:
    """Every linear of `module` whose weight `which(prefix + its name)` picks (loader.fp8_linears)
    becomes FP8 blocks multiplied by `fp8_matmul(x, weight, scale)`: by default the device's
    (`fp8_matmul_for`), and no linear changes where there is none; so do the routed experts
    (`FusedExperts.to_fp8`, names `...experts.gate_up_proj` / `down_proj`) where `experts`
    (default `fp8_experts_for(device)`). `sizes_only`: convert both anyway (a module on the meta
    device, for its bytes; the CUDA backend has both from sm_89 on). Call before
    `fuse_projections`. Returns how many modules were converted."""
    from ..nn.linear import Linear
    from ..nn.moe import FusedExperts
    if not sizes_only:
        fp8_matmul = fp8_matmul or fp8_matmul_for(device)
    experts = (sizes_only or fp8_experts_for(device)) if experts is None else experts
    converted = 0
    for name, sub in module.named_modules():
        path = prefix + name
        if (isinstance(sub, Linear) and (fp8_matmul or sizes_only)
                and sub.weight_scale is None and which(f'{path}.weight')):
            sub.to_fp8(quantize, fp8_matmul)
        elif (isinstance(sub, FusedExperts) and experts and sub.gate_up_scale is None
              and which(f'{path}.gate_up_proj') and which(f'{path}.down_proj')):
            sub.to_fp8(quantize)
        else:
            continue
        converted += 1
    if converted and torch.device(device).type == 'cuda':
        torch.cuda.empty_cache()        # the bf16 copies' memory, back for the KV plan
    return converted


def reference_fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor
                         ) -> torch.Tensor:
    """What the GPU's `fp8_linear` computes, in float32: x [..., K] quantized per row and group
    of 128 as `quantize` does, times the dequantized weight; in x's dtype."""
    k = x.shape[-1]
    xq, xs = quantize(x.reshape(-1, 1, k))
    out = dequantize(xq, xs).view(-1, k) @ dequantize(weight, scale).T
    return out.to(x.dtype).view(*x.shape[:-1], -1)


def quantizable(name: str, tensor: torch.Tensor | None = None) -> bool:
    """A linear weight that Qwen's FP8 releases store in FP8 (online quantization's rule);
    `tensor`: the checkpoint's, a matrix or a stack of them."""
    module = name.rsplit('.', 2)[-2] if name.endswith('.weight') else ''
    linear = 'proj' in module or name.endswith(('experts.gate_up_proj', 'experts.down_proj'))
    return (linear and (tensor is None or tensor.dim() >= 2)
            and not any(k in name for k in KEEP))
