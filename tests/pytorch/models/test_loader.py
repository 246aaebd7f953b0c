"""Weight loading: both released layouts, fused / per-expert experts, shards, tied embeddings,
mtp.* access, and the errors a user can act on."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from lmdeploy_lite.pytorch.config import ModelConfig
from lmdeploy_lite.pytorch.models.loader import (
    build_model, has_mtp_weights, load_mtp_state_dict, load_weights)
from lmdeploy_lite.pytorch.models.qwen3_5 import Qwen3_5ForCausalLM
from tests.helpers.tiny_models import make_tiny_checkpoint, make_tiny_hf_model


def assert_same_weights(model, hf_model):
    ours = dict(model.named_parameters(remove_duplicate=False))
    ref = hf_model.state_dict()
    assert set(ours) == set(ref), set(ours) ^ set(ref)
    for name, tensor in ref.items():
        torch.testing.assert_close(ours[name], tensor, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize('moe,layout,per_expert,shard,tie', [
    (False, 'plain', False, False, False),
    (False, 'multimodal', False, True, True),
    (True, 'plain', False, False, False),
    (True, 'plain', True, True, False),
    (True, 'multimodal', True, False, False),
    (True, 'multimodal', False, True, True),
])
def test_loads_every_layout(tmp_path, moe, layout, per_expert, shard, tie):
    path = make_tiny_checkpoint(str(tmp_path), moe=moe, layout=layout, per_expert=per_expert,
                                shard=shard, tie=tie)
    model = build_model(path, torch.float32, 'cpu', progress=False)
    assert not model.training
    assert_same_weights(model, make_tiny_hf_model(moe, tie=tie))
    assert model.config.is_moe == moe and model.config.tie_word_embeddings == tie


def test_loads_into_bfloat16(tmp_path):
    path = make_tiny_checkpoint(str(tmp_path), moe=True)
    model = build_model(path, torch.bfloat16, 'cpu', progress=False)
    assert model.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.bfloat16


@pytest.mark.parametrize('per_expert', [False, True])
def test_mtp_tensors_available(tmp_path, per_expert):
    path = make_tiny_checkpoint(str(tmp_path), moe=True, layout='multimodal', per_expert=per_expert,
                                shard=True)
    assert has_mtp_weights(path)
    mtp = load_mtp_state_dict(path)
    hidden = 64
    assert mtp['mtp.fc.weight'].shape == (hidden, 2 * hidden)
    for norm in ('pre_fc_norm_embedding', 'pre_fc_norm_hidden', 'norm'):
        assert mtp[f'mtp.{norm}.weight'].shape == (hidden,)
    assert 'mtp.layers.0.self_attn.q_proj.weight' in mtp
    if per_expert:
        assert mtp['mtp.layers.0.mlp.experts.3.down_proj.weight'].shape == (hidden, 32)
    else:
        assert mtp['mtp.layers.0.mlp.experts.gate_up_proj'].shape == (4, 64, hidden)
    assert not any(k.startswith('model.') for k in mtp)
    no_mtp = make_tiny_checkpoint(str(tmp_path), moe=False, with_mtp=False)
    assert not has_mtp_weights(no_mtp)


def test_progress_bar_can_be_disabled(tmp_path, capsys):
    path = make_tiny_checkpoint(str(tmp_path), moe=False)
    build_model(path, torch.float32, 'cpu', progress=False)
    assert 'Loading weights' not in capsys.readouterr().err
    build_model(path, torch.float32, 'cpu', progress=True)
    assert 'Loading weights' in capsys.readouterr().err


# ----------------------------------------------------------------------------- errors

def _model(path):
    return Qwen3_5ForCausalLM(ModelConfig.from_pretrained(path), torch.float32, 'cpu')


def test_missing_directory(tmp_path):
    missing = str(tmp_path / 'nope')
    with pytest.raises(ValueError, match='no such directory'):
        build_model(missing, torch.float32, 'cpu', progress=False)
    path = make_tiny_checkpoint(str(tmp_path), moe=False)
    with pytest.raises(ValueError, match='no such directory'):
        load_weights(_model(path), missing, progress=False)


def test_missing_weight_file(tmp_path):
    path = make_tiny_checkpoint(str(tmp_path), moe=False)
    os.remove(os.path.join(path, 'model.safetensors'))
    with pytest.raises(ValueError, match=r'no weights found; expected model\.safetensors'):
        build_model(path, torch.float32, 'cpu', progress=False)


def test_missing_shard(tmp_path):
    path = make_tiny_checkpoint(str(tmp_path), moe=False, shard=True)
    os.remove(os.path.join(path, 'model-00002-of-00003.safetensors'))
    with pytest.raises(ValueError, match=r"shard 'model-00002-of-00003\.safetensors'.*missing"):
        build_model(path, torch.float32, 'cpu', progress=False)


@pytest.mark.parametrize('name', ['model.language_model.layers.3.self_attn.k_norm.weight',
                                  'model.language_model.layers.1.mlp.experts.2.up_proj.weight',
                                  'lm_head.weight'])
def test_missing_tensor(tmp_path, name):
    path = make_tiny_checkpoint(str(tmp_path), moe=True, layout='multimodal', per_expert=True)
    file = os.path.join(path, 'model.safetensors')
    tensors = load_file(file)
    del tensors[name]
    save_file(tensors, file)
    short = name.replace('language_model.', '').replace('.2.up_proj.weight', '.gate_up_proj')
    with pytest.raises(ValueError, match='missing tensors for ' + short.replace('.', r'\.')):
        build_model(path, torch.float32, 'cpu', progress=False)


def test_tensor_shape_disagrees_with_config(tmp_path):
    path = make_tiny_checkpoint(str(tmp_path), moe=False)
    file = os.path.join(path, 'model.safetensors')
    tensors = load_file(file)
    tensors['model.layers.0.linear_attn.in_proj_z.weight'] = torch.zeros(32, 64)
    save_file(tensors, file)
    with pytest.raises(ValueError, match=r"model\.safetensors: tensor 'model\.layers\.0\.linear_attn"
                                         r"\.in_proj_z\.weight' has shape \[32, 64\], but config\.json"
                                         r" implies \[64, 64\]"):
        build_model(path, torch.float32, 'cpu', progress=False)
    # a config.json edit is reported the same way
    path = make_tiny_checkpoint(str(tmp_path), moe=False, seed=1)
    with open(os.path.join(path, 'config.json')) as f:
        config = json.load(f)
    config['vocab_size'] = 1000
    with open(os.path.join(path, 'config.json'), 'w') as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match=r"weight' has shape \[512, 64\], but "
                                         r"config\.json implies \[1000, 64\]"):
        build_model(path, torch.float32, 'cpu', progress=False)
