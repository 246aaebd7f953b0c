"""Per-rank cache tensors of the model (and of the MTP draft, which has its own full-attention KV).

full-attention layer:   (k_cache, v_cache), each [num_blocks, block_size, num_kv_heads, head_dim]
                        in the model dtype;
linear-attention layer: (conv_state [num_state_slots, conv_dim, K - 1 + num_spec] in the model dtype,
                         recurrent_state [num_state_slots, 1 + num_spec, nv, dk, dv] in fp32, or
                         fp64 for a float64 model).
`caches[layer_idx]` returns the layer's tuple; the slot semantics are in model_inputs.py.
"""
from __future__ import annotations

import torch

from ..config import CacheConfig, ModelConfig


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class CacheEngine:
    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig, dtype: torch.dtype,
                 device: torch.device | str, layer_types: tuple[str, ...] | None = None):
        """layer_types: defaults to the model's; the MTP draft passes ('full_attention',)."""
        self.model_config, self.cache_config = model_config, cache_config
        self.layer_types = tuple(layer_types or model_config.layer_types)
        mc, cc = model_config, cache_config
        self.caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        for layer_type in self.layer_types:
            if layer_type == 'full_attention':
                shape = (cc.num_blocks, cc.block_size, mc.num_key_value_heads, mc.head_dim)
                self.caches.append((torch.zeros(shape, dtype=dtype, device=device),
                                    torch.zeros(shape, dtype=dtype, device=device)))
            else:
                conv = (cc.num_state_slots, mc.linear_conv_dim,
                        mc.linear_conv_kernel_dim - 1 + cc.num_spec_tokens)
                rec = (cc.num_state_slots, 1 + cc.num_spec_tokens, mc.linear_num_value_heads,
                       mc.linear_key_head_dim, mc.linear_value_head_dim)
                self.caches.append((torch.zeros(conv, dtype=dtype, device=device),
                                    torch.zeros(rec, dtype=state_dtype(dtype), device=device)))

    def __getitem__(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.caches[layer_idx]

    def __len__(self) -> int:
        return len(self.caches)

    @staticmethod
    def bytes_per_block(model_config: ModelConfig, block_size: int, dtype: torch.dtype,
                        layer_types: tuple[str, ...] | None = None) -> int:
        """KV bytes of one block over all full-attention layers (K and V)."""
        layer_types = layer_types or model_config.layer_types
        num_full = sum(t == 'full_attention' for t in layer_types)
        elem = torch.empty((), dtype=dtype).element_size()
        return (2 * num_full * block_size * model_config.num_key_value_heads
                * model_config.head_dim * elem)

    @staticmethod
    def bytes_per_state_slot(model_config: ModelConfig, num_spec_tokens: int, dtype: torch.dtype,
                             layer_types: tuple[str, ...] | None = None) -> int:
        """Conv window + recurrent state bytes of one sequence over all linear-attention layers."""
        layer_types = layer_types or model_config.layer_types
        num_linear = sum(t == 'linear_attention' for t in layer_types)
        mc = model_config
        conv = mc.linear_conv_dim * (mc.linear_conv_kernel_dim - 1 + num_spec_tokens)
        conv_bytes = conv * torch.empty((), dtype=dtype).element_size()
        rec = ((1 + num_spec_tokens) * mc.linear_num_value_heads * mc.linear_key_head_dim
               * mc.linear_value_head_dim)
        rec_bytes = rec * torch.empty((), dtype=state_dtype(dtype)).element_size()
        return num_linear * (conv_bytes + rec_bytes)
