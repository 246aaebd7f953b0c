"""backends/default ops against straightforward references (and transformers' torch kernels),
including the per-token state slots of decode/verify and the arithmetic rollback."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lmdeploy_lite.pytorch.backends import get_backend
from tests.helpers.step_inputs import make_inputs, shuffled_block_tables

ops = get_backend('cpu')
GEN = torch.Generator().manual_seed(0)


def randn(*shape, dtype=torch.float32):
    return torch.randn(*shape, generator=GEN, dtype=dtype)


def step(q_lens, history_lens, slots=None, index=None, decoding=False, blocks_per_seq=16):
    batch = len(q_lens)
    return make_inputs([[0] * n for n in q_lens], history_lens,
                       shuffled_block_tables(batch, blocks_per_seq, seed=batch),
                       slots or list(range(batch)), index, decoding)


# ----------------------------------------------------------------------------- paged attention

def dense_attention(q, k, v, scale):
    """q [n, nq, d] at the last n positions of k/v [L, nkv, d]; causal."""
    n, nq, _ = q.shape
    group = nq // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    mask = torch.ones(n, k.shape[0], dtype=torch.bool).tril(k.shape[0] - n)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         attn_mask=mask, scale=scale)
    return out.transpose(0, 1)


@pytest.mark.parametrize('schedule', [
    [[5, 12, 1]],                          # prefill, mixed lengths
    [[7, 3], [6, 9]],                      # chunked prefill continuing both sequences
    [[6, 9], [1, 1], [1, 1]],              # decode, 1 token
    [[6, 9], [4, 4], [4, 4]],              # verify, k + 1 = 4 tokens
])
def test_paged_attention_matches_dense(schedule):
    nq, nkv, d, block_size = 4, 2, 8, 4
    batch = len(schedule[0])
    k_cache = torch.zeros(batch * 16 + 1, block_size, nkv, d)
    v_cache = torch.zeros_like(k_cache)
    keys = [torch.empty(0, nkv, d) for _ in range(batch)]
    values = [torch.empty(0, nkv, d) for _ in range(batch)]
    hist = [0] * batch
    for i, q_lens in enumerate(schedule):
        inputs = step(q_lens, hist, decoding=i > 0 and len(schedule) > 2)
        total = sum(q_lens)
        q, k, v = randn(total, nq, d), randn(total, nkv, d), randn(total, nkv, d)
        out = ops.paged_attention(q, k, v, k_cache, v_cache, inputs, d ** -0.5)
        start = 0
        for b, n in enumerate(q_lens):
            keys[b] = torch.cat([keys[b], k[start:start + n]])
            values[b] = torch.cat([values[b], v[start:start + n]])
            ref = dense_attention(q[start:start + n], keys[b], values[b], d ** -0.5)
            torch.testing.assert_close(out[start:start + n], ref, rtol=1e-5, atol=1e-6)
            start += n
        hist = [h + n for h, n in zip(hist, q_lens)]


# ----------------------------------------------------------------------------- gated delta rule

def gdn_inputs(total, nk=2, nv=4, dk=8, dv=8):
    q, k, v = randn(total, nk, dk), randn(total, nk, dk), randn(total, nv, dv)
    g = -torch.rand(total, nv, generator=GEN) * 0.5
    beta = torch.rand(total, nv, generator=GEN)
    return q, k, v, g, beta


def hf_reference(q, k, v, g, beta, state=None, chunked=True):
    """transformers' torch kernels for one sequence; returns o [n, nv, dv], final state."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import (
        torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule)
    ratio = v.shape[1] // q.shape[1]
    q, k = q.repeat_interleave(ratio, 1), k.repeat_interleave(ratio, 1)
    fn = torch_chunk_gated_delta_rule if chunked else torch_recurrent_gated_delta_rule
    o, final = fn(q[None], k[None], v[None], g[None], beta[None],
                  initial_state=None if state is None else state[None],
                  output_final_state=True, use_qk_l2norm_in_kernel=True)
    return o[0], final[0]


def test_chunk_and_recurrent_forms_match_transformers():
    n = 150                                                 # 3 chunks of 64, last one padded
    q, k, v, g, beta = gdn_inputs(n)
    state = randn(4, 8, 8)
    ref_o, ref_state = hf_reference(q, k, v, g, beta, state)
    inputs = step([n], [5], slots=[1], index=[2])
    cache = torch.zeros(3, 4, 4, 8, 8)
    cache[1, 2] = state
    out = ops.gated_delta_rule_prefill(q, k, v, g, beta, cache, inputs)
    torch.testing.assert_close(out, ref_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache[1, 0], ref_state, rtol=1e-5, atol=1e-5)
    rec_o, rec_state = hf_reference(q, k, v, g, beta, state, chunked=False)
    torch.testing.assert_close(out, rec_o, rtol=1e-5, atol=1e-5)


