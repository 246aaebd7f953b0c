"""Load Qwen3.5 weights from a HF checkpoint directory (safetensors, single file or sharded).

Accepted layouts: text-only (`model.*`, `lm_head.weight`) and the released multimodal one
(`model.language_model.*` -> `model.*`, `model.visual.*` skipped). MoE experts may be fused
(`experts.gate_up_proj [E, 2I, H]`, `experts.down_proj [E, H, I]`) or per expert
(`experts.{e}.{gate,up,down}_proj.weight`). With `tie_word_embeddings` the checkpoint has no
`lm_head.weight`. `mtp.*` tensors belong to the MTP draft (`load_mtp_weights`).

Sharded models: a parameter with `expert_range` holds a slice of the experts (EP), one with
`shard` (nn/sharding.py) this TP rank's piece; the checkpoint tensor is checked against the FULL
shape config.json implies, then narrowed to this rank's part. `load_format='dummy'` (vLLM's, for
benchmarks from a config.json alone) reads no tensor: `init_dummy_weights` fills them.

FP8 on a device that computes FP8 experts: the routed experts are built on the meta device and
filled and converted one layer at a time after the rest (`fill_experts`): the 35B-A3B's experts
are 64 GB in bf16 but 32 GB in FP8, and one layer's are 1.6 GB.
"""
from __future__ import annotations

import json
import math
import os
import re
import zlib
from collections.abc import Iterator

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from ..config import ModelConfig
from ..nn.linear import column_major_weights, fuse_projections
from ..nn.moe import FusedExperts, experts_on_meta
from ..nn.norm import GatedRMSNorm, RMSNorm
from .fp8 import (SCALE_SUFFIX, Fp8Weights, fp8_experts_for, quantizable, quantization_config,
                  to_fp8)

SINGLE_FILE = 'model.safetensors'
INDEX_FILE = 'model.safetensors.index.json'
_PER_EXPERT = re.compile(r'^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$')


def checkpoint_files(model_dir: str) -> dict[str, list[str]]:
    """{safetensors file path: [tensor names]} of the checkpoint; ValueError if absent."""
    if not os.path.isdir(model_dir):
        raise ValueError(f'model_path={model_dir!r}: no such directory')
    index_path = os.path.join(model_dir, INDEX_FILE)
    single_path = os.path.join(model_dir, SINGLE_FILE)
    if os.path.isfile(index_path):
        with open(index_path) as f:
            weight_map = json.load(f)['weight_map']
        files: dict[str, list[str]] = {}
        for name, shard in weight_map.items():
            files.setdefault(os.path.join(model_dir, shard), []).append(name)
        for path in files:
            if not os.path.isfile(path):
                raise ValueError(f'{index_path}: lists shard {os.path.basename(path)!r}, '
                                 f'which is missing from {model_dir!r}')
        return files
    if os.path.isfile(single_path):
        with safe_open(single_path, 'pt', device='cpu') as f:
            return {single_path: list(f.keys())}
    raise ValueError(f'model_path={model_dir!r}: no weights found; expected {SINGLE_FILE} or '
                     f'{INDEX_FILE}')


def has_mtp_weights(model_dir: str) -> bool:
    """True when the checkpoint holds `mtp.*` tensors (the Qwen3.5 MTP draft head)."""
    return any(name.startswith('mtp.') for names in checkpoint_files(model_dir).values()
               for name in names)


def iter_tensors(model_dir: str, select, progress: bool = True, desc: str = 'Loading weights',
                 model_format: str | None = None) -> Iterator[tuple[str, str, tuple, callable]]:
    """Yield (file, name, shape, load) for checkpoint tensors with `select(name)` true; `load()`
    reads the tensor (an FP8 one dequantized with its scales, which are not yielded; with
    `model_format='fp8'` a bf16 linear weight quantized and dequantized: fp8.py)."""
    files = checkpoint_files(model_dir)
    fp8 = Fp8Weights.of(model_dir, files, model_format)
    wanted = select if fp8 is None else (lambda n: fp8.wanted(n) and select(n))
    total = sum(sum(1 for n in names if wanted(n)) for names in files.values())
    with tqdm(total=total, desc=desc, unit='tensor', disable=not progress) as bar:
        for path, names in files.items():
            if not any(wanted(n) for n in names):
                continue
            with safe_open(path, 'pt', device='cpu') as f:
                available = set(f.keys())
                for name in names:
                    if not wanted(name):
                        continue
                    if name not in available:
                        raise ValueError(f'{path}: tensor {name!r} is listed in the index but '
                                         f'missing from the file')
                    shape = tuple(f.get_slice(name).get_shape())
                    yield path, name, shape, (
                        (lambda f=f, name=name: f.get_tensor(name)) if fp8 is None else
                        (lambda f=f, path=path, name=name: fp8.load(f, path, name)))
                    bar.update(1)


