"""Penalties (issue 22, part 3): repetition_penalty (HF/lmdeploy), presence_penalty and
frequency_penalty (OpenAI, as vLLM), exact under speculation.

Greedy float64 output with each penalty, and with all three, equals a greedy loop over
transformers' logits with `RepetitionPenaltyLogitsProcessor` and the presence/frequency rule
written out (over generated tokens only): on tiny random dense and MoE checkpoints (a batch of
prompts of different lengths, penalised and unpenalised rows together; prefilled whole, and in
chunks with async scheduling on), and on the embedded model with MTP k=3, whose head accepts
drafts (asserted first, for every penalised request): at verify position j the penalty counts
the drafts before j, so speculative output equals plain output. Sampled rows are reproducible
from a seed; bad values are ValueErrors naming the field.
"""
import json
import os
import re

import pytest
import torch

from lmdeploy_lite.messages import GenerationConfig, PytorchEngineConfig
from lmdeploy_lite.pytorch.engine.build import build_engine
from lmdeploy_lite.pytorch.engine.engine import Engine
from lmdeploy_lite.pytorch.sampling import Penalties, SamplingInputs, apply_penalties, sample
from lmdeploy_lite.pytorch.spec_decode.rejection import rejection_sample
from tests.helpers import accepting

TINY = dict(dtype='float64', device='cpu', block_size=4, session_len=128)
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], list(range(20, 57)), [300, 301, 2, 450, 3, 3, 3, 17]]
CASES = {
    'repetition': dict(repetition_penalty=1.3),
    'presence': dict(presence_penalty=0.8),
    'frequency': dict(frequency_penalty=0.6),
    'combined': dict(repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.3),
    # a negative frequency penalty favours the tokens drafted earlier in the same verify: the
    # case where forgetting to count them shows soonest
    'negative': dict(frequency_penalty=-0.5),
}


def gen(case: str, max_new_tokens: int, **kw) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=max_new_tokens, ignore_eos=True, **CASES.get(case, {}),
                            **kw)


def hf_greedy(model, prompt: list[int], configs: list[GenerationConfig]) -> list[list[int]]:
    """Greedy tokens from transformers' logits (float64, KV cache), one row per config on the
    same prompt: RepetitionPenaltyLogitsProcessor over prompt + output, then
    logit -= frequency * count + presence * (count > 0) over the output's counts."""
    from transformers import RepetitionPenaltyLogitsProcessor
    processors = [RepetitionPenaltyLogitsProcessor(c.repetition_penalty) for c in configs]
    ids = torch.tensor([prompt] * len(configs))
    out = model(input_ids=ids, use_cache=True)
    counts = torch.zeros(len(configs), out.logits.shape[-1], dtype=torch.float64)
    for _ in range(max(c.max_new_tokens for c in configs)):
        logits = out.logits[:, -1].to(torch.float64)
        next_ids = []
        for row, (config, repetition) in enumerate(zip(configs, processors)):
            scores = repetition(ids[row:row + 1], logits[row:row + 1])[0]
            scores = (scores - config.frequency_penalty * counts[row]
                      - config.presence_penalty * (counts[row] > 0).to(scores.dtype))
            next_ids.append(int(scores.argmax()))
            counts[row, next_ids[-1]] += 1
        ids = torch.cat([ids, torch.tensor(next_ids)[:, None]], 1)
        out = model(input_ids=ids[:, -1:], past_key_values=out.past_key_values, use_cache=True)
    return [ids[row, len(prompt):len(prompt) + c.max_new_tokens].tolist()
            for row, c in enumerate(configs)]


def hf_reference(model, rows: list[tuple[list[int], GenerationConfig]]) -> list[list[int]]:
    """hf_greedy for (prompt, config) rows, the rows of one prompt as one batch."""
    out = {}
    with torch.no_grad():
        for prompt in {tuple(p) for p, _ in rows}:
            mine = [i for i, (p, _) in enumerate(rows) if tuple(p) == prompt]
            for i, ids in zip(mine, hf_greedy(model, list(prompt), [rows[i][1] for i in mine])):
                out[i] = ids
    return [out[i] for i in range(len(rows))]


def run(engine: Engine, prompts, configs) -> list:
    seqs = [engine.add_request(list(p), c) for p, c in zip(prompts, configs, strict=True)]
    while engine.has_work:
        engine.step()
    return seqs


