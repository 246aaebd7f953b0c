"""benchmarks/presets.py shapes, the HBM-floor byte counts of bench_decode, and the decode/spec
benchmarks end to end on the tiny preset (CPU, dummy weights)."""
import contextlib
import io
import json
import os
import runpy
import sys
from unittest import mock

import pytest
import torch

from lmdeploy_lite.pytorch.config import ModelConfig
from lmdeploy_lite.pytorch.models.qwen3_5 import Qwen3_5ForCausalLM
from lmdeploy_lite.pytorch.models.qwen3_5_mtp import Qwen3_5MTP

BENCH_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'benchmarks')
sys.path.insert(0, BENCH_DIR)
from bench_decode import cache_bytes, weight_bytes  # noqa: E402
from presets import PRESETS, write_preset  # noqa: E402

# parameters incl. embeddings (and the LM head when untied); the MTP head apart
EXPECTED = {'qwen3_5_0_8b': (0.70e9, 0.90e9), 'qwen3_5_9b': (8.5e9, 9.5e9),
            'qwen3_5_35b_a3b': (33e9, 36e9)}


def _meta_params(config: ModelConfig) -> tuple[int, int]:
    """(target, MTP head) parameter counts from the shapes, nothing allocated."""
    target = Qwen3_5ForCausalLM(config, torch.bfloat16, 'meta')
    mtp = Qwen3_5MTP(config, torch.bfloat16, 'meta', target.embed_tokens, target.lm_head)
    return (sum(p.numel() for p in target.parameters()),
            sum(p.numel() for p in mtp.parameters()))


@pytest.mark.parametrize('name', sorted(PRESETS))
def test_preset_parses_with_ours_and_transformers(tmp_path, name):
    from transformers import AutoConfig
    path = write_preset(name, str(tmp_path / name))
    assert os.listdir(path) == ['config.json']
    ours = ModelConfig.from_pretrained(path)
    hf = AutoConfig.from_pretrained(path)
    expected_class = 'Qwen3_5MoeTextConfig' if ours.is_moe else 'Qwen3_5TextConfig'
    assert type(hf).__name__ == expected_class
    for field in ('hidden_size', 'num_attention_heads', 'num_key_value_heads', 'head_dim',
                  'vocab_size', 'linear_num_key_heads', 'linear_num_value_heads',
                  'mtp_num_hidden_layers', 'tie_word_embeddings'):
        assert getattr(ours, field) == getattr(hf, field), field
    assert ours.num_layers == hf.num_hidden_layers
    assert list(ours.layer_types) == list(hf.layer_types)
    assert ours.layer_types[3] == 'full_attention' and ours.layer_types.count('full_attention') \
        == ours.num_layers // 4
    assert ours.mtp_num_hidden_layers == 1
    assert ours.rotary_dim == ours.head_dim // 4
    if name != 'tiny':
        assert (ours.vocab_size, ours.head_dim, ours.rope_theta) == (248320, 256, 1e7)


@pytest.mark.parametrize('name', sorted(EXPECTED))
def test_preset_parameter_counts(tmp_path, name):
    config = ModelConfig.from_pretrained(write_preset(name, str(tmp_path)))
    target, mtp = _meta_params(config)
    low, high = EXPECTED[name]
    assert low <= target <= high, f'{name}: {target / 1e9:.3f}B parameters'
    assert 0 < mtp < 0.05 * target


def test_floor_bytes(tmp_path):
    """9B at bs=1 reads all 17.9 GB of bf16 weights but the (untied) embedding table (gpu.md:
    17.9 GB with it); a MoE step reads the experts a batch touches."""
    dense = ModelConfig.from_pretrained(write_preset('qwen3_5_9b', str(tmp_path / 'a')))
    embed = dense.vocab_size * dense.hidden_size * 2
    assert weight_bytes(dense, torch.bfloat16, 1) + embed == pytest.approx(17.9e9, rel=0.01)
    assert weight_bytes(dense, torch.bfloat16, 64) == weight_bytes(dense, torch.bfloat16, 1)
    moe = ModelConfig.from_pretrained(write_preset('qwen3_5_35b_a3b', str(tmp_path / 'b')))
    one, many = weight_bytes(moe, torch.bfloat16, 1), weight_bytes(moe, torch.bfloat16, 4096)
    experts = moe.num_layers * moe.num_experts * 3 * moe.hidden_size * moe.moe_intermediate_size * 2
    assert many - one == pytest.approx(experts * (1 - 8 / 256), rel=1e-6)
    # KV of 1000 tokens: 10 full-attention layers x K,V x 2 heads x 256 x bf16; GDN state r+w
    state = 30 * (32 * 128 * 128 * 4 + 8192 * 3 * 2)
    assert cache_bytes(moe, torch.bfloat16, 2, 1000) == 2 * (1000 * 10 * 2 * 2 * 256 * 2
                                                             + 2 * state)


