"""The batched (padded) default ops equal running them one sequence at a time, in float64:
mixed q_lens, chunked continuations, ragged verify, empty sequences, stale cache contents, and a
step split into several padding groups."""
from __future__ import annotations

import pytest
import torch

from lmdeploy_lite.pytorch.backends import get_backend
from lmdeploy_lite.pytorch.backends.default import varlen
from tests.helpers.step_inputs import make_inputs, shuffled_block_tables

ops = get_backend('cpu')
F64 = torch.float64


def randn(gen, *shape):
    return torch.randn(*shape, generator=gen, dtype=F64)


def batch_and_singles(q_lens, history_lens, slots, index, decoding):
    """The step's inputs and, for each sequence, the same sequence alone."""
    tables = shuffled_block_tables(len(q_lens), 32, seed=3)
    batch = make_inputs([[0] * n for n in q_lens], history_lens, tables, slots, index, decoding)
    singles = [make_inputs([[0] * n], [h], tables[b:b + 1], [s], [i], decoding)
               for b, (n, h, s, i) in enumerate(zip(q_lens, history_lens, slots, index))]
    return batch, singles


def run_both(op, flat_args, caches, q_lens, history_lens, slots, index, decoding):
    """op(*flat_args, *caches, inputs) (flat_args: [T, ...] per-token tensors) batched on copies of `caches` and sequence by sequence on
    other copies; returns (batched out, batched caches), (per-sequence out, per-sequence caches)."""
    batch, singles = batch_and_singles(q_lens, history_lens, slots, index, decoding)
    batched_caches = [c.clone() for c in caches]
    batched = op(*flat_args, *batched_caches, batch)
    single_caches = [c.clone() for c in caches]
    outs, start = [], 0
    for n, inputs in zip(q_lens, singles):
        outs.append(op(*(x[start:start + n] for x in flat_args), *single_caches, inputs))
        start += n
    return (batched, batched_caches), (torch.cat(outs), single_caches)


def assert_same(got, expected):
    (out, caches), (ref_out, ref_caches) = got, expected
    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
    for cache, ref in zip(caches, ref_caches):      # NaN (never written) must stay NaN
        torch.testing.assert_close(cache, ref, rtol=1e-12, atol=1e-12, equal_nan=True)


CASES = {   # q_lens, history_lens, state_index, is_decoding
    'prefill': ([5, 12, 0, 1, 70], [0, 0, 0, 0, 0], [0] * 5, False),
    'chunked': ([7, 3, 30, 0, 1], [6, 0, 9, 4, 33], [0, 1, 2, 0, 1], False),
    'decode': ([1, 1, 1, 1], [6, 9, 1, 20], [0, 2, 1, 3], True),
    'verify': ([4, 4, 4], [6, 9, 13], [3, 0, 1], True),
    'ragged_verify': ([4, 2, 3, 1, 0], [6, 9, 13, 2, 5], [3, 0, 1, 2, 0], True),
}


@pytest.fixture(params=[False, True], ids=['one_group', 'many_groups'])
def groups(request, monkeypatch):
    if request.param:
        monkeypatch.setattr(varlen, 'MAX_PADDED_ELEMENTS', 1)   # every sequence its own group
    return request.param


