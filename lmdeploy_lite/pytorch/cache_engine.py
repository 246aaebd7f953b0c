"""Per-rank cache tensors of the model and of the MTP draft (its own full-attention KV), at the
owning model's `tp` (the draft's own tp for its cache); counts from `plan_cache`.
`caches[layer_idx]` is the layer's tuple (slots: model_inputs.py):
  full-attention:   (k_cache, v_cache), each [num_blocks, block_size, num_kv_heads / tp (1
                    where tp is a multiple of num_kv_heads: nn/attention.py), head_dim], model
                    dtype;
  linear-attention: (conv_state [num_state_slots, conv_dim / tp, K - 1 + num_spec], model dtype,
                     channel-minor (stride 1 over channels: a window column is contiguous),
                     recurrent_state [num_state_slots, 1 + num_spec, nv / tp, dk, dv], state_dtype).
`snapshots`: `num_snapshots` rows per linear-attention layer of what a prefill leaves in a state
slot (recurrent slot 0, conv columns 0..K-2) for the prefix cache."""
from __future__ import annotations

import math
import mmap

import torch

from lmdeploy_lite.pytorch.config import CacheConfig, ModelConfig, head_replicas


_STATE_DTYPES = {'float32': torch.float32, 'bfloat16': torch.bfloat16, 'float16': torch.float16}


def state_dtype(dtype: torch.dtype, ssm_state_dtype: str = 'auto',
                model_config: ModelConfig | None = None) -> torch.dtype:
    """The dtype the recurrent state is STORED in (the kernels compute it in fp32, fp64 for a
    float64 model, whatever it is stored in). ssm_state_dtype is PytorchEngineConfig's:
    'auto' is fp64 for a float64 model, else the checkpoint's text_config.mamba_ssm_dtype
    (float32 for Qwen3.5; float32 when absent); 'float32' / 'bfloat16' as named."""
    if ssm_state_dtype != 'auto':
        return _STATE_DTYPES[ssm_state_dtype]
    if dtype == torch.float64:
        return torch.float64
    hf = model_config.hf_config if model_config is not None else {}
    name = (hf.get('text_config') or hf).get('mamba_ssm_dtype') or 'float32'
    if name not in _STATE_DTYPES:
        raise ValueError(f'text_config.mamba_ssm_dtype={name!r} in config.json: must be one of '
                         f'{tuple(_STATE_DTYPES)}; or set ssm_state_dtype to float32 or bfloat16')
    return _STATE_DTYPES[name]


def _per_rank(what: str, count: int, tp: int) -> int:
    if tp < 1 or count % tp:
        raise ValueError(f'tp={tp}: must be >= 1 and divide {what}={count}')
    return count // tp


def kv_shape(model_config: ModelConfig, num_blocks: int, block_size: int, tp: int = 1) -> tuple:
    """One full-attention layer's K (or V) cache on one TP rank."""
    heads = model_config.num_key_value_heads
    if tp > heads:                    # one (replicated) head per rank, where tp allows it
        heads = heads * head_replicas('num_key_value_heads', heads, tp)
    return (num_blocks, block_size, _per_rank('num_key_value_heads', heads, tp),
            model_config.head_dim)


def state_shapes(model_config: ModelConfig, num_state_slots: int, num_spec_tokens: int,
                 tp: int = 1) -> tuple[tuple, tuple]:
    """(conv, recurrent) state shapes of one linear-attention layer on one TP rank."""
    mc = model_config
    _per_rank('linear_num_key_heads', mc.linear_num_key_heads, tp)
    conv = (num_state_slots, mc.linear_conv_dim // tp,
            mc.linear_conv_kernel_dim - 1 + num_spec_tokens)
    rec = (num_state_slots, 1 + num_spec_tokens,
           _per_rank('linear_num_value_heads', mc.linear_num_value_heads, tp),
           mc.linear_key_head_dim, mc.linear_value_head_dim)
    return conv, rec


def fresh_zeros(shape: tuple, dtype: torch.dtype, device) -> torch.Tensor:
    """torch.zeros; on the CPU in fresh anonymous pages (an mmap, unmapped with the tensor),
    which the OS hands out zeroed at their first touch: a cache costs nothing to make, and memory
    only where it is used (zeroing the embedded model's default ~300 MB took ~0.5 s an engine)."""
    count = math.prod(shape)
    if torch.device(device).type != 'cpu' or count == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.frombuffer(mmap.mmap(-1, count * dtype.itemsize), dtype=dtype,
                            count=count).view(shape)


