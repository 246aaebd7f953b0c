"""Model-directory presets of real Qwen3.5 shapes, for benchmarks on random (dummy) weights.

Shapes from ../shared/reference/qwen3_5.md and gpu.md (text configs; every 4th layer is full
attention; head_dim 256 with 64 rotary channels; gated delta net dk = dv = 128; one MTP layer):

    qwen3_5_0_8b     24 layers, hidden 1024, heads 8/2, FFN 3584, GDN heads 16/16, tied embeddings
    qwen3_5_9b       32 layers, hidden 4096, heads 16/4, FFN 12288, GDN heads 16/32
    qwen3_5_35b_a3b  40 layers, hidden 2048, heads 16/2, 256 experts top-8 (I=512, shared 512),
                     GDN heads 16/32
    tiny             a ~100k-parameter MoE shape for CPU runs and tests

`write_preset(name, dir)` writes `config.json` only (text-only layout, `Qwen3_5[Moe]ForCausalLM`):
the engine builds such a directory with `load_format='dummy'`; no tokenizer is needed to run
token ids.
"""
from __future__ import annotations

import json
import os

_ROPE = {'rope_type': 'default', 'rope_theta': 10000000.0, 'partial_rotary_factor': 0.25,
         'mrope_section': [11, 11, 10], 'mrope_interleaved': True}
_COMMON = dict(vocab_size=248320, head_dim=256, linear_conv_kernel_dim=4, linear_key_head_dim=128,
               linear_value_head_dim=128, linear_num_key_heads=16, rms_norm_eps=1e-6,
               hidden_act='silu', attn_output_gate=True, attention_bias=False,
               full_attention_interval=4, max_position_embeddings=262144,
               mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False,
               mamba_ssm_dtype='float32', partial_rotary_factor=0.25, rope_parameters=_ROPE,
               eos_token_id=248044, dtype='bfloat16')
_MOE_35B = dict(num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
                shared_expert_intermediate_size=512)

PRESETS: dict[str, dict] = {
    'qwen3_5_0_8b': dict(_COMMON, model_type='qwen3_5_text', num_hidden_layers=24,
                         hidden_size=1024, num_attention_heads=8, num_key_value_heads=2,
                         intermediate_size=3584, linear_num_value_heads=16,
                         tie_word_embeddings=True),
    'qwen3_5_9b': dict(_COMMON, model_type='qwen3_5_text', num_hidden_layers=32,
                       hidden_size=4096, num_attention_heads=16, num_key_value_heads=4,
                       intermediate_size=12288, linear_num_value_heads=32,
                       tie_word_embeddings=False),
    'qwen3_5_35b_a3b': dict(_COMMON, **_MOE_35B, model_type='qwen3_5_moe_text',
                            num_hidden_layers=40, hidden_size=2048, num_attention_heads=16,
                            num_key_value_heads=2, linear_num_value_heads=32,
                            tie_word_embeddings=False),
    'tiny': dict(_COMMON, model_type='qwen3_5_moe_text', vocab_size=512, num_hidden_layers=4,
                 hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                 linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2,
                 moe_intermediate_size=32, shared_expert_intermediate_size=48,
                 max_position_embeddings=4096, eos_token_id=1, tie_word_embeddings=False,
                 rope_parameters=dict(_ROPE, rope_theta=10000.0, mrope_section=[1, 1, 0])),
}
_ARCHITECTURES = {'qwen3_5_text': 'Qwen3_5ForCausalLM', 'qwen3_5_moe_text': 'Qwen3_5MoeForCausalLM'}


def preset_config(name: str) -> dict:
    """The preset's config.json contents (a fresh dict); ValueError naming the presets."""
    if name not in PRESETS:
        raise ValueError(f'preset={name!r}: must be one of {sorted(PRESETS)}')
    config = json.loads(json.dumps(PRESETS[name]))
    config['layer_types'] = ['full_attention' if (i + 1) % config['full_attention_interval'] == 0
                             else 'linear_attention' for i in range(config['num_hidden_layers'])]
    config['architectures'] = [_ARCHITECTURES[config['model_type']]]
    return config


def write_preset(name: str, directory: str) -> str:
    """Write the preset as a model directory (`<directory>/config.json`); returns `directory`."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, 'config.json'), 'w') as f:
        json.dump(preset_config(name), f, indent=2)
    return directory