@pytest.mark.parametrize('case', list(CASES))
def test_paged_attention_batched_equals_per_sequence(case, groups):
    q_lens, hist, index, decoding = CASES[case]
    gen = torch.Generator().manual_seed(1)
    nq, nkv, d, block_size = 4, 2, 8, 4
    total = sum(q_lens)
    k_cache = torch.full((len(q_lens) * 32 + 1, block_size, nkv, d), float('nan'), dtype=F64)
    v_cache = k_cache.clone()
    tables = shuffled_block_tables(len(q_lens), 32, seed=3)
    for b, h in enumerate(hist):       # a history of finite keys; the rest of the cache is NaN
        for p in range(h):
            k_cache[tables[b, p // block_size], p % block_size] = randn(gen, nkv, d)
            v_cache[tables[b, p // block_size], p % block_size] = randn(gen, nkv, d)
    q, k, v = randn(gen, total, nq, d), randn(gen, total, nkv, d), randn(gen, total, nkv, d)

    def op(q, k, v, k_cache, v_cache, inputs):
        return ops.paged_attention(q, k, v, k_cache, v_cache, inputs, d ** -0.5)

    got, expected = run_both(op, (q, k, v), (k_cache, v_cache), q_lens, hist,
                             list(range(len(q_lens))), index, decoding)
    assert torch.isfinite(got[0]).all()
    assert_same(got, expected)


@pytest.mark.parametrize('case', list(CASES))
def test_causal_conv1d_batched_equals_per_sequence(case, groups):
    q_lens, hist, index, decoding = CASES[case]
    gen = torch.Generator().manual_seed(2)
    channels, kernel, num_spec = 6, 4, 3
    weight = randn(gen, channels, kernel)
    cache = randn(gen, len(q_lens) + 2, channels, kernel - 1 + num_spec)
    slots = [len(q_lens) + 1 - b for b in range(len(q_lens))]
    x = randn(gen, sum(q_lens), channels)
    conv = ops.causal_conv1d_update if decoding else ops.causal_conv1d_prefill

    def op(x, cache, inputs):
        return conv(x, weight, cache, inputs)

    assert_same(*run_both(op, (x,), (cache,), q_lens, hist, slots, index, decoding))


@pytest.mark.parametrize('case', list(CASES))
def test_gated_delta_rule_batched_equals_per_sequence(case, groups):
    q_lens, hist, index, decoding = CASES[case]
    gen = torch.Generator().manual_seed(3)
    nk, nv, dk, dv, num_spec = 2, 4, 8, 8, 3
    total = sum(q_lens)
    q, k, v = randn(gen, total, nk, dk), randn(gen, total, nk, dk), randn(gen, total, nv, dv)
    g = -torch.rand(total, nv, generator=gen, dtype=F64) * 0.5
    beta = torch.rand(total, nv, generator=gen, dtype=F64)
    cache = randn(gen, len(q_lens) + 2, 1 + num_spec, nv, dk, dv)
    slots = [len(q_lens) + 1 - b for b in range(len(q_lens))]
    op = ops.gated_delta_rule_decode if decoding else ops.gated_delta_rule_prefill
    assert_same(*run_both(op, (q, k, v, g, beta), (cache,), q_lens, hist, slots, index,
                          decoding))


def test_gated_delta_rule_padding_is_identity():
    """Zero-padded tokens (g = beta = 0, k = 0) leave the state bit-for-bit unchanged."""
    gen = torch.Generator().manual_seed(4)
    q, k, v = randn(gen, 1, 3, 4, 8), randn(gen, 1, 3, 4, 8), randn(gen, 1, 3, 4, 8)
    g, beta = -torch.rand(1, 3, 4, generator=gen, dtype=F64), torch.rand(1, 3, 4, dtype=F64)
    state = randn(gen, 1, 4, 8, 8)
    pad = lambda x: torch.cat([x, torch.zeros_like(x)], dim=1)       # noqa: E731
    from lmdeploy_lite.pytorch.backends.default.gated_delta_rule import (
        chunk_gated_delta_rule, recurrent_gated_delta_rule)
    _, states = recurrent_gated_delta_rule(*(pad(x) for x in (q, k, v, g, beta)), state)
    assert torch.equal(states[:, 3:], states[:, 2:3].expand(-1, 3, -1, -1, -1))
    _, final = chunk_gated_delta_rule(*(pad(x) for x in (q, k, v, g, beta)), state, chunk_size=2)
    _, final_unpadded = chunk_gated_delta_rule(q, k, v, g, beta, state, chunk_size=2)
    torch.testing.assert_close(final, final_unpadded, rtol=1e-13, atol=1e-13)
