"""Qwen3_5ForCausalLM (own implementation) against transformers, plus chunked prefill, the
arithmetic rollback of the linear-attention state slots at model level, and the fused residual
add + norm equal bit for bit to a separate add and norm."""
from __future__ import annotations

import pytest
import torch

from lmdeploy_lite.pytorch.config import CacheConfig
from lmdeploy_lite.pytorch.cache_engine import CacheEngine
from lmdeploy_lite.pytorch.models.loader import build_model
from tests.helpers.step_inputs import make_inputs, shuffled_block_tables
from tests.helpers.tiny_models import make_tiny_checkpoint, make_tiny_hf_model

BLOCK_SIZE = 4
BLOCKS_PER_SEQ = 40
PROMPT_LENS = [5, 70, 9]          # 70 > 64 spans two chunks of the chunked delta rule


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor, what: str, rel: float = 1e-5):
    """Norm-relative error below `rel`, and elementwise rtol 1e-5 with a small atol."""
    ref = ref.to(ours.dtype)
    err = ((ours - ref).norm() / ref.norm()).item()
    assert err < rel, f'{what}: relative error {err:.2e} >= {rel:.0e}'
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=5e-5 * ref.abs().max().item(), msg=what)


class TrajectoryError:
    """Norm-relative error accumulated over a whole decode run. In float32 transformers' own
    result drifts from the float64 truth by up to ~1.5e-5 at single steps (ours by ~2e-6), so
    single steps get a 5e-5 bound and the whole run the 1e-5 one."""

    def __init__(self):
        self.diff_sq, self.ref_sq = 0.0, 0.0

    def add(self, ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
        ref = ref.to(ours.dtype)
        assert_logits_close(ours, ref, what, rel=5e-5)
        self.diff_sq += (ours - ref).norm().item() ** 2
        self.ref_sq += ref.norm().item() ** 2

    def check(self, rel: float = 1e-5) -> None:
        err = (self.diff_sq / self.ref_sq) ** 0.5
        assert err < rel, f'decode run: relative error {err:.2e} >= {rel:.0e}'


@pytest.fixture(scope='module')
def checkpoints(tmp_path_factory):
    root = str(tmp_path_factory.mktemp('ckpt'))
    return {(moe, layout): make_tiny_checkpoint(root, moe=moe, layout=layout)
            for moe in (False, True) for layout in ('plain', 'multimodal')}


def new_caches(model, num_seqs: int, num_spec: int = 0, dtype=torch.float32) -> CacheEngine:
    cache_config = CacheConfig(block_size=BLOCK_SIZE, num_blocks=num_seqs * BLOCKS_PER_SEQ + 1,
                               num_state_slots=num_seqs + 1, num_spec_tokens=num_spec)
    return CacheEngine(model.config, cache_config, dtype, 'cpu')


def prompts(seed: int = 1, lens=PROMPT_LENS) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 512, (n,), generator=gen) for n in lens]


@pytest.mark.parametrize('layout', ['plain', 'multimodal'])
@pytest.mark.parametrize('moe', [False, True], ids=['dense', 'moe'])
@torch.no_grad()
def test_matches_transformers_prefill_then_32_decode_steps(checkpoints, moe, layout):
    model = build_model(checkpoints[(moe, layout)], torch.float32, 'cpu', progress=False)
    ref = make_tiny_hf_model(moe)
    seqs = prompts()
    batch = len(seqs)
    caches = new_caches(model, batch)
    tables = shuffled_block_tables(batch, BLOCKS_PER_SEQ)
    slots = [2, 0, 1]                                       # state rows need not follow batch order

    inputs = make_inputs(seqs, [0] * batch, tables, slots)
    logits = model.compute_logits(model(inputs, caches))
    assert logits.dtype == torch.float32
    ref_cache, last, start = [], [], 0
    for b, seq in enumerate(seqs):
        out = ref(seq[None], use_cache=True)
        ours = logits[start:start + len(seq)]
        assert_logits_close(ours, out.logits[0], f'prefill seq {b}')
        ref_cache.append(out.past_key_values)
        last.append(ours[-1])
        start += len(seq)

    lens = [len(s) for s in seqs]
    decode_error = TrajectoryError()
    for step in range(32):
        next_tokens = [int(x.argmax()) for x in last]
        inputs = make_inputs([[t] for t in next_tokens], lens, tables, slots, is_decoding=True)
        logits = model.compute_logits(model(inputs, caches))
        last = []
        for b, token in enumerate(next_tokens):
            out = ref(torch.tensor([[token]]), past_key_values=ref_cache[b], use_cache=True)
            ref_cache[b] = out.past_key_values
            decode_error.add(logits[b], out.logits[0, -1], f'decode step {step} seq {b}')
            last.append(logits[b])
        lens = [n + 1 for n in lens]
    decode_error.check()


