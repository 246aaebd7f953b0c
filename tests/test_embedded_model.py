"""The embedded default model (lmdeploy_lite/assets/qwen3_5_moe_tiny, trained by
tools/train_tiny_model.py): its layout, our logits against transformers, our MTP head against the
training script's MTP module, and greedy speculative output equal to plain greedy output.

LMDEPLOY_LITE_EMBEDDED_MODEL=DIR points the tests at another checkpoint of the same layout.
"""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from safetensors import safe_open

from lmdeploy_lite.api import EMBEDDED_MODEL_DIR
from lmdeploy_lite.messages import GenerationConfig, PytorchEngineConfig, SpeculativeConfig
from lmdeploy_lite.pytorch.config import CacheConfig
from lmdeploy_lite.pytorch.cache_engine import CacheEngine
from lmdeploy_lite.pytorch.engine.build import build_engine
from lmdeploy_lite.pytorch.models.loader import (build_model, checkpoint_files,
                                                 load_mtp_state_dict, load_mtp_weights)
from lmdeploy_lite.pytorch.models.qwen3_5_mtp import Qwen3_5MTP
from tests.helpers.step_inputs import make_inputs, shuffled_block_tables

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                'tools'))
from train_tiny_model import MTPHead  # noqa: E402

MODEL_DIR = os.environ.get('LMDEPLOY_LITE_EMBEDDED_MODEL', EMBEDDED_MODEL_DIR)
SNIPPETS = [
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n    if n < 2:\n',
    'import os\nimport sys\n\n\nclass Config:\n    def __init__(self, path):\n        self.path = '
    'path\n        self.values = {}\n\n    def load(self):\n        with open(self.path) as f:\n',
]
BLOCK_SIZE = 4

pytestmark = pytest.mark.skipif(not os.path.isfile(os.path.join(MODEL_DIR, 'config.json')),
                                reason=f'no embedded model at {MODEL_DIR}')


def assert_close(ours: torch.Tensor, ref: torch.Tensor, what: str, rel: float = 1e-4):
    ref = ref.to(ours.dtype)
    err = ((ours - ref).norm() / ref.norm()).item()
    assert err < rel, f'{what}: relative error {err:.2e} >= {rel:.0e}'


@pytest.fixture(scope='module')
def prompts() -> list[list[int]]:
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR, local_files_only=True)
    return [tokenizer.encode(s) for s in SNIPPETS]


