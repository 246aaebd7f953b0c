"""ModelConfig.from_dict against transformers' own reading of the same config.json: a field the
file leaves out takes transformers' default (not a released checkpoint's value), and a value this
engine does not implement is a ValueError naming the field, never other numbers."""
import pytest

from lmdeploy_lite.pytorch.config import ModelConfig

MINIMAL = dict(vocab_size=300, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2)
OMISSIONS = {
    'nothing_else': {},
    'top_level_rope_theta': dict(rope_theta=500.0),
    'rope_parameters_without_theta': dict(rope_parameters={'rope_type': 'default',
                                                           'partial_rotary_factor': 0.5}),
    'legacy_rope_scaling': dict(rope_scaling={'type': 'default', 'mrope_section': [1, 1, 0]}),
    'legacy_layer_types': dict(num_hidden_layers=2, layer_types=['mamba', 'attention']),
}


def _transformers_view(config) -> dict:
    """What transformers' modeling code takes from its config object."""
    rope = config.rope_parameters
    return dict(head_dim=config.head_dim, rope_theta=rope['rope_theta'],
                rotary_dim=int(config.head_dim * rope['partial_rotary_factor']),
                layer_types=tuple(config.layer_types),
                **{name: getattr(config, name) for name in (
                    'num_experts', 'num_experts_per_tok', 'moe_intermediate_size',
                    'shared_expert_intermediate_size', 'intermediate_size')
                   if hasattr(config, name)})


@pytest.mark.parametrize('moe', [False, True], ids=['dense', 'moe'])
@pytest.mark.parametrize('fields', OMISSIONS.values(), ids=OMISSIONS.keys())
def test_omitted_fields_read_as_transformers_reads_them(moe, fields):
    """Before: no rope_theta anywhere gave RoPE base 1e7 (transformers: 1e4), silently; no
    num_experts_per_tok routed every token to zero experts."""
    from transformers import Qwen3_5MoeTextConfig, Qwen3_5TextConfig
    cfg = dict(MINIMAL, **fields)
    hf = _transformers_view((Qwen3_5MoeTextConfig if moe else Qwen3_5TextConfig)(**cfg))
    ours = ModelConfig.from_dict(dict(cfg, model_type='qwen3_5_moe_text' if moe
                                      else 'qwen3_5_text'))
    assert {name: getattr(ours, name) for name in hf} == hf


UNSUPPORTED = {
    'rope_parameters.rope_type': dict(rope_parameters={'rope_type': 'linear', 'factor': 2.0,
                                                       'rope_theta': 1e4}),
    'hidden_act': dict(hidden_act='gelu'),
    'attention_bias': dict(attention_bias=True),
    'linear_num_value_heads': dict(linear_num_key_heads=4, linear_num_value_heads=6),
    'num_attention_heads': dict(num_attention_heads=6, num_key_value_heads=4),
    'rope_parameters.partial_rotary_factor': dict(head_dim=16, partial_rotary_factor=0.1),
    'layer_types': dict(layer_types=['linear_attention'] * 3 + ['sliding_attention']),
    'num_experts_per_tok': dict(num_experts=4, num_experts_per_tok=5),
}


@pytest.mark.parametrize('field_name', UNSUPPORTED)
def test_unsupported_values_name_the_field(field_name):
    """Before, a scaled RoPE and another activation ran as plain RoPE and SiLU (other numbers
    than transformers'), head counts that do not divide failed deep in a forward."""
    cfg = dict(MINIMAL, model_type='qwen3_5_moe_text', **UNSUPPORTED[field_name])
    with pytest.raises(ValueError, match=rf'config\.json: {field_name}='):
        ModelConfig.from_dict(cfg)