@pytest.mark.parametrize('moe', [False, True], ids=['dense', 'moe'])
@torch.no_grad()
def test_chunked_prefill_equals_one_shot(checkpoints, moe):
    model = build_model(checkpoints[(moe, 'plain')], torch.float32, 'cpu', progress=False)
    seqs = prompts(seed=2, lens=[70, 23])
    tables = shuffled_block_tables(2, BLOCKS_PER_SEQ)
    one_shot_caches = new_caches(model, 2)
    one_shot = model.compute_logits(model(make_inputs(seqs, [0, 0], tables, [0, 1]),
                                          one_shot_caches))
    caches = new_caches(model, 2)
    cuts = [37, 10]
    first = model.compute_logits(model(make_inputs(
        [s[:c] for s, c in zip(seqs, cuts)], [0, 0], tables, [0, 1]), caches))
    second = model.compute_logits(model(make_inputs(
        [s[c:] for s, c in zip(seqs, cuts)], cuts, tables, [0, 1]), caches))
    chunked = torch.cat([first[:37], second[:33], first[37:], second[33:]])
    assert_logits_close(chunked, one_shot, 'chunked vs one-shot prefill')
    # and the caches continue identically
    step = make_inputs([[7], [9]], [70, 23], tables, [0, 1], is_decoding=True)
    assert_logits_close(model.compute_logits(model(step, caches)),
                        model.compute_logits(model(step, one_shot_caches)), 'decode after chunks')


@pytest.mark.parametrize('moe', [False, True], ids=['dense', 'moe'])
@torch.no_grad()
def test_verify_step_rollback_equals_fresh_prefill(checkpoints, moe):
    """Verify n = 1 + num_spec tokens per sequence (per-token state slots), accept j + 1 of them,
    decode one more token reading slot j: equals a fresh prefill of the accepted tokens."""
    num_spec = 3
    model = build_model(checkpoints[(moe, 'plain')], torch.float32, 'cpu', progress=False)
    seqs = prompts(seed=3, lens=[11, 6])
    drafts = [torch.tensor([5, 17, 33, 2]), torch.tensor([40, 41, 42, 43])]
    tables = shuffled_block_tables(2, BLOCKS_PER_SEQ)
    for accepted in ((1, 4), (2, 3), (3, 2), (4, 1)):
        caches = new_caches(model, 2, num_spec)
        model(make_inputs(seqs, [0, 0], tables, [1, 0]), caches)
        lens = [len(s) for s in seqs]
        verify = model.compute_logits(model(make_inputs(drafts, lens, tables, [1, 0],
                                                        is_decoding=True), caches))
        bonus = [99, 100]
        after = make_inputs([[t] for t in bonus], [n + a for n, a in zip(lens, accepted)], tables,
                            [1, 0], state_index=[a - 1 for a in accepted], is_decoding=True)
        rolled = model.compute_logits(model(after, caches))

        fresh_caches = new_caches(model, 2)
        full = [torch.cat([s, d[:a], torch.tensor([t])])
                for s, d, a, t in zip(seqs, drafts, accepted, bonus)]
        fresh = model.compute_logits(model(make_inputs(full, [0, 0], tables, [0, 1]), fresh_caches))
        ends = torch.tensor([len(f) for f in full]).cumsum(0) - 1
        assert_logits_close(rolled, fresh[ends], f'rollback accepted={accepted}')
        starts = [0, len(drafts[0])]
        for b, (n, a) in enumerate(zip(lens, accepted)):   # verify logits too
            fresh_start = 0 if b == 0 else len(full[0])
            assert_logits_close(verify[starts[b]:starts[b] + a],
                                fresh[fresh_start + n - 1 + 1:fresh_start + n + a],
                                f'verify logits seq {b}')


