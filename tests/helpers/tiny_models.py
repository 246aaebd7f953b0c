"""Tiny random Qwen3.5 checkpoints (dense and MoE) for CPU tests.

`make_tiny_hf_model` builds the transformers reference model (deterministic in `seed`);
`make_tiny_checkpoint` saves it in either released layout:
  * 'plain':      text-only config (`qwen3_5_text` / `qwen3_5_moe_text`), tensors `model.*`,
                  `lm_head.weight` (absent when tied);
  * 'multimodal': top-level config (`qwen3_5` / `qwen3_5_moe`, `text_config`, vision_config,
                  `Qwen3_5[Moe]ForConditionalGeneration`), tensors `model.language_model.*`, a dummy
                  `model.visual.*` tensor.
Both can carry random `mtp.*` tensors (one full-attention decoder layer + fc + 3 norms, qwen3_5.md
section 3). MoE experts are written fused (`experts.gate_up_proj [E, 2I, H]`, `experts.down_proj
[E, H, I]`) or per expert (`experts.{e}.{gate,up,down}_proj.weight`, which is also what transformers
5.17 `save_pretrained` writes). transformers' `from_pretrained` reads both expert layouts of the
'plain' checkpoint back.
"""
from __future__ import annotations

import json
import os
import re

import torch
from safetensors.torch import save_file

TINY_TEXT = dict(
    vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
    layer_types=['linear_attention', 'linear_attention', 'linear_attention', 'full_attention'],
    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=16, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
    max_position_embeddings=4096, mtp_num_hidden_layers=1, eos_token_id=1,
    rope_parameters={'rope_type': 'default', 'rope_theta': 10000.0,
                     'partial_rotary_factor': 0.25, 'mrope_section': [1, 1, 0],
                     'mrope_interleaved': True},
)
TINY_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                shared_expert_intermediate_size=48)


def tiny_text_config(moe: bool, tie: bool = False, **overrides):
    from transformers import Qwen3_5MoeTextConfig, Qwen3_5TextConfig
    kwargs = dict(TINY_TEXT, tie_word_embeddings=tie, **(TINY_MOE if moe else {}))
    kwargs.update(overrides)
    if moe:
        kwargs.pop('intermediate_size')
        return Qwen3_5MoeTextConfig(**kwargs)
    return Qwen3_5TextConfig(**kwargs)


def _randomize(module: torch.nn.Module, generator: torch.Generator) -> None:
    """Weights large enough that every part of the network matters to the logits."""
    for name, param in module.named_parameters():
        shape = param.shape
        if name.endswith('A_log'):
            value = torch.rand(shape, generator=generator) * 2 - 1.5         # decay rates ~0.2..0.6
        elif name.endswith('dt_bias'):
            value = torch.randn(shape, generator=generator) * 0.5
        elif name.endswith('linear_attn.norm.weight'):
            value = 1 + 0.2 * torch.randn(shape, generator=generator)
        elif param.dim() == 1:                                               # zero-centred norms
            value = 0.2 * torch.randn(shape, generator=generator)
        elif 'embed_tokens' in name:
            value = torch.randn(shape, generator=generator)
        else:                                                                 # fan-in scaled
            value = torch.randn(shape, generator=generator) / shape[-1] ** 0.5
            if 'conv1d' in name:
                value = torch.randn(shape, generator=generator) * 0.5
        param.data.copy_(value)


def make_tiny_hf_model(moe: bool, tie: bool = False, seed: int = 0, **overrides):
    """The transformers `Qwen3_5[Moe]ForCausalLM` reference, float32, eval mode."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM
    config = tiny_text_config(moe, tie, **overrides)
    cls = Qwen3_5MoeForCausalLM if moe else Qwen3_5ForCausalLM
    torch.manual_seed(seed)
    model = cls(config).float().eval()
    generator = torch.Generator().manual_seed(seed)
    _randomize(model, generator)
    if tie:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


def make_mtp_tensors(hf_model, seed: int = 0, per_expert: bool = False) -> dict[str, torch.Tensor]:
    """Random `mtp.*` tensors: fc [H, 2H], three zero-centred norms, and layer 0 = a full-attention
    decoder layer with the target's MLP kind (dense or MoE)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeDecoderLayer
    config = hf_model.config
    full_idx = config.layer_types.index('full_attention')
    moe = hasattr(config, 'num_experts')
    layer_cls = Qwen3_5MoeDecoderLayer if moe else Qwen3_5DecoderLayer
    layer = layer_cls(config, full_idx).float()
    hidden = config.hidden_size
    holder = torch.nn.Module()
    holder.layers = torch.nn.ModuleList([layer])
    holder.fc = torch.nn.Linear(2 * hidden, hidden, bias=False)
    for norm in ('pre_fc_norm_embedding', 'pre_fc_norm_hidden', 'norm'):
        setattr(holder, norm, torch.nn.Parameter(torch.zeros(hidden)))
    _randomize(holder, torch.Generator().manual_seed(seed + 1000))
    tensors = {}
    for name, tensor in holder.state_dict().items():
        if name in ('pre_fc_norm_embedding', 'pre_fc_norm_hidden', 'norm'):
            name = f'{name}.weight'
        tensors[f'mtp.{name}'] = tensor.detach().clone()
    return _unfuse_experts(tensors) if per_expert else tensors