def _run(script: str, tmp_path, *flags) -> tuple[dict, str]:
    """The script's main, as `python script ...` runs it (run_name '__main__', its own argv),
    in this process: a subprocess spent nearly all of its ~2 s importing torch and the
    package. The global RNG is restored after it (the scripts seed it); this process already
    runs torch on one thread (tests/conftest.py), as OMP_NUM_THREADS=1 made the subprocess."""
    out = str(tmp_path / f'{script}.json')
    path = os.path.join(BENCH_DIR, script)
    argv = [path, '--preset', 'tiny', '--device', 'cpu', '--prompt-len', '8', '--decode-steps',
            '2', '--warmup-steps', '1', '--out', out, *flags]
    stdout = io.StringIO()
    with mock.patch.object(sys, 'argv', argv), contextlib.redirect_stdout(stdout), \
            torch.random.fork_rng(devices=[]):
        runpy.run_path(path, run_name='__main__')
    with open(out) as f:
        return json.load(f), stdout.getvalue()


def test_bench_decode_runs_on_cpu(tmp_path):
    result, stdout = _run('bench_decode.py', tmp_path, '--batch-sizes', '1,2', '--context-lens',
                          '24', '--copy-gib', '0.01')
    assert result['load_format'] == 'dummy' and result['copy_bandwidth_gb_s'] > 0
    rows = result['rows']
    assert [(r['impl'], r['batch'], r['context']) for r in rows] == [
        ('engine', 1, 8), ('engine', 2, 8), ('engine', 1, 24)]
    for row in rows:
        assert row['step_ms'] > 0 and row['tok_s'] > 0 and 0 < row['roofline_pct']
        assert row['roofline_all_pct'] >= row['roofline_pct']
    assert 'roofline_pct' in stdout


def test_hf_decode_measure(tmp_path):
    """bench_decode --hf's measurement (bench_hf.py), in-process on the tiny preset."""
    from bench_hf import build_hf_model, measure_hf
    model = build_hf_model(write_preset('tiny', str(tmp_path)), torch.float32,
                           torch.device('cpu'))
    assert type(model).__name__ == 'Qwen3_5MoeForCausalLM'
    row = measure_hf(model, batch_size=2, prompt_len=8, decode_steps=2, warmup=1)
    assert (row['impl'], row['batch'], row['context']) == ('hf', 2, 8)
    assert row['step_ms'] > 0 and row['tok_s'] == pytest.approx(2000 / row['step_ms'])


def test_bench_spec_runs_on_cpu(tmp_path):
    result, _ = _run('bench_spec.py', tmp_path, '--batch-sizes', '1', '--ks', '2',
                     '--synthetic-acceptance', '1.0')
    ar, spec = result['rows']
    assert (ar['k'], spec['k']) == (0, 2)
    assert spec['mean_accepted_len'] == 3.0 and spec['acceptance'] == 1.0
    assert spec['speedup'] == pytest.approx(spec['decode_tok_s'] / ar['decode_tok_s'])


def test_bench_spec_dynamic_row_at_acceptance_zero(tmp_path):
    """The dynamic row with nothing accepted: the policy runs plain steps (k=0) among others."""
    result, _ = _run('bench_spec.py', tmp_path, '--batch-sizes', '1', '--ks', '2', '--dynamic',
                     '--dynamic-warmup-steps', '12', '--decode-steps', '8',
                     '--synthetic-acceptance', '0.0')
    dyn = result['rows'][-1]
    assert dyn['k'] == 'dyn' and sum(dyn['k_hist'].values()) == 8