def unfused_layer(layer, hidden, rope, cache, inputs) -> torch.Tensor:
    """A decoder layer as written before its residual adds were fused into the norms after them:
    `h = x + mixer(norm1(x)); out = h + mlp(norm2(h))`, each add a separate op."""
    normed = layer.input_layernorm(hidden)
    if layer.layer_type == 'linear_attention':
        mixed = layer.linear_attn(normed, cache, inputs)
    else:
        mixed = layer.self_attn(normed, rope, cache, inputs)
    hidden = hidden + mixed
    return hidden + layer.mlp(layer.post_attention_layernorm(hidden))


def unfused_forward(model, inputs, caches) -> torch.Tensor:
    m = model.model
    hidden = m.embed_tokens(inputs.input_ids)
    rope = m.rotary_emb(inputs.positions, hidden.dtype)
    for idx, layer in enumerate(m.layers):
        hidden = unfused_layer(layer, hidden, rope, caches[idx], inputs)
    return m.norm(hidden)


@pytest.mark.parametrize('dtype', [torch.float32, torch.float64])
@pytest.mark.parametrize('moe', [False, True], ids=['dense', 'moe'])
@torch.no_grad()
def test_fused_residual_norm_is_bit_identical(checkpoints, moe, dtype):
    """On the default backend the (hidden, residual) layer stack with `add_rms_norm` gives the
    very bits of a separate add and `rms_norm` (prefill, then a decode step)."""
    model = build_model(checkpoints[(moe, 'plain')], dtype, 'cpu', progress=False)
    seqs = prompts(seed=6, lens=[11, 70])
    tables = shuffled_block_tables(2, BLOCKS_PER_SEQ)
    fused_caches = new_caches(model, 2, dtype=dtype)
    unfused_caches = new_caches(model, 2, dtype=dtype)
    steps = [make_inputs(seqs, [0, 0], tables, [0, 1]),
             make_inputs([[7], [9]], [11, 70], tables, [0, 1], is_decoding=True)]
    for inputs in steps:
        fused = model(inputs, fused_caches)
        assert torch.equal(fused, unfused_forward(model, inputs, unfused_caches))


@torch.no_grad()
def test_float64_model_and_logits(checkpoints):
    """float64 runs in float64 end to end (transformers does not: it casts norms, RoPE and the
    delta rule to float32), so compare with transformers at float32 accuracy."""
    model = build_model(checkpoints[(True, 'plain')], torch.float64, 'cpu', progress=False)
    ref = make_tiny_hf_model(True)
    seq = prompts(seed=4, lens=[13])[0]
    caches = new_caches(model, 1, dtype=torch.float64)
    assert caches[0][0].dtype == torch.float64 and caches[0][1].dtype == torch.float64
    assert caches[3][0].dtype == torch.float64
    logits = model.compute_logits(model(make_inputs([seq], [0], shuffled_block_tables(1, 8), [0]),
                                        caches))
    assert logits.dtype == torch.float64
    assert_logits_close(logits, ref(seq[None]).logits[0], 'float64 prefill')


def test_shared_modules_and_tied_embeddings(tmp_path):
    path = make_tiny_checkpoint(str(tmp_path), moe=False, tie=True, with_mtp=False)
    model = build_model(path, torch.float32, 'cpu', progress=False)
    assert model.get_input_embeddings() is model.embed_tokens
    assert model.lm_head.weight is model.embed_tokens.weight
    ref = make_tiny_hf_model(False, tie=True)
    torch.testing.assert_close(model.embed_tokens.weight, ref.model.embed_tokens.weight)