class CacheEngine:
    """Each kind of cache of every layer is one tensor, layer-major (`kv`: K and V of the
    full-attention layers; `states`: conv windows and recurrent states of the linear-attention
    layers; `snapshots` likewise), and `caches[layer_idx]` holds that layer's views of them (each
    laid out as a tensor of its own would be): a snapshot save, a restore or a fork copies
    every layer in one gather and one scatter instead of two per layer (a prefill step with
    prefix caching on saved its states in 72 small kernels at the 0.8B's 18 layers)."""

    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig, dtype: torch.dtype,
                 device: torch.device | str, layer_types: tuple[str, ...] | None = None,
                 tp: int = 1, ssm_state_dtype: str = 'auto'):
        """layer_types: default the model's (the MTP draft's: ('full_attention',))."""
        self.model_config, self.cache_config, self.tp = model_config, cache_config, tp
        self.layer_types = tuple(layer_types or model_config.layer_types)
        self.state_dtype = state_dtype(dtype, ssm_state_dtype, model_config)
        cc = cache_config
        full, linear = ([i for i, t in enumerate(self.layer_types) if t == kind]
                        for kind in ('full_attention', 'linear_attention'))

        def zeros(layers: list[int], shape: tuple, state: bool = False) -> torch.Tensor | None:
            return fresh_zeros((len(layers),) + shape, self.state_dtype if state else dtype,
                               device) if layers else None

        def windows(layers: list[int], shape: tuple) -> torch.Tensor | None:
            # [L, slots, C, W] stored as [L, slots, W, C]: a decode step's kernels read and
            # write one window column of a block of channels at a time, whole sectors this way
            # (at a stride of W elements a column cost 1.5x the conv1d update on an H200)
            slots, channels, width = shape
            minor = zeros(layers, (slots, width, channels))
            return None if minor is None else minor.transpose(-1, -2)
        kv = kv_shape(model_config, cc.num_blocks, cc.block_size, tp)
        conv, rec = state_shapes(model_config, cc.num_state_slots, cc.num_spec_tokens, tp)
        self.kv = (zeros(full, kv), zeros(full, kv))
        self.states = (windows(linear, conv), zeros(linear, rec, state=True))
        self.caches: list[tuple[torch.Tensor, torch.Tensor]] = [None] * len(self.layer_types)
        for layers, (first, second) in ((full, self.kv), (linear, self.states)):
            for j, i in enumerate(layers):
                self.caches[i] = (first[j], second[j])
        # (conv, recurrent) snapshot rows of every linear-attention layer: a state row without
        # its spec slots; None without prefix caching
        self.snapshots: tuple[torch.Tensor, torch.Tensor] | None = None
        if cc.num_snapshots and linear:
            conv, rec = state_shapes(model_config, cc.num_snapshots, 0, tp)
            self.snapshots = (windows(linear, conv), zeros(linear, rec[:1] + rec[2:], state=True))

    def save(self, slots: torch.Tensor, rows: torch.Tensor):
        """Snapshot rows `rows` = the state a prefill left in state slots `slots`."""
        if self.snapshots is not None:
            (conv_rows, rec_rows), (conv, rec) = self.snapshots, self.states
            conv_rows[:, rows] = conv[:, slots, :, :conv_rows.shape[-1]]
            rec_rows[:, rows] = rec[:, slots, 0]

    def restore(self, rows: torch.Tensor, slots: torch.Tensor):
        """State slots `slots` = snapshot rows `rows` (the caller sets their index to 0)."""
        if self.snapshots is not None:
            (conv_rows, rec_rows), (conv, rec) = self.snapshots, self.states
            conv[:, slots, :, :conv_rows.shape[-1]] = conv_rows[:, rows]
            rec[:, slots, 0] = rec_rows[:, rows]

    def copy_blocks(self, copies: torch.Tensor):
        """copies [C, 2] long (block, its copy), in every full-attention layer."""
        if self.kv[0] is not None:
            src, dst = copies.unbind(1)
            for cache in self.kv:
                cache[:, dst] = cache[:, src]

    def copy_states(self, copies: torch.Tensor):
        """copies [S, 2] long (state slot, its copy) of what a prefill left in the slot, in every
        linear-attention layer (the caller sets the copies' index to 0)."""
        if self.states[0] is not None:
            src, dst = copies.unbind(1)
            width = self.model_config.linear_conv_kernel_dim - 1
            conv, rec = self.states
            conv[:, dst, :, :width] = conv[:, src, :, :width]
            rec[:, dst, 0] = rec[:, src, 0]

    def __getitem__(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.caches[layer_idx]

    @staticmethod
    def bytes_per_block(model_config: ModelConfig, block_size: int, dtype: torch.dtype,
                        layer_types: tuple[str, ...] | None = None, tp: int = 1) -> int:
        """KV bytes of one block over all full-attention layers (K and V) on one TP rank."""
        num_full = sum(t == 'full_attention' for t in layer_types or model_config.layer_types)
        return 2 * num_full * math.prod(kv_shape(model_config, 1, block_size, tp)) * dtype.itemsize

    @staticmethod
    def bytes_per_state_slot(model_config: ModelConfig, num_spec_tokens: int, dtype: torch.dtype,
                             layer_types: tuple[str, ...] | None = None, tp: int = 1,
                             ssm_state_dtype: str = 'auto') -> int:
        """One sequence's conv window and recurrent state bytes, all linear-attention layers."""
        num_linear = sum(t == 'linear_attention' for t in layer_types or model_config.layer_types)
        conv, rec = state_shapes(model_config, 1, num_spec_tokens, tp)
        rec_dtype = state_dtype(dtype, ssm_state_dtype, model_config)
        return num_linear * (math.prod(conv) * dtype.itemsize + math.prod(rec) * rec_dtype.itemsize)
