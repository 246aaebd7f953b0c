"""Every config field is checked once, with explicit ranges, so the engine thread never sees a
value it cannot handle; the sampler converts every value that passes (no model needed here)."""
import math

import pytest
import torch

from lmdeploy_lite import GenerationConfig, PytorchEngineConfig, SpeculativeConfig
from lmdeploy_lite.messages import GREEDY_TEMPERATURE, INT32_MAX, UINT64_MAX, short_repr
from lmdeploy_lite.pytorch.sampling import SamplingInputs, sample

BAD_GENERATION = [
    ('top_k', 10**309), ('top_k', 10**5000), ('top_k', 2**31), ('top_k', -1), ('top_k', 2.0),
    ('random_seed', 2**64), ('random_seed', -1), ('random_seed', '7'),
    ('max_new_tokens', 10**30), ('max_new_tokens', 0), ('max_new_tokens', True),
    ('temperature', math.inf), ('temperature', math.nan), ('temperature', 10**400),
    ('temperature', -1), ('temperature', '0.5'), ('temperature', True),
    ('top_p', math.nan), ('top_p', math.inf), ('top_p', -0.1), ('top_p', 1.5),
    ('do_sample', 'yes'), ('do_sample', 1), ('ignore_eos', 'no'), ('skip_special_tokens', None),
    ('stop_words', ['']), ('stop_words', [3]), ('stop_words', 'a \ud800'), ('stop_words', {'a'}),
    ('stop_token_ids', [2**31]), ('stop_token_ids', [-1]), ('stop_token_ids', ['3']),
    ('stop_token_ids', [True]), ('stop_token_ids', 10**309),
]


@pytest.mark.parametrize('name,value', BAD_GENERATION,
                         ids=[f'{n}={short_repr(v)}' for n, v in BAD_GENERATION])
def test_generation_config_rejects_out_of_range_values(name, value):
    with pytest.raises(ValueError, match=f'^{name}=') as e:
        GenerationConfig(**{name: value})
    assert len(str(e.value)) < 200                  # huge values are cut short in the message


def test_generation_config_accepts_the_edges_and_normalises():
    cfg = GenerationConfig(max_new_tokens=INT32_MAX, top_k=INT32_MAX, random_seed=UINT64_MAX,
                           temperature=2, top_p=1, stop_words='\n\n', stop_token_ids=7)
    assert cfg.stop_words == ('\n\n',)              # a bare str is one stop word, not characters
    assert cfg.stop_token_ids == (7,)
    assert type(cfg.temperature) is float and type(cfg.top_p) is float
    assert GenerationConfig(stop_words=['a', 'bc'], stop_token_ids=[1, 2]).stop_words == ('a', 'bc')
    torch.Generator().manual_seed(cfg.random_seed)  # the seed's range is the generator's


def test_below_the_floors_is_greedy():
    """temperature < 1e-5 or top_p < 1e-8 samples greedily (1e-300 used to overflow float32
    and sample token 0)."""
    for cfg in (GenerationConfig(do_sample=True, temperature=1e-300),
                GenerationConfig(do_sample=True, top_p=1e-300),
                GenerationConfig(do_sample=True, temperature=GREEDY_TEMPERATURE / 2)):
        assert cfg.is_greedy
    assert not GenerationConfig(do_sample=True, temperature=GREEDY_TEMPERATURE).is_greedy
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    logits[:, 0] = -1e4                                # token 0 is the least likely
    tiny = SamplingInputs.from_values([True] * 3, [1e-300, 1.0, 1e-6], [0, 0, 0],
                                      [1.0, 1e-300, 1.0], seeds=[1, 2, 3])
    assert tiny.all_greedy
    assert sample(logits, tiny).tolist() == logits.argmax(-1).tolist()


def test_every_valid_value_converts_in_the_sampler():
    """top_k past the vocabulary keeps every token (as 0 does); a huge temperature stays finite."""
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(0))
    def draw(top_k, temperature=0.7):
        return sample(logits, SamplingInputs.from_values([True] * 2, [temperature] * 2,
                                                         [top_k] * 2, [1.0] * 2, seeds=[5, 6]))
    assert draw(INT32_MAX).tolist() == draw(0).tolist()
    assert draw(10**30).tolist() == draw(0).tolist()      # clamped at use
    huge = draw(0, temperature=1e300)
    assert ((0 <= huge) & (huge < 50)).all()


@pytest.mark.parametrize('kw,match', [
    (dict(ep=2), r'ep=2: .*tp=1, dp=1'),                   # used to run without EP, silently
    (dict(tp=2, dp=2, ep=2), r'ep=2: .*tp=2, dp=2'),
    (dict(seed=2**64), '^seed='), (dict(seed=-1), '^seed='),
    (dict(cache_max_entry_count=math.nan), '^cache_max_entry_count='),
    (dict(cache_max_entry_count=True), '^cache_max_entry_count='),
    (dict(cache_max_entry_count=0), '^cache_max_entry_count='),
    (dict(max_batch_size=2**40), '^max_batch_size='), (dict(block_size=0), '^block_size='),
    (dict(session_len=10**309), '^session_len='), (dict(tp=2**31), '^tp='),
    (dict(eager_mode='no'), '^eager_mode='),
])
def test_engine_config_bounds(kw, match):
    with pytest.raises(ValueError, match=match):
        PytorchEngineConfig(**kw)


def test_engine_config_edges_pass():
    assert PytorchEngineConfig(tp=2, dp=2, ep=4).ep == 4
    assert PytorchEngineConfig(seed=UINT64_MAX, cache_max_entry_count=1).seed == UINT64_MAX


@pytest.mark.parametrize('kw', [dict(tp=2**40), dict(model=5), dict(ngram_min=10**309),
                                dict(num_speculative_tokens=9)])
def test_speculative_config_bounds(kw):
    with pytest.raises(ValueError, match=f'^{next(iter(kw))}='):
        SpeculativeConfig(**kw)