def test_prefill_batch_fresh_and_chunked_continuation():
    lens = [9, 70, 1]
    q, k, v, g, beta = gdn_inputs(sum(lens))
    cache = torch.full((4, 2, 4, 8, 8), 7.0)                # garbage: fresh sequences ignore it
    out = ops.gated_delta_rule_prefill(q, k, v, g, beta, cache, step(lens, [0, 0, 0], [3, 0, 1]))
    start = 0
    for b, (n, slot) in enumerate(zip(lens, [3, 0, 1])):
        sl = slice(start, start + n)
        ref_o, ref_state = hf_reference(q[sl], k[sl], v[sl], g[sl], beta[sl])
        torch.testing.assert_close(out[sl], ref_o, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(cache[slot, 0], ref_state, rtol=1e-5, atol=1e-5)
        start += n
    # chunked: the 70-token sequence as 30 + 40
    cache2 = torch.zeros(1, 2, 4, 8, 8)
    sl = slice(9, 79)
    parts = [(slice(9, 39), 0), (slice(39, 79), 30)]
    outs = [ops.gated_delta_rule_prefill(q[p], k[p], v[p], g[p], beta[p], cache2,
                                         step([p.stop - p.start], [h], [0])) for p, h in parts]
    torch.testing.assert_close(torch.cat(outs), out[sl], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache2[0, 0], cache[0, 0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('q_lens', [[4, 4, 4], [4, 2, 3]], ids=['equal', 'ragged'])
def test_decode_writes_per_token_slots_and_rollback(q_lens):
    """After a verify step over n tokens, slot j holds the state after token j, i.e. a fresh
    prefill of the tokens up to j; continuing from slot j equals continuing that prefill."""
    num_spec = 3
    batch = len(q_lens)
    slots, index = [2, 0, 1], [1, 3, 0]
    cache = randn(3, 1 + num_spec, 4, 8, 8)
    start_states = cache[slots, index].clone()
    q, k, v, g, beta = gdn_inputs(sum(q_lens))
    inputs = step(q_lens, [10] * batch, slots, index, decoding=True)
    out = ops.gated_delta_rule_decode(q, k, v, g, beta, cache, inputs)
    start = 0
    for b, n in enumerate(q_lens):
        sl = slice(start, start + n)
        ref_o, _ = hf_reference(q[sl], k[sl], v[sl], g[sl], beta[sl], start_states[b],
                                chunked=False)
        torch.testing.assert_close(out[sl], ref_o, rtol=1e-5, atol=1e-5)
        for j in range(n):
            p = slice(start, start + j + 1)
            _, ref_state = hf_reference(q[p], k[p], v[p], g[p], beta[p], start_states[b])
            torch.testing.assert_close(cache[slots[b], j], ref_state, rtol=1e-5, atol=1e-5)
        start += n
    # rollback: accept a tokens (index a - 1), decode one more token
    accepted = [min(2, n) for n in q_lens]
    q2, k2, v2, g2, beta2 = gdn_inputs(batch)
    expected = []
    start = 0
    for b, (n, a) in enumerate(zip(q_lens, accepted)):
        p = slice(start, start + a)
        qa, ka, va, ga, ba = (torch.cat([x[p], y[b:b + 1]]) for x, y in
                              zip((q, k, v, g, beta), (q2, k2, v2, g2, beta2)))
        expected.append(hf_reference(qa, ka, va, ga, ba, start_states[b])[0][-1])
        start += n
    inputs = step([1] * batch, [10 + a for a in accepted], slots, [a - 1 for a in accepted], True)
    out2 = ops.gated_delta_rule_decode(q2, k2, v2, g2, beta2, cache, inputs)
    torch.testing.assert_close(out2, torch.stack(expected), rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- causal conv1d

def conv_reference(x, weight, window=None):
    """silu(causal depthwise conv) of x [n, C] preceded by window [C, K-1] (zeros if None)."""
    kernel = weight.shape[1]
    if window is None:
        window = torch.zeros(x.shape[1], kernel - 1)
    full = torch.cat([window, x.t()], 1)
    return F.silu(F.conv1d(full[None], weight[:, None], groups=x.shape[1])[0]).t()


def test_conv_prefill_fresh_chunked_and_short():
    channels, kernel = 6, 4
    weight = randn(channels, kernel)
    lens = [9, 2, 5]
    x = randn(sum(lens), channels)
    cache = torch.full((4, channels, kernel - 1 + 2), 5.0)
    out = ops.causal_conv1d_prefill(x, weight, cache, step(lens, [0, 0, 0], [3, 1, 0]))
    start = 0
    for n, slot in zip(lens, [3, 1, 0]):
        xs = x[start:start + n]
        torch.testing.assert_close(out[start:start + n], conv_reference(xs, weight))
        window = torch.cat([torch.zeros(channels, kernel - 1), xs.t()], 1)[:, -(kernel - 1):]
        torch.testing.assert_close(cache[slot, :, :kernel - 1], window)   # left-zero-padded
        start += n
    # the 9-token sequence as 4 + 5, continuing from the window at index 0
    cache2 = torch.zeros(1, channels, kernel - 1)
    first = ops.causal_conv1d_prefill(x[:4], weight, cache2, step([4], [0], [0]))
    second = ops.causal_conv1d_prefill(x[4:9], weight, cache2, step([5], [4], [0]))
    torch.testing.assert_close(torch.cat([first, second]), out[:9])
    torch.testing.assert_close(cache2[0], cache[3, :, :kernel - 1])


@pytest.mark.parametrize('q_lens', [[4, 4], [1, 3]], ids=['equal', 'ragged'])
def test_conv_update_window_buffer_and_rollback(q_lens):
    channels, kernel, num_spec = 6, 4, 3
    weight = randn(channels, kernel)
    cache = randn(2, channels, kernel - 1 + num_spec)
    slots, index = [1, 0], [2, 0]
    windows = [cache[s, :, i:i + kernel - 1].clone() for s, i in zip(slots, index)]
    x = randn(sum(q_lens), channels)
    inputs = step(q_lens, [8, 8], slots, index, decoding=True)
    out = ops.causal_conv1d_update(x, weight, cache, inputs)
    start = 0
    for b, n in enumerate(q_lens):
        xs = x[start:start + n]
        torch.testing.assert_close(out[start:start + n], conv_reference(xs, weight, windows[b]))
        history = torch.cat([windows[b], xs.t()], 1)
        for j in range(n):            # accepted j + 1 tokens -> window at index j
            torch.testing.assert_close(cache[slots[b], :, j:j + kernel - 1],
                                       history[:, j + 1:j + kernel])
        start += n
    # rollback to index a - 1 and feed one token
    accepted = [1, 2] if q_lens[1] >= 2 else [1, 1]
    x2 = randn(2, channels)
    inputs = step([1, 1], [8 + a for a in accepted], slots, [a - 1 for a in accepted], True)
    out2 = ops.causal_conv1d_update(x2, weight, cache, inputs)
    start = 0
    for b, (n, a) in enumerate(zip(q_lens, accepted)):
        history = torch.cat([windows[b], x[start:start + a].t()], 1)[:, -(kernel - 1):]
        torch.testing.assert_close(out2[b:b + 1], conv_reference(x2[b:b + 1], weight, history))
        start += n


# ----------------------------------------------------------------------------- norms

@pytest.mark.parametrize('dtype', [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize('shape', [(1, 256), (4, 4, 64), (33, 128)])
def test_norms_are_f_rms_norm_bit_for_bit(dtype, shape):
    """rms_norm / gated_rms_norm run F.rms_norm's own ops (cheaper): the very bits, contiguous,
    for contiguous and transposed inputs."""
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    weight = (0.1 * randn(shape[-1])).to(dtype)
    gate = randn(*shape).to(dtype)
    transposed = randn(*shape[:-2], shape[-1], shape[-2]).to(dtype).mT
    for x in (randn(*shape).to(dtype), transposed):
        ref = F.rms_norm(x.to(acc), shape[-1:], 1.0 + weight.to(acc), 1e-6).to(dtype)
        out = ops.rms_norm(x, weight, 1e-6)
        assert torch.equal(out, ref) and out.is_contiguous()
        ref = weight * F.rms_norm(x.to(acc), shape[-1:], None, 1e-6).to(dtype)
        ref = (ref * F.silu(gate.to(acc))).to(dtype)
        assert torch.equal(ops.gated_rms_norm(x, gate, weight, 1e-6), ref)