def fp8_linears(model_dir: str, model_format: str | None, load_format: str = 'auto'):
    """Which linear weights, by the model's names (`model.layers...`, the draft's `mtp.`...), are
    FP8: None for a bf16 checkpoint read as it is; a released FP8 checkpoint's, those it stores
    in FP8 (what it keeps in bf16, its modules_to_not_convert, stays so); else (online
    quantization, dummy weights) the names `quantizable` picks."""
    quant = quantization_config(model_dir)[1]
    if quant is None and model_format != 'fp8':
        return None
    if quant is None or load_format == 'dummy':
        return quantizable
    stored = {_param_of(name[:-len(SCALE_SUFFIX)].replace('model.language_model.', 'model.', 1))
              for names in checkpoint_files(model_dir).values() for name in names
              if name.endswith(SCALE_SUFFIX)}
    return stored.__contains__


def _param_of(name: str) -> str:
    """The model parameter a checkpoint tensor fills (a per-expert one: its fused stack)."""
    match = _PER_EXPERT.match(name)
    if match is None:
        return name
    return f'{match.group(1)}.{"down_proj" if match.group(3) == "down_proj" else "gate_up_proj"}'


def load_module_weights(module: nn.Module, model_dir: str, prefix_map: dict[str, str],
                        skip: tuple[str, ...] = (), allow_missing: tuple[str, ...] = (),
                        progress: bool = True, desc: str = 'Loading weights',
                        model_format: str | None = None, within: str = '') -> None:
    """Copy checkpoint tensors into `module`'s parameters, matched by name: prefix_map maps a
    checkpoint prefix to a module prefix (first match wins); tensors matching no prefix or
    starting with a `skip` prefix are ignored. Only parameters named `within...` are filled,
    and none on the meta device (`experts_on_meta`: `fill_experts` loads them later). ValueErrors
    name the file, tensor and shapes on a mismatch, and list what is missing at the end."""
    every = dict(module.named_parameters(remove_duplicate=False))
    params = {n: p for n, p in every.items() if n.startswith(within) and not p.is_meta}
    filled: set[str] = set()
    expert_parts: dict[str, set] = {}

    def rename(name: str) -> str | None:
        if name.startswith(skip):
            return None
        for src, dst in prefix_map.items():
            if name.startswith(src):
                target = dst + name[len(src):]
                param = _param_of(target)            # (one not in `every`: an error below)
                mine = target.startswith(within) and (param in params or param not in every)
                return target if mine else None
        return None

    for path, name, shape, load in iter_tensors(
            model_dir, lambda n: rename(n) is not None, progress, desc, model_format):
        target = rename(name)
        match = _PER_EXPERT.match(target)
        if match:
            _load_expert(params, match, path, name, shape, load, expert_parts)
            continue
        if target not in params:
            raise ValueError(f'{path}: unexpected tensor {name!r} (no parameter {target!r} in '
                             f'{type(module).__name__})')
        param = params[target]
        _check_shape(path, name, shape, _full_shape(param))
        param.data.copy_(_rank_part(param, load()))
        filled.add(target)

    for pname, parts in expert_parts.items():
        num_experts = params[pname].shape[0]
        projs = ('down_proj',) if pname.endswith('down_proj') else ('gate_proj', 'up_proj')
        if len(parts) == num_experts * len(projs):
            filled.add(pname)
    missing = [p for p in params if p not in filled and not p.startswith(allow_missing)]
    if missing:
        shown = ', '.join(missing[:8]) + (f' (+{len(missing) - 8} more)' if len(missing) > 8 else '')
        raise ValueError(f'model_path={model_dir!r}: missing tensors for {shown}')


