"""load_format='dummy': random weights from config.json alone (loader.init_dummy_weights).

A model directory here holds only a tiny config.json: nothing else could be read."""
import math
import os

import pytest
import torch

from lmdeploy_lite.messages import GenerationConfig, PytorchEngineConfig, SpeculativeConfig
from lmdeploy_lite.pytorch.config import ModelConfig
from lmdeploy_lite.pytorch.engine.build import build_engine
from lmdeploy_lite.pytorch.models.loader import (DUMMY_STD, build_model, init_dummy_weights,
                                                 load_mtp_weights)
from lmdeploy_lite.pytorch.models.qwen3_5_mtp import Qwen3_5MTP
from lmdeploy_lite.pytorch.nn.norm import GatedRMSNorm, RMSNorm
from tests.helpers.tiny_models import tiny_text_config


@pytest.fixture(scope='module')
def config_dirs(tmp_path_factory):
    """{(moe, tie): directory with config.json only}."""
    dirs = {}
    for moe, tie in ((True, False), (False, True)):
        path = str(tmp_path_factory.mktemp(f'cfg_moe{int(moe)}_tie{int(tie)}'))
        tiny_text_config(moe, tie).save_pretrained(path)
        assert os.listdir(path) == ['config.json']
        dirs[moe, tie] = path
    return dirs


def _build(path, seed, dtype=torch.float32):
    return build_model(path, dtype, 'cpu', progress=False, load_format='dummy', seed=seed)


@pytest.mark.parametrize('moe,tie', [(True, False), (False, True)])
def test_dummy_values_follow_the_rules(config_dirs, moe, tie):
    model = _build(config_dirs[moe, tie], seed=0)
    if tie:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    for module in model.modules():
        if isinstance(module, GatedRMSNorm):
            assert torch.equal(module.weight, torch.ones_like(module.weight))
        elif isinstance(module, RMSNorm):
            assert torch.equal(module.weight, torch.zeros_like(module.weight))
    for name, param in model.named_parameters():
        if name.endswith('A_log'):                    # log(uniform(1, 16))
            assert 0 <= param.min() and param.max() <= math.log(16)
        elif name.endswith('dt_bias'):                # softplus(dt_bias) = dt in [1e-3, 1e-1]
            dt = torch.nn.functional.softplus(param)
            assert 1e-3 * 0.99 <= dt.min() and dt.max() <= 1e-1 * 1.01
        elif param.dim() >= 2 and param.numel() >= 4096:
            assert abs(param.std().item() - DUMMY_STD) < 0.1 * DUMMY_STD, name
            assert abs(param.mean().item()) < 0.1 * DUMMY_STD, name


def test_dummy_is_deterministic_per_seed(config_dirs):
    path = config_dirs[True, False]
    first, again, other = (_build(path, s).state_dict() for s in (0, 0, 1))
    assert all(torch.equal(first[n], again[n]) for n in first)
    matrices = [n for n, p in first.items() if p.dim() >= 2]
    assert all(not torch.equal(first[n], other[n]) for n in matrices)
    # every parameter draws its own stream: two same-shape matrices differ
    assert not torch.equal(first['model.layers.0.linear_attn.in_proj_z.weight'],
                           first['model.layers.1.linear_attn.in_proj_z.weight'])


def test_dummy_mtp_head(config_dirs):
    path = config_dirs[True, False]
    target = _build(path, seed=0)
    config = ModelConfig.from_pretrained(path)

    def draft(seed):
        mtp = Qwen3_5MTP(config, torch.float32, 'cpu', target.embed_tokens, target.lm_head)
        load_mtp_weights(mtp, path, progress=False, load_format='dummy', seed=seed)
        return mtp.state_dict()

    first, again = draft(0), draft(0)
    assert all(torch.equal(first[n], again[n]) for n in first)
    assert first['fc.weight'].std() > 0.5 * DUMMY_STD
    assert torch.equal(first['norm.weight'], torch.zeros_like(first['norm.weight']))
    # seeded by the checkpoint name `mtp.layers.0...`, not the target's `model.layers.3...`
    assert not torch.equal(first['layers.0.self_attn.q_proj.weight'],
                           target.model.layers[3].self_attn.q_proj.weight)


def test_unknown_vector_parameter_raises():
    module = torch.nn.Module()
    module.scale = torch.nn.Parameter(torch.empty(4), requires_grad=False)
    with pytest.raises(ValueError, match="no rule for the 1-D parameter 'scale'"):
        init_dummy_weights(module)


def test_load_format_is_validated():
    with pytest.raises(ValueError, match=r"load_format='safetensors': must be one of \('auto', "
                                         r"'dummy'\)"):
        PytorchEngineConfig(load_format='safetensors')


def _generate(path, seed, k=0):
    spec = SpeculativeConfig(num_speculative_tokens=k) if k else None
    engine = build_engine(path, PytorchEngineConfig(device='cpu', dtype='float64', load_format='dummy',
                                              seed=seed, session_len=128, max_batch_size=4),
                    spec, progress=False)
    seqs = engine.generate([[5, 6, 7, 8, 9], [10, 11]],
                           GenerationConfig(max_new_tokens=6, ignore_eos=True))
    return [s.token_ids[s.num_prompt:] for s in seqs]


def test_engine_on_dummy_weights_with_mtp(config_dirs):
    """An engine (and its MTP draft) runs from config.json alone, with no tokenizer; greedy
    speculative output equals plain output (float64) built from the same seed, and the seed
    picks the weights."""
    path = config_dirs[True, False]
    plain = _generate(path, seed=0)
    assert [len(t) for t in plain] == [6, 6]
    assert _generate(path, seed=0, k=2) == plain
    assert _generate(path, seed=1) != plain
