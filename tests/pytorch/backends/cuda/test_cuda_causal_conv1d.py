"""backends/cuda causal conv1d against backends/default: outputs and the WHOLE conv cache (columns
and rows a step must not touch stay unchanged). The update kernel runs in Triton's interpreter on
CPU."""
from __future__ import annotations

import pytest
import torch

from lmdeploy_lite.pytorch.backends import default
from lmdeploy_lite.pytorch.backends.cuda import causal_conv1d as cuda_conv
from tests.helpers.step_inputs import make_inputs, shuffled_block_tables

NUM_SLOTS, KERNEL = 7, 4


def check_step(op_name, q_lens, history_lens, slots, index, decoding, channels, num_spec, dtype,
               device):
    """Run the cuda op and the default op on the same inputs and identical cache copies."""
    inputs = make_inputs([[0] * n for n in q_lens], history_lens,
                         shuffled_block_tables(len(q_lens), 4), slots, index, decoding).to(device)
    gen = torch.Generator().manual_seed(sum(q_lens))
    x = torch.randn(sum(q_lens), channels, generator=gen).to(device, dtype)
    weight = torch.randn(channels, 1, KERNEL, generator=gen).to(device, dtype)[:, 0]  # as the model
    cache = torch.randn(NUM_SLOTS, channels, KERNEL - 1 + num_spec, generator=gen).to(device, dtype)
    expected_cache = cache.clone()
    out = getattr(cuda_conv, op_name)(x, weight, cache, inputs)
    expected = getattr(default, op_name)(x, weight, expected_cache, inputs)
    assert out.dtype == x.dtype
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)
    torch.testing.assert_close(cache, expected_cache, atol=0, rtol=0)   # raw inputs, copied


def dtypes(device):
    return [torch.float32, torch.float64] + ([torch.bfloat16] if device == 'cuda' else [])


@pytest.mark.parametrize('num_tokens', [1, 4])
def test_update_matches_default(kernel_device, num_tokens):
    """3 sequences in non-contiguous rows 5, 1, 3, windows at columns 2, 0 (fresh: ignored), 3;
    300 channels (two blocks, the second partial)."""
    for dtype in dtypes(kernel_device):
        check_step('causal_conv1d_update', [num_tokens] * 3, [7, 0, 12], [5, 1, 3], [2, 0, 3],
                   True, 300, 3, dtype, kernel_device)


def test_update_without_spec_slots(kernel_device):
    """num_spec = 0: the window is the whole row (K - 1 columns), index 0."""
    check_step('causal_conv1d_update', [1, 1], [3, 9], [0, 6], [0, 0], True, 20, 0,
               torch.float32, kernel_device)


def test_update_without_uniform_length_uses_default(kernel_device):
    check_step('causal_conv1d_update', [1, 3], [4, 6], [2, 4], [0, 1], True, 20, 2,
               torch.float32, kernel_device)


def test_prefill_is_default(kernel_device):
    check_step('causal_conv1d_prefill', [5, 2], [0, 4], [3, 1], [0, 1], False, 20, 2,
               torch.float32, kernel_device)


@pytest.mark.gpu
@pytest.mark.parametrize('num_tokens', [1, 4])
def test_update_realistic_sizes(num_tokens):
    """Qwen3.5 sizes: conv_dim = 2 * 16 * 128 + 32 * 128, bf16, k = 3 drafts."""
    check_step('causal_conv1d_update', [num_tokens] * 6, [9, 0, 33, 4, 100, 1],
               [6, 0, 2, 5, 4, 3], [1, 0, 3, 0, 2, 1], True, 8192, 3, torch.bfloat16, 'cuda')
