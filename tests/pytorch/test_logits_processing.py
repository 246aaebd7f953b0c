"""min_p, min_tokens and logit_bias (issue 36, item 4), exact under speculation.

logit_bias and min_tokens change the target's logits at every emitted position (min_tokens:
position j of a step is the request's (generated + j + 1)-th token), so float64 greedy output
with MTP k=3 on the embedded model (drafts accepted, asserted) equals plain greedy output and a
greedy loop over transformers' logits with the same processing. min_p filters what sampled rows
draw from (greedy rows are unchanged), in the rejection sampler's target distribution too.
"""
import math

import pytest
import torch

from lmdeploy_lite.messages import GenerationConfig, PytorchEngineConfig
from lmdeploy_lite.pytorch.engine.build import build_engine
from lmdeploy_lite.pytorch.sampling import SamplingInputs, probs_from_logits
from tests.helpers import accepting
from tests.pytorch.test_penalties import embedded_hf, run  # noqa: F401 (a fixture)

EOS = (0, 2)                                  # the embedded model's eos ids


def cases(plain: list[list[int]]) -> list[GenerationConfig]:
    """Per prompt: its plain greedy tokens banned (-100) and another favoured; eos pushed to
    the top (+100) but held off by min_tokens=6; min_tokens with nothing pushing eos."""
    out = []
    for tokens in plain:
        out.append(GenerationConfig(max_new_tokens=16, ignore_eos=True,
                                    logit_bias={tokens[0]: -100.0, tokens[3]: -100.0, 7: 3.5}))
        out.append(GenerationConfig(max_new_tokens=16, logit_bias={2: 100.0}, min_tokens=6))
        out.append(GenerationConfig(max_new_tokens=12, min_tokens=12))
    return out


def hf_greedy(model, prompt: list[int], configs: list[GenerationConfig]) -> list[list[int]]:
    """Greedy over transformers' float64 logits, one row per config on the same prompt (one
    batch): + logit_bias, eos at -inf before min_tokens, a row stops after eos unless ignore_eos
    (the batch runs on until every row has stopped)."""
    ids = torch.tensor([prompt] * len(configs))
    generated, done = [[] for _ in configs], [False] * len(configs)
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        while True:
            next_ids = []
            for row, config in enumerate(configs):
                scores = out.logits[row, -1].to(torch.float64).clone()
                for token, bias in (config.logit_bias or {}).items():
                    scores[token] += bias
                if len(generated[row]) < config.min_tokens:
                    scores[list(EOS)] = -math.inf
                next_ids.append(int(scores.argmax()))
                if not done[row]:
                    generated[row].append(next_ids[-1])
                    done[row] = len(generated[row]) == config.max_new_tokens or (
                        next_ids[-1] in EOS and not config.ignore_eos)
            if all(done):
                return generated
            out = model(input_ids=torch.tensor(next_ids)[:, None],
                        past_key_values=out.past_key_values, use_cache=True)


def test_mtp_greedy_bias_and_min_tokens_equal_plain_and_transformers(embedded_hf):  # noqa: F811
    prompts = [list(p) for p in accepting.prompts()]
    plain_engine = build_engine(accepting.model_dir(), PytorchEngineConfig(**accepting.BASE),
                                progress=False)
    unbiased = run(plain_engine, prompts, [GenerationConfig(max_new_tokens=4, ignore_eos=True)]
                   * len(prompts))
    configs = cases([s.generated_ids for s in unbiased])
    rows = [p for p in prompts for _ in range(3)]
    spec_engine = build_engine(accepting.model_dir(), PytorchEngineConfig(
        **accepting.BASE, async_scheduling=True), accepting.spec(3), progress=False)
    speculative = run(spec_engine, rows, configs)
    assert spec_engine.num_continued_steps == 0        # the host's tables need each step's tokens
    assert sum(s.spec_stats.num_accepted_tokens for s in speculative) > 0
    got = [s.generated_ids for s in speculative]
    assert got == [s.generated_ids for s in run(plain_engine, rows, configs)]
    assert got == [ids for i, p in enumerate(prompts)         # a prompt's three rows at once
                   for ids in hf_greedy(embedded_hf, p, configs[3 * i:3 * i + 3])]
    for ids, config in zip(got, configs):
        if config.logit_bias and 2 in config.logit_bias:     # eos right after min_tokens
            assert ids[:6] == [t for t in ids[:6] if t not in EOS] and ids[6] == 2
        if config.ignore_eos:
            assert not set(ids) & set(config.logit_bias) - {7}


def test_min_p_keeps_the_tokens_near_the_top_and_renormalises():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]],
                                    dtype=torch.float64))
    sampling = SamplingInputs.from_values([True, True], [1.0, 1.0], [0, 0], [1.0, 1.0])
    sampling.min_p = torch.tensor([0.25, 0.0])
    probs = probs_from_logits(logits, sampling)
    torch.testing.assert_close(probs[0], torch.tensor([0.5, 0.3, 0.15, 0.0],
                                                      dtype=torch.float64) / 0.95)
    torch.testing.assert_close(probs[1], logits[1].exp())              # min_p 0: off


def test_sampled_min_p_with_mtp_is_reproducible():
    prompts = [list(p) for p in accepting.prompts()]
    config = GenerationConfig(max_new_tokens=16, ignore_eos=True, do_sample=True,
                              temperature=0.8, min_p=0.3, random_seed=11)
    engine = build_engine(accepting.model_dir(), PytorchEngineConfig(**accepting.BASE),
                          accepting.spec(3), progress=False)
    first = [s.generated_ids for s in run(engine, prompts, [config] * len(prompts))]
    assert first == [s.generated_ids for s in run(engine, prompts, [config] * len(prompts))]
    assert all(len(ids) == 16 for ids in first)


@pytest.mark.parametrize('field, value, allowed', [
    ('min_p', 1.5, 'a number in [0, 1]'), ('min_tokens', 600, 'an integer in 0..512'),
    ('logit_bias', {3: 101}, 'a dict of token id -> a number in [-100, 100]'),
    ('logit_bias', {-1: 1}, 'a dict of token id'),
])
def test_bad_values_name_the_field(field, value, allowed):
    import re
    with pytest.raises(ValueError, match=rf'^{field}=.*must be {re.escape(allowed)}'):
        GenerationConfig(**{field: value})