def _load_expert(params: dict, match: re.Match, path: str, name: str, shape: tuple, load,
                 expert_parts: dict[str, set]) -> None:
    """One per-expert tensor (`_PER_EXPERT` match) into this rank's slice of the fused
    parameter, recorded in `expert_parts[param name]` as (expert, proj); another EP rank's
    expert is skipped."""
    base, expert, proj = match.group(1), int(match.group(2)), match.group(3)
    pname = f'{base}.down_proj' if proj == 'down_proj' else f'{base}.gate_up_proj'
    if pname not in params:
        raise ValueError(f'{path}: unexpected tensor {name!r} (no parameter {pname!r})')
    param = params[pname]
    first, num_local, num_experts = param.expert_range
    inter = param.shape[2] if proj == 'down_proj' else param.shape[1] // 2   # this rank's
    if expert >= num_experts:
        raise ValueError(f'{path}: tensor {name!r}: expert {expert} out of range, '
                         f'config.json has num_experts={num_experts}')
    if not first <= expert < first + num_local:
        return                                          # another EP rank's expert
    local = expert - first
    dest = {'gate_proj': param.data[local, :inter], 'up_proj': param.data[local, inter:],
            'down_proj': param.data[local]}[proj]
    shard = getattr(param, 'shard', None)               # TP: a piece of each expert's I
    piece = shard.per_expert(int(proj == 'up_proj')) if shard else None
    _check_shape(path, name, shape, piece.full_shape(dest.shape) if piece else tuple(dest.shape))
    dest.copy_(piece.narrow(load()) if piece else load())
    expert_parts.setdefault(pname, set()).add((expert, proj))


def _full_shape(param) -> tuple:
    """The checkpoint shape of a (possibly EP- and/or TP-sharded) parameter."""
    shape = list(param.shape)
    if hasattr(param, 'expert_range'):
        shape[0] = param.expert_range[2]
    shard = getattr(param, 'shard', None)
    return shard.full_shape(shape) if shard else tuple(shape)


def _rank_part(param, full: torch.Tensor) -> torch.Tensor:
    """This rank's part of the full checkpoint tensor: its experts, then its TP piece."""
    if hasattr(param, 'expert_range'):
        first, num_local, _ = param.expert_range
        full = full[first:first + num_local]
    shard = getattr(param, 'shard', None)
    return shard.narrow(full) if shard else full


def _check_shape(path: str, name: str, shape: tuple, expected: tuple) -> None:
    if shape != expected:
        raise ValueError(f'{path}: tensor {name!r} has shape {list(shape)}, but config.json '
                         f'implies {list(expected)}')


def load_weights(model: nn.Module, model_dir: str, progress: bool = True,
                 model_format: str | None = None, within: str = '') -> None:
    """Load the target model (`Qwen3_5ForCausalLM`) from either released layout (`within`:
    load_module_weights')."""
    tied = model.config.tie_word_embeddings
    prefix_map = {'model.language_model.': 'model.', 'model.': 'model.'}
    if not tied:
        prefix_map['lm_head.'] = 'lm_head.'
    load_module_weights(model, model_dir, prefix_map, skip=('model.visual.', 'mtp.'),
                        allow_missing=('lm_head.',) if tied else (), progress=progress,
                        model_format=model_format, within=within)


def fill_experts(model: nn.Module, which, fill, progress: bool = False) -> None:
    """The routed experts built on the meta device (`experts_on_meta`), one layer at a time:
    allocated, filled (`fill(experts module, its name)`) and converted to FP8 where `which`
    picks them, so the device holds at most one layer's experts in the compute dtype."""
    deferred = [(name, sub) for name, sub in model.named_modules()
                if isinstance(sub, FusedExperts) and sub.gate_up_proj.is_meta]
    for name, sub in tqdm(deferred, desc='Loading experts', disable=not progress or not deferred):
        sub.materialize()
        fill(sub, name)
        to_fp8(sub, sub.device, which, prefix=name)


def load_mtp_state_dict(model_dir: str) -> dict[str, torch.Tensor]:
    """All `mtp.*` tensors of the checkpoint, names unchanged (experts as stored)."""
    return {name: load() for _, name, _, load in
            iter_tensors(model_dir, lambda n: n.startswith('mtp.'), progress=False)}


def load_mtp_weights(mtp: nn.Module, model_dir: str, progress: bool = True,
                     load_format: str = 'auto', seed: int = 0,
                     model_format: str | None = None) -> None:
    """Load `mtp.*` into the draft head (`Qwen3_5MTP`); its shared embed/lm_head are not loaded.
    `load_format='dummy'`: random weights instead (`init_dummy_weights`, names `mtp.*`). Then
    the projections are fused as `build_model` fuses them."""
    if load_format == 'dummy':
        init_dummy_weights(mtp, seed, prefix='mtp.')
    else:
        load_module_weights(mtp, model_dir, {'mtp.': ''},
                            allow_missing=('embed_tokens.', 'lm_head.'), progress=progress,
                            desc='Loading MTP weights', model_format=model_format)
    device = next(mtp.parameters()).device
    which = fp8_linears(model_dir, model_format, load_format)
    if which is not None:
        to_fp8(mtp, device, which, prefix='mtp.')
    column_major_weights(mtp)         # (its shared embedding and LM head are not its modules)
    fuse_projections(mtp, keep_parts=device.type != 'cuda')