# ---- the penalty rule on hand-made logits -------------------------------------------------------
def test_apply_penalties_by_hand():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0], [2.0, -1.0, 0.5, 3.0]], dtype=torch.float64)
    penalties = Penalties.from_values(
        repetition=[2.0, 1.0], presence=[0.0, 0.5], frequency=[0.0, 0.25],
        prompt_ids=[[0], [0]], output_ids=[[1, 1], [3, 3, 2]])
    out = apply_penalties(logits, penalties)
    # row 0: tokens 0 (prompt) and 1 (output) seen: 2 / 2, -1 * 2; row 1: the prompt is ignored,
    # token 3 twice: 3 - 0.25 * 2 - 0.5, token 2 once: 0.5 - 0.25 - 0.5
    assert out.tolist() == [[1.0, -2.0, 0.5, 3.0], [2.0, -1.0, -0.25, 2.0]]
    assert torch.equal(logits[0], torch.tensor([2.0, -1.0, 0.5, 3.0], dtype=torch.float64))


def test_verify_position_counts_the_drafts_before_it():
    """Drafts [3, 3]: position 0 counts no draft, 1 counts one 3, 2 counts two."""
    logits = torch.tensor([[3.0, 0.0, 0.0, 2.0]], dtype=torch.float64).expand(1, 3, 4)
    penalties = Penalties.from_values([1.0], [0.0], [0.75], [[]], [[]])
    out = apply_penalties(logits, penalties, torch.tensor([[0, 0]]))
    assert out[0, :, 0].tolist() == [3.0, 2.25, 1.5]
    # greedy verify: target argmax 0, 0, then 3 (1.5 < 2): both drafts accepted, bonus 3; a
    # -1 placeholder counts nothing
    sampling = SamplingInputs.greedy(1)
    sampling.penalties = penalties
    tokens, accepted = rejection_sample(logits, torch.tensor([[0, 0]]), None, sampling)
    assert tokens.tolist() == [[0, 0, 3]] and accepted.tolist() == [2]
    tokens, accepted = rejection_sample(logits, torch.tensor([[0, -1]]), None, sampling,
                                        torch.tensor([1]))
    assert tokens.tolist() == [[0, 0, -1]] and accepted.tolist() == [1]
    assert sample(logits[:, 0], sampling).tolist() == [0]


def test_verify_penalties_equal_the_rule_written_out_per_position():
    """Random verifies (k 1..4, placeholders, repeated drafts, every kind of penalty) against
    the rule applied position by position over the tokens before it, bit for bit."""
    generator = torch.Generator().manual_seed(0)

    def draw(low, high, size):
        return torch.randint(low, high, size, generator=generator).tolist()
    batch, vocab_size = 3, 7
    for _ in range(60):
        k = draw(1, 5, (1,))[0]
        logits = 3 * torch.randn(batch, k + 1, vocab_size, generator=generator,
                                 dtype=torch.float64)
        drafts = torch.randint(-1, vocab_size, (batch, k), generator=generator)
        repetition = (0.3 + 2 * torch.rand(batch, generator=generator)).tolist()
        presence, frequency = (4 * torch.rand(2, batch, generator=generator) - 2).tolist()
        prompts = [draw(0, vocab_size, (n,)) for n in draw(0, 4, (batch,))]
        outputs = [draw(0, vocab_size, (n,)) for n in draw(0, 5, (batch,))]
        penalties = Penalties.from_values(repetition, presence, frequency, prompts, outputs)
        want = logits.clone()
        for b in range(batch):
            for j in range(k + 1):
                before = outputs[b] + [d for d in drafts[b, :j].tolist() if d >= 0]
                for token in range(vocab_size):
                    x, count = want[b, j, token], before.count(token)
                    if token in prompts[b] or count:
                        x = x * repetition[b] if x < 0 else x / repetition[b]
                    want[b, j, token] = x - frequency[b] * count - presence[b] * (count > 0)
        assert torch.equal(apply_penalties(logits, penalties, drafts), want)
        assert torch.equal(apply_penalties(logits[:, 0], penalties), want[:, 0])


# ---- tiny random checkpoints against transformers ---------------------------------------------
@pytest.fixture(scope='module')
def tiny_rows():
    """Every prompt with every case and without a penalty, as one batch."""
    names = list(CASES) + ['none']
    return [(p, c) for p in PROMPTS for c in names]