def _unfuse_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in tensors.items():
        if name.endswith('experts.gate_up_proj'):
            base, inter = name[:-len('gate_up_proj')], tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                out[f'{base}{e}.gate_proj.weight'] = tensor[e, :inter].clone()
                out[f'{base}{e}.up_proj.weight'] = tensor[e, inter:].clone()
        elif name.endswith('experts.down_proj'):
            base = name[:-len('down_proj')]
            for e in range(tensor.shape[0]):
                out[f'{base}{e}.down_proj.weight'] = tensor[e].clone()
        else:
            out[name] = tensor
    return out


def _save_tensors(tensors: dict[str, torch.Tensor], path: str, shard: bool) -> None:
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    if not shard:
        save_file(tensors, os.path.join(path, 'model.safetensors'), metadata={'format': 'pt'})
        return
    names = sorted(tensors)
    parts = [names[i::3] for i in range(3)]
    weight_map = {}
    for i, part in enumerate(parts):
        fname = f'model-{i + 1:05d}-of-{len(parts):05d}.safetensors'
        save_file({n: tensors[n] for n in part}, os.path.join(path, fname),
                  metadata={'format': 'pt'})
        weight_map.update({n: fname for n in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(path, 'model.safetensors.index.json'), 'w') as f:
        json.dump({'metadata': {'total_size': total}, 'weight_map': weight_map}, f, indent=2)


def make_tiny_checkpoint(tmp_dir: str, moe: bool, layout: str = 'plain', with_mtp: bool = True,
                         tie: bool = False, per_expert: bool = False, shard: bool = False,
                         seed: int = 0, **overrides) -> str:
    """Write a tiny checkpoint under `tmp_dir` and return its path. The weights equal
    `make_tiny_hf_model(moe, tie, seed, **overrides)`."""
    if layout not in ('plain', 'multimodal'):
        raise ValueError(f"layout={layout!r}: must be 'plain' or 'multimodal'")
    hf_model = make_tiny_hf_model(moe, tie, seed, **overrides)
    name = (f"tiny-{'moe' if moe else 'dense'}-{layout}{'-tie' if tie else ''}"
            f"{'-perexpert' if per_expert else ''}{'-shard' if shard else ''}"
            f"{'' if with_mtp else '-nomtp'}-s{seed}")
    if overrides:
        name += '-' + '-'.join(f'{k}{v}' for k, v in sorted(overrides.items()))
    path = os.path.join(tmp_dir, name)
    os.makedirs(path, exist_ok=True)
    tensors = {k: v.detach().clone() for k, v in hf_model.state_dict().items()}
    if tie:
        tensors.pop('lm_head.weight', None)
    if per_expert:
        tensors = _unfuse_experts(tensors)
    text_cfg = hf_model.config.to_dict()
    text_cfg.pop('transformers_version', None)
    if layout == 'multimodal':
        tensors = {re.sub(r'^model\.', 'model.language_model.', k): v for k, v in tensors.items()}
        tensors['model.visual.patch_embed.proj.weight'] = torch.zeros(8, 3, 2, 4, 4)
        text_cfg.pop('architectures', None)
        config = {
            'architectures': ['Qwen3_5MoeForConditionalGeneration' if moe
                              else 'Qwen3_5ForConditionalGeneration'],
            'model_type': 'qwen3_5_moe' if moe else 'qwen3_5',
            'text_config': text_cfg,
            'vision_config': {'depth': 1, 'hidden_size': 8, 'num_heads': 2, 'intermediate_size': 16,
                              'out_hidden_size': text_cfg['hidden_size'], 'patch_size': 4},
            'tie_word_embeddings': tie,
        }
    else:
        config = text_cfg
    if with_mtp:
        tensors.update(make_mtp_tensors(hf_model, seed, per_expert))
    _save_tensors(tensors, path, shard)
    with open(os.path.join(path, 'config.json'), 'w') as f:
        json.dump(config, f, indent=2)
    return path
