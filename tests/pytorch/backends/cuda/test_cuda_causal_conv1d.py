"""backends/cuda causal conv1d against backends/default: outputs and the WHOLE conv cache (columns
and rows a step must not touch stay unchanged). The kernels run in Triton's interpreter on CPU.
Outputs match to 1e-5 in float32, not bit for bit (the silu's exp is not torch's, and the GPU
fuses multiply-adds); the cache holds raw inputs and matches exactly."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from lmdeploy_lite.pytorch.backends import default
from lmdeploy_lite.pytorch.backends.cuda import causal_conv1d as cuda_conv
from tests.helpers.step_inputs import make_inputs, shuffled_block_tables

NUM_SLOTS, KERNEL = 7, 4


def check_step(op_name, q_lens, history_lens, slots, index, decoding, channels, num_spec, dtype,
               device, cache_dtype=None, parts=None, channel_minor=True):
    """Run the cuda op and the default op on the same inputs and identical cache copies (with
    `parts`, a prefill's three channel parts: each its own contiguous tensor on CUDA). The cache
    is channel-minor, as CacheEngine lays it out, unless `channel_minor` is False."""
    inputs = make_inputs([[0] * n for n in q_lens], history_lens,
                         shuffled_block_tables(len(q_lens), 4), slots, index, decoding).to(device)
    gen = torch.Generator().manual_seed(sum(q_lens))
    x = torch.randn(sum(q_lens), channels + 3, generator=gen).to(device, dtype)[:, 3:]  # a view
    weight = torch.randn(channels, 1, KERNEL, generator=gen).to(device, dtype)[:, 0]  # as the model
    cache = torch.randn(max(NUM_SLOTS, len(slots)), channels, KERNEL - 1 + num_spec,
                        generator=gen).to(device, cache_dtype or dtype)
    if channel_minor:
        cache = cache.transpose(1, 2).contiguous().transpose(1, 2)
    expected_cache = cache.clone()
    extra = {'parts': parts} if parts else {}
    out = getattr(cuda_conv, op_name)(x, weight, cache, inputs, **extra)
    expected = getattr(default, op_name)(x, weight, expected_cache, inputs, **extra)
    if parts:
        assert [p.shape for p in out] == [p.shape for p in expected] == [
            (sum(q_lens), n) for n in parts] and all(p.is_contiguous() for p in out)
        out, expected = torch.cat(out, dim=-1), torch.cat(expected, dim=-1)
    assert out.dtype == x.dtype
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)
    torch.testing.assert_close(cache, expected_cache, atol=0, rtol=0)   # raw inputs, copied


def dtypes(device):
    return [torch.float32, torch.float64] + ([torch.bfloat16] if device == 'cuda' else [])


@pytest.mark.parametrize('channel_minor', [True, False])
@pytest.mark.parametrize('num_tokens', [1, 4])
def test_update_matches_default(kernel_device, num_tokens, channel_minor):
    """3 sequences in non-contiguous rows 5, 1, 3, windows at columns 2, 0 (fresh: ignored), 3;
    300 channels (two blocks, the second partial); either layout of the cache."""
    for dtype in dtypes(kernel_device):
        check_step('causal_conv1d_update', [num_tokens] * 3, [7, 0, 12], [5, 1, 3], [2, 0, 3],
                   True, 300, 3, dtype, kernel_device, channel_minor=channel_minor)


def test_update_without_spec_slots(kernel_device):
    """num_spec = 0: the window is the whole row (K - 1 columns), index 0."""
    check_step('causal_conv1d_update', [1, 1], [3, 9], [0, 6], [0, 0], True, 20, 0,
               torch.float32, kernel_device)


def test_update_without_uniform_length_uses_default(kernel_device):
    check_step('causal_conv1d_update', [1, 3], [4, 6], [2, 4], [0, 1], True, 20, 2,
               torch.float32, kernel_device)


# (q_lens, history_lens, state_slots, state_index) of prefill steps, cache width K - 1 + 2
PREFILL_STEPS = {
    'fresh': ([5, 2], [0, 0], [3, 1], [0, 0]),
    'chunked': ([6, 3], [4, 9], [2, 5], [1, 2]),              # windows at columns 1, 2
    'empty_seq': ([3, 0, 2], [0, 5, 2], [4, 0, 6], [0, 2, 1]),
    'shorter_than_window': ([1, 2, 1], [7, 3, 0], [1, 6, 2], [2, 0, 0]),
    'mixed_one_token_rows': ([1, 1, 17, 1, 0, 1], [3, 8, 0, 1, 4, 6], [6, 0, 3, 5, 2, 4],
                             [0, 1, 0, 2, 1, 0]),           # 21 tokens: two token tiles
}


@pytest.mark.parametrize('channel_minor', [True, False])
@pytest.mark.parametrize('step', PREFILL_STEPS)
def test_prefill_matches_default(kernel_device, step, channel_minor):
    """300 channels (two channel blocks, the second partial); a row of q_len 0 and the rows of
    other slots stay as they were (the whole cache is compared); either layout of the cache."""
    for dtype in dtypes(kernel_device):
        check_step('causal_conv1d_prefill', *PREFILL_STEPS[step], False, 300, 2, dtype,
                   kernel_device, channel_minor=channel_minor)


@pytest.mark.parametrize('step', ['chunked', 'mixed_one_token_rows'])
def test_prefill_parts_match_default(kernel_device, step):
    """q, k, v written as three contiguous tensors (parts across the 128-channel blocks)."""
    check_step('causal_conv1d_prefill', *PREFILL_STEPS[step], False, 300, 2, torch.float32,
               kernel_device, parts=(64, 64, 172))


@pytest.mark.gpu
@pytest.mark.parametrize('num_tokens', [1, 4])
def test_update_realistic_sizes(num_tokens):
    """Qwen3.5 sizes: conv_dim = 2 * 16 * 128 + 32 * 128, bf16, k = 3 drafts."""
    check_step('causal_conv1d_update', [num_tokens] * 6, [9, 0, 33, 4, 100, 1],
               [6, 0, 2, 5, 4, 3], [1, 0, 3, 0, 2, 1], True, 8192, 3, torch.bfloat16, 'cuda')


@pytest.mark.gpu
@pytest.mark.parametrize('channels, q_lens', [
    (6144, [8192]), (8192, [1] * 64 + [128]), (8192, [3000, 0, 5000, 1, 191])])
@pytest.mark.parametrize('cache_dtype', [torch.bfloat16, torch.float32])
def test_prefill_realistic_sizes(channels, q_lens, cache_dtype):
    """One long prompt, 64 decode-like rows beside a 128-token prompt, chunks continuing; q, k
    and v as the model takes them (three contiguous parts)."""
    num_seqs = len(q_lens)
    history = [7 * b % 11 for b in range(num_seqs)]              # the first (and 12th) fresh
    slots = torch.randperm(num_seqs, generator=torch.Generator().manual_seed(0)).tolist()
    check_step('causal_conv1d_prefill', q_lens, history, slots, [b % 3 for b in range(num_seqs)],
               False, channels, 2, torch.bfloat16, 'cuda', cache_dtype,
               parts=(2048, 2048, channels - 4096))


@pytest.mark.gpu
def test_prefill_graph_replays_other_lengths():
    """Captured once for T = 40 tokens of 4 sequences, replayed with other splits of the 40
    tokens (0-length and 1-token rows, other slots and histories): equal to eager runs."""
    steps = [  # (q_lens, history_lens, state_slots)
        ([10, 10, 10, 10], [0, 4, 0, 9], [0, 1, 2, 3]), ([1, 0, 38, 1], [5, 2, 0, 7], [6, 3, 0, 5]),
        ([40, 0, 0, 0], [3, 0, 0, 0], [2, 4, 1, 6]), ([2, 1, 1, 36], [0, 1, 2, 3], [5, 0, 4, 1])]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(40, 512, generator=gen).to('cuda', torch.bfloat16)
    weight = torch.randn(512, KERNEL, generator=gen).to('cuda', torch.bfloat16)
    cache = torch.randn(NUM_SLOTS, KERNEL - 1 + 2, 512, generator=gen).cuda().transpose(1, 2)

    def step_inputs(q_lens, history_lens, slots):
        return make_inputs([[0] * n for n in q_lens], history_lens, shuffled_block_tables(4, 4),
                           slots, [h % 3 for h in history_lens]).to('cuda')

    static, static_cache = step_inputs(*steps[0]), cache.clone()
    cuda_conv.causal_conv1d_prefill(x, weight, static_cache.clone(), replace(static))  # compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = cuda_conv.causal_conv1d_prefill(x, weight, static_cache, static)
    for step in steps[1:] + steps[:1]:
        inputs = step_inputs(*step)
        for name in ('q_lens', 'history_lens', 'state_slots', 'state_index'):
            getattr(static, name).copy_(getattr(inputs, name))
        static_cache.copy_(cache)
        graph.replay()
        expected_cache = cache.clone()
        expected = cuda_conv.causal_conv1d_prefill(x, weight, expected_cache, inputs)
        torch.testing.assert_close(static_out, expected, atol=0, rtol=0)
        torch.testing.assert_close(static_cache, expected_cache, atol=0, rtol=0)
        torch.testing.assert_close(expected, default.causal_conv1d_prefill(
            x, weight, cache.clone(), inputs), atol=2e-2, rtol=2e-2)