DUMMY_STD = 0.02                  # matrices, conv kernels, embeddings, experts: normal(0, 0.02)
_DUMMY_DT_RANGE = (1e-3, 1e-1)    # gated delta net time step, log-uniform (Mamba's init)


@torch.no_grad()
def init_dummy_weights(module: nn.Module, seed: int = 0, prefix: str = '') -> None:
    """Fill every parameter of `module` in place, on its own device, with values that keep bf16
    activations sane (`_init_dummy`'s rules; a 1-D parameter matching none raises). Each
    parameter draws from its own generator seeded by `seed` and its checkpoint name (`prefix` +
    name), so values do not depend on construction order and replicated parameters are equal
    on every rank (a TP shard gets the same stream on every rank). Tied weights are filled once."""
    seen: set[int] = set()
    for module_name, sub in module.named_modules():
        for param_name, param in sub.named_parameters(recurse=False):
            if id(param) in seen or param.is_meta:      # meta: filled by fill_experts
                continue
            seen.add(id(param))
            name = f'{prefix}{module_name}.{param_name}' if module_name else prefix + param_name
            generator = torch.Generator(param.device)      # the CPU one keeps 32 seed bits
            generator.manual_seed(zlib.crc32(f'{seed}:{name}'.encode()))
            _init_dummy(sub, param_name, name, param, generator)


def _init_dummy(module: nn.Module, param_name: str, name: str, param: torch.Tensor,
                generator: torch.Generator) -> None:
    """Zero-centred `RMSNorm` weights 0 (scale 1 + w = 1); `GatedRMSNorm` weights 1; `A_log` =
    log(uniform(1, 16)); `dt_bias` = softplus^-1(dt), dt log-uniform in _DUMMY_DT_RANGE; biases
    0; every other (>= 2-D) tensor normal(0, DUMMY_STD)."""
    if isinstance(module, GatedRMSNorm):
        param.fill_(1.0)
    elif isinstance(module, RMSNorm) or param_name == 'bias':
        param.zero_()
    elif param_name in ('A_log', 'dt_bias'):
        uniform = torch.empty(param.shape, dtype=torch.float32, device=param.device)
        uniform.uniform_(generator=generator)
        if param_name == 'A_log':
            param.copy_(torch.log(1 + 15 * uniform))
        else:
            low, high = (math.log(x) for x in _DUMMY_DT_RANGE)
            dt = torch.exp(low + (high - low) * uniform)
            param.copy_(dt + torch.log(-torch.expm1(-dt)))            # softplus(dt_bias) = dt
    elif param.dim() >= 2:
        param.normal_(0.0, DUMMY_STD, generator=generator)
    else:
        raise ValueError(f'init_dummy_weights: no rule for the {param.dim()}-D parameter {name!r} '
                         f'of {type(module).__name__}')


def build_model(model_dir: str, dtype: torch.dtype = torch.bfloat16,
                device: torch.device | str = 'cpu', progress: bool = True,
                dist_ctx=None, load_format: str = 'auto', seed: int = 0,
                fuse: bool = True, model_format: str | None = None) -> nn.Module:
    """ModelConfig from config.json -> Qwen3_5ForCausalLM with weights loaded (this rank's
    shard under a DistContext), in eval mode. `load_format='dummy'`: random weights. `fuse`:
    same-input projections as one GEMM (off CUDA the parts stay, as views). `model_format=
    'fp8'`: the linear weights quantized as an FP8 checkpoint stores them (fp8.py)."""
    from .qwen3_5 import Qwen3_5ForCausalLM
    config = ModelConfig.from_pretrained(model_dir)
    which = fp8_linears(model_dir, model_format, load_format)
    with experts_on_meta(which is not None and fp8_experts_for(device)):
        model = Qwen3_5ForCausalLM(config, dtype, device, dist_ctx)
    if load_format == 'dummy':
        init_dummy_weights(model, seed)
        fill_experts(model, which, lambda experts, name: init_dummy_weights(experts, seed,
                                                                           f'{name}.'))
    else:
        load_weights(model, model_dir, progress=progress, model_format=model_format)
        fill_experts(model, which, lambda experts, name: load_weights(
            model, model_dir, progress=False, model_format=model_format, within=f'{name}.'),
            progress)
    if which is not None:
        to_fp8(model, device, which)
    column_major_weights(model, keep=(model.model.embed_tokens.weight,))      # CPU only
    if fuse:      # off CUDA the parts stay, so names and state_dict are the checkpoint's
        fuse_projections(model, keep_parts=torch.device(device).type != 'cuda')
    return model.eval()
