"""The decode/verify paths of the default ops for steps where every sequence has the same number
of new tokens (`uniform_q_len`: whole-row state reads and writes, no padding, the in-place
one-sequence recurrent update) against the general padded path on the same step with
`uniform_q_len=None`: outputs and every cache entry, float64 and float32 (bf16-stored state
too), one and several sequences, fresh sequences, one token and a verify over several."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from lmdeploy_lite.pytorch.backends import get_backend
from tests.helpers.step_inputs import make_inputs, shuffled_block_tables

ops = get_backend('cpu')

CASES = [      # q_len, history_lens, state_slots, state_index, speculative slots
    (1, [9], [2], [0], 0),                 # plain decode, one sequence (in-place state)
    (1, [0], [1], [0], 0),                 # a fresh sequence
    (1, [9, 4, 0], [2, 0, 1], [0, 0, 0], 0),
    (1, [9, 4], [2, 0], [2, 1], 3),        # one token after a partly accepted verify
    (4, [9, 5], [1, 2], [1, 3], 3),        # verify, k = 3
    (4, [7], [0], [0], 3),
]


def _steps(q_len, history_lens, slots, index):
    """(uniform step, the same step for the general path)."""
    tables = shuffled_block_tables(len(history_lens), 8, seed=1)
    inputs = make_inputs([[0] * q_len for _ in history_lens], history_lens, tables, slots, index,
                         is_decoding=True)
    assert inputs.uniform_q_len == q_len
    return inputs, dataclasses.replace(inputs, uniform_q_len=None)


def _both(op, args, caches, inputs, general, rtol, atol):
    uniform_caches = [c.clone() for c in caches]
    general_caches = [c.clone() for c in caches]
    out = op(*args, *uniform_caches, inputs)
    ref = op(*args, *general_caches, general)
    torch.testing.assert_close(out, ref, rtol=rtol, atol=atol)
    for got, want in zip(uniform_caches, general_caches):
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol)


@pytest.mark.parametrize('dtype, state_dtype', [(torch.float64, torch.float64),
                                                (torch.float32, torch.float32),
                                                (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize('q_len, history_lens, slots, index, num_spec', CASES)
def test_uniform_decode_equals_general_path(q_len, history_lens, slots, index, num_spec, dtype,
                                            state_dtype):
    gen = torch.Generator().manual_seed(q_len * 10 + len(history_lens))
    inputs, general = _steps(q_len, history_lens, slots, index)
    tokens = q_len * len(history_lens)
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)

    def randn(*shape, dt=dtype):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dt)

    # causal conv1d, K = 4, conv rows of K - 1 + num_spec columns
    _both(ops.causal_conv1d_update, (randn(tokens, 6), randn(6, 4)), [randn(3, 6, 3 + num_spec)],
          inputs, general, **tol)
    # gated delta rule: nk = 2, nv = 4, dk = dv = 8
    nk, nv, d = 2, 4, 8
    g = -torch.rand(tokens, nv, generator=gen, dtype=torch.float64).to(dtype)
    beta = torch.rand(tokens, nv, generator=gen, dtype=torch.float64).to(dtype)
    args = (randn(tokens, nk, d), randn(tokens, nk, d), randn(tokens, nv, d), g, beta)
    _both(ops.gated_delta_rule_decode, args, [randn(3, 1 + num_spec, nv, d, d, dt=state_dtype)],
          inputs, general, **tol)
    # paged attention: nq = 4, n_kv = 2, block size 4
    k_cache, v_cache = randn(30, 4, 2, d), randn(30, 4, 2, d)
    _both(lambda q, k, v, kc, vc, i: ops.paged_attention(q, k, v, kc, vc, i, d ** -0.5),
          (randn(tokens, 4, d), randn(tokens, 2, d), randn(tokens, 2, d)), [k_cache, v_cache],
          inputs, general, **tol)


def test_per_step_indices_follow_a_reassigned_state_index():
    """The verify ops make their index tensors once per forward (`ModelInputs.derived`); those
    that depend on state_index are made again once it is reassigned: a second forward of the same
    inputs with another state_index equals one of fresh inputs, bit for bit."""
    gen = torch.Generator().manual_seed(7)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    tables = shuffled_block_tables(2, 8, seed=1)
    inputs = make_inputs([[0] * 4] * 2, [9, 5], tables, [1, 2], [1, 3], is_decoding=True)
    x, weight, conv = randn(8, 6), randn(6, 4), randn(3, 6, 6)
    nk, nv, d = 2, 4, 8
    args = (randn(8, nk, d), randn(8, nk, d), randn(8, nv, d), -torch.rand(8, nv, generator=gen,
            dtype=torch.float64), torch.rand(8, nv, generator=gen, dtype=torch.float64))
    state = randn(3, 4, nv, d, d)
    ops.causal_conv1d_update(x, weight, conv.clone(), inputs)
    ops.gated_delta_rule_decode(*args, state.clone(), inputs)
    inputs.state_index = torch.tensor([0, 2])
    fresh = make_inputs([[0] * 4] * 2, [9, 5], tables, [1, 2], [0, 2], is_decoding=True)
    for op, operands, cache in ((ops.causal_conv1d_update, (x, weight), conv),
                                (ops.gated_delta_rule_decode, args, state)):
        again, ref = cache.clone(), cache.clone()
        assert torch.equal(op(*operands, again, inputs), op(*operands, ref, fresh))
        assert torch.equal(again, ref)