@pytest.fixture(scope='module')
def hf_model():
    """transformers' Qwen3_5MoeForCausalLM from the released layout: text_config, and
    `model.language_model.` -> `model.`; float32."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig
    with open(os.path.join(MODEL_DIR, 'config.json')) as f:
        config = Qwen3_5MoeTextConfig(**json.load(f)['text_config'])
    torch.manual_seed(0)
    model = Qwen3_5MoeForCausalLM(config)
    state = {}
    for path, names in checkpoint_files(MODEL_DIR).items():
        with safe_open(path, 'pt') as f:
            for name in names:
                if not name.startswith('mtp.'):
                    state[name.replace('model.language_model.', 'model.', 1)] = f.get_tensor(name)
    model.load_state_dict(state, strict=True)
    return model.float().eval()


@pytest.fixture(scope='module')
def ours():
    return build_model(MODEL_DIR, torch.float32, 'cpu', progress=False)


def test_released_layout():
    with open(os.path.join(MODEL_DIR, 'config.json')) as f:
        config = json.load(f)
    assert config['model_type'] == 'qwen3_5_moe'
    assert config['architectures'] == ['Qwen3_5MoeForConditionalGeneration']
    text = config['text_config']
    assert text['mtp_num_hidden_layers'] == 1 and 'vision_config' not in config
    names, total = {}, 0
    for path, tensors in checkpoint_files(MODEL_DIR).items():
        total += os.path.getsize(path)
        with safe_open(path, 'pt') as f:
            names.update({n: f.get_slice(n).get_dtype() for n in tensors})
    assert total <= 30_000_000
    assert set(names.values()) == {'BF16'}
    assert all(n.startswith(('model.language_model.', 'lm_head.', 'mtp.')) for n in names)
    hidden = text['hidden_size']
    full = text['layer_types'].index('full_attention')
    main_full = {n[len(f'model.language_model.layers.{full}.'):] for n in names
                 if n.startswith(f'model.language_model.layers.{full}.')}
    mtp_layer = {n[len('mtp.layers.0.'):] for n in names if n.startswith('mtp.layers.0.')}
    assert mtp_layer == main_full and 'mlp.experts.gate_up_proj' in mtp_layer
    assert {n for n in names if n.startswith('mtp.') and not n.startswith('mtp.layers.')} == {
        'mtp.fc.weight', 'mtp.pre_fc_norm_embedding.weight', 'mtp.pre_fc_norm_hidden.weight',
        'mtp.norm.weight'}
    with safe_open(next(p for p, t in checkpoint_files(MODEL_DIR).items()
                        if 'mtp.fc.weight' in t), 'pt') as f:
        assert f.get_slice('mtp.fc.weight').get_shape() == [hidden, 2 * hidden]


@torch.no_grad()
def test_logits_match_transformers(ours, hf_model, prompts):
    """Prefill of two prompts in one batch, then 4 greedy decode steps, against transformers on
    the whole sequence (float32, 1e-4 relative)."""
    batch = len(prompts)
    cache_config = CacheConfig(block_size=BLOCK_SIZE, num_blocks=batch * 40 + 1,
                               num_state_slots=batch + 1)
    caches = CacheEngine(ours.config, cache_config, torch.float32, 'cpu')
    tables = shuffled_block_tables(batch, 40)
    logits = ours.compute_logits(ours(make_inputs(prompts, [0] * batch, tables, [1, 0]), caches))
    seqs, start, last = [list(p) for p in prompts], 0, []
    for b, p in enumerate(prompts):
        ref = hf_model(torch.tensor([p])).logits[0]
        assert_close(logits[start:start + len(p)], ref, f'prefill seq {b}')
        last.append(logits[start + len(p) - 1])
        start += len(p)
    for step in range(4):
        tokens = [int(x.argmax()) for x in last]
        lens = [len(s) for s in seqs]
        logits = ours.compute_logits(ours(make_inputs([[t] for t in tokens], lens, tables, [1, 0],
                                                      is_decoding=True), caches))
        for b, t in enumerate(tokens):
            seqs[b].append(t)
            ref = hf_model(torch.tensor([seqs[b]])).logits[0, -1]
            assert_close(logits[b], ref, f'decode step {step} seq {b}')
        last = list(logits)


@torch.no_grad()
def test_mtp_matches_training_head(ours, hf_model, prompts):
    """Our Qwen3_5MTP over every prompt position (the target's post-norm hidden, the next token
    shifted in) against tools/train_tiny_model.py's MTPHead with the same mtp.* weights."""
    mtp = Qwen3_5MTP(ours.config, torch.float32, 'cpu', ours.embed_tokens, ours.lm_head).eval()
    load_mtp_weights(mtp, MODEL_DIR, progress=False)
    ref = MTPHead(hf_model.config)
    ref.load_state_dict({k[len('mtp.'):]: v for k, v in load_mtp_state_dict(MODEL_DIR).items()})
    ref.float().eval()
    body = hf_model.model
    for b, p in enumerate(prompts):
        ids = torch.tensor(p)
        n = len(p) - 1
        cache_config = CacheConfig(block_size=BLOCK_SIZE, num_blocks=41, num_state_slots=2)
        target_caches = CacheEngine(ours.config, cache_config, torch.float32, 'cpu')
        mtp_caches = CacheEngine(ours.config, cache_config, torch.float32, 'cpu',
                                 layer_types=('full_attention',))
        tables = shuffled_block_tables(1, 40, seed=b)
        inputs = make_inputs([ids[:n]], [0], tables, [0])
        hidden = ours(inputs, target_caches)
        got = mtp.compute_logits(mtp(ids[1:], hidden, inputs, mtp_caches))
        ref_hidden = body(ids[None, :n]).last_hidden_state
        expected = hf_model.lm_head(ref(ids[None, 1:], ref_hidden, body.embed_tokens,
                                        body.rotary_emb))[0]
        assert_close(got, expected, f'mtp logits seq {b}')


def greedy(prompts, k: int = 0):
    """Greedy outputs and spec stats. float32: the trained model's top-2 logit gaps dwarf float32
    rounding (float64 would be exact, but its depthwise conv1d is ~10x slower on CPU)."""
    spec = SpeculativeConfig(method='qwen3_5_mtp', num_speculative_tokens=k) if k else None
    config = PytorchEngineConfig(dtype='float32', device='cpu', max_batch_size=2, block_size=16,
                                 session_len=256)
    engine = build_engine(MODEL_DIR, config, spec, progress=False)
    seqs = engine.generate(prompts, GenerationConfig(max_new_tokens=24, ignore_eos=True))
    return [s.generated_ids for s in seqs], engine.spec_stats


@pytest.fixture(scope='module')
def plain_greedy(prompts):
    return greedy(prompts)[0]


@pytest.mark.parametrize('k', [1, 2, 3, 4])
def test_greedy_speculative_equals_plain(k, prompts, plain_greedy):
    outputs, stats = greedy(prompts, k)
    assert outputs == plain_greedy
    assert stats.num_drafts > 0 and stats.mean_accepted_length > 1.3   # drafts are meaningful