@pytest.mark.parametrize('moe', [False, True])
def test_tiny_greedy_penalties_equal_transformers(moe, tiny_ckpt, tiny_rows):
    from tests.helpers.tiny_models import make_tiny_hf_model
    path = tiny_ckpt(moe, layout='plain')
    prompts = [p for p, _ in tiny_rows]
    configs = [gen(c, 12) for _, c in tiny_rows]
    plain = build_engine(path, PytorchEngineConfig(**TINY), progress=False)
    got = [s.generated_ids for s in run(plain, prompts, configs)]
    hf = make_tiny_hf_model(moe).to(torch.float64).eval()
    if moe:
        hf.set_experts_implementation('eager')          # grouped_mm has no float64 kernel
    want = hf_reference(hf, list(zip(prompts, configs)))
    assert got == want
    # prefilled in chunks, and with async scheduling on (the rows without a penalty share
    # the batch, so it runs synchronously)
    chunked = build_engine(path, PytorchEngineConfig(**TINY, max_prefill_token_num=7,
                                               async_scheduling=True), progress=False)
    assert [s.generated_ids for s in run(chunked, prompts, configs)] == want


# ---- the embedded model under MTP k=3 -----------------------------------------------------------
@pytest.fixture(scope='module')
def embedded_hf():
    """transformers' Qwen3_5MoeForCausalLM with the embedded model's weights, float64."""
    from safetensors import safe_open
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    from lmdeploy_lite.pytorch.models.loader import checkpoint_files
    path = accepting.model_dir()
    with open(os.path.join(path, 'config.json')) as f:
        config = Qwen3_5MoeTextConfig(**json.load(f)['text_config'])
    model = Qwen3_5MoeForCausalLM(config)
    state = {}
    for file, names in checkpoint_files(path).items():
        with safe_open(file, 'pt') as f:
            for name in names:
                if not name.startswith('mtp.'):
                    state[name.replace('model.language_model.', 'model.', 1)] = f.get_tensor(name)
    model.load_state_dict(state, strict=True)
    model = model.to(torch.float64).eval()
    model.set_experts_implementation('eager')
    return model


def test_mtp_greedy_penalties_equal_plain_and_transformers(embedded_hf):
    prompts = [list(p) for p in accepting.prompts()]
    rows = [(p, c) for c in CASES for p in prompts]
    configs = [gen(c, 16) for _, c in rows]
    prompts = [p for p, _ in rows]
    engine_config = PytorchEngineConfig(**accepting.BASE)
    # async scheduling on: a penalised batch must still run synchronously (its penalties count
    # the tokens of the step before)
    engine = build_engine(accepting.model_dir(), PytorchEngineConfig(**accepting.BASE,
                                                               async_scheduling=True),
                    accepting.spec(3), progress=False)
    speculative = run(engine, prompts, configs)
    assert engine.num_continued_steps == 0
    for seq, (_, case) in zip(speculative, rows):
        assert seq.spec_stats.num_accepted_tokens > 0, f'{case}: no draft accepted'
    accepting.assert_real_acceptance([s.spec_stats for s in speculative], 3)
    got = [s.generated_ids for s in speculative]
    plain = run(build_engine(accepting.model_dir(), engine_config, progress=False), prompts, configs)
    assert got == [s.generated_ids for s in plain]
    assert got == hf_reference(embedded_hf, list(zip(prompts, configs)))


# ---- sampling and validation --------------------------------------------------------------------
def test_sampled_rows_with_penalties_are_reproducible():
    prompts = [list(p) for p in accepting.prompts()]
    config = gen('combined', 16, do_sample=True, temperature=0.9, top_k=40, random_seed=7)
    engine = build_engine(accepting.model_dir(), PytorchEngineConfig(**accepting.BASE),
                    accepting.spec(3), progress=False)
    first = [s.generated_ids for s in run(engine, prompts, [config] * len(prompts))]
    again = [s.generated_ids for s in run(engine, prompts, [config] * len(prompts))]
    assert first == again and all(len(ids) == 16 for ids in first)
    unpenalised = [s.generated_ids for s in run(
        engine, prompts, [gen('none', 16, do_sample=True, temperature=0.9, top_k=40,
                              random_seed=7)] * len(prompts))]
    assert unpenalised != first


@pytest.mark.parametrize('field, value, allowed', [
    ('repetition_penalty', 0, '[0.01, 10]'), ('repetition_penalty', 10.5, '[0.01, 10]'),
    ('repetition_penalty', float('inf'), '[0.01, 10]'), ('presence_penalty', -2.1, '[-2, 2]'),
    ('presence_penalty', '1', '[-2, 2]'), ('frequency_penalty', 2.5, '[-2, 2]'),
    ('frequency_penalty', True, '[-2, 2]'),
])
def test_bad_penalty_names_the_field(field, value, allowed):
    with pytest.raises(ValueError, match=rf'^{field}=.*must be a number in {re.escape(allowed)}'):
        GenerationConfig(**{field: value})
    config = GenerationConfig(**{field: 1.5})
    assert getattr(config, field) == 1.5 and config.has_penalties
    assert not GenerationConfig(repetition_penalty=1, presence_penalty=0).has_penalties
