"""`fused_moe`'s grouped small-batch path (the touched experts' GEMMs into shared buffers)
against one expert at a time (the very bits) and one pair at a time (float64 to rounding); ids
of -1 exactly 0, even on a NaN padding row; FP8 experts."""
import pytest
import torch
import torch.nn.functional as F

from lmdeploy_lite.pytorch.backends.default import moe
from lmdeploy_lite.pytorch.backends.default.norm import silu_mul

EXPERTS, HIDDEN, INTER, TOP_K = 8, 256, 128, 2      # the embedded model's experts


def experts(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen, dtype=dtype) * 0.05
    down = torch.randn(EXPERTS, HIDDEN, INTER, generator=gen, dtype=dtype) * 0.05
    return gate_up, down


def routing(num_tokens, dtype, seed=1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, HIDDEN, generator=gen, dtype=dtype)
    weights, ids = torch.randn(num_tokens, EXPERTS, generator=gen).softmax(-1).topk(TOP_K, -1)
    return x, weights.to(dtype), ids


def per_pair(x, gate_up, down, weights, ids):
    """out[t] = sum_j w[t, j] * expert_{ids[t, j]}(x[t]), one pair at a time, -1 skipped."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            expert = int(ids[t, j])
            if expert >= 0:
                y = F.linear(silu_mul(F.linear(x[t:t + 1], gate_up[expert])), down[expert])
                out[t] += weights[t, j] * y[0]
    return out


def test_grouped_from_six_pairs(monkeypatch):
    gate_up, down = experts(torch.float32)
    taken = []
    monkeypatch.setattr(moe, '_experts_grouped', lambda *args: taken.append('grouped')
                        or moe._experts_by_pair_list(*args))
    for num_tokens in (1, 2, 3, 4, 32, 33):
        taken.clear()
        x, weights, ids = routing(num_tokens, torch.float32)
        moe.fused_moe(x, gate_up, down, weights, ids)
        assert bool(taken) == (3 <= num_tokens <= 32), num_tokens     # 6..64 pairs


@pytest.mark.parametrize('dtype', [torch.float32, torch.float64])
@pytest.mark.parametrize('num_tokens', [1, 3, 4, 8, 32])
def test_grouped_is_one_expert_at_a_time_bit_for_bit(num_tokens, dtype):
    gate_up, down = experts(dtype)
    x, _, ids = routing(num_tokens, dtype)
    for case in ('all', 'minus one', 'none'):           # none: every row elsewhere (EP)
        if case == 'minus one':
            ids[0, 1] = -1
        if case == 'none':
            ids[:] = -1
        torch.testing.assert_close(moe._experts_grouped(x, gate_up, down, ids),
                                   moe._experts_by_pair_list(x, gate_up, down, ids),
                                   rtol=0, atol=0)


def test_grouped_one_expert_many_rows_and_unsorted_pairs():
    gate_up, down = experts(torch.float64)
    x, _, _ = routing(4, torch.float64)
    ids = torch.tensor([[5, 3], [3, 5], [7, 3], [3, 0]])
    torch.testing.assert_close(moe._experts_grouped(x, gate_up, down, ids),
                               moe._experts_by_pair_list(x, gate_up, down, ids), rtol=0, atol=0)


@pytest.mark.parametrize('num_tokens', [3, 4, 8, 32])
def test_grouped_equals_per_pair_float64(num_tokens):
    gate_up, down = experts(torch.float64)
    x, weights, ids = routing(num_tokens, torch.float64)
    ids[0, 1] = -1                                  # an expert elsewhere (EP)
    ids[2] = -1                                     # a padding row: no expert at all
    x[2] = float('nan')                             # ... holding garbage
    out = moe.fused_moe(x, gate_up, down, weights, ids)
    ref = per_pair(x, gate_up, down, weights, ids)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-14)
    assert torch.equal(out[2], torch.zeros(HIDDEN, dtype=torch.float64))


def test_grouped_float32_and_weights_in_float32():
    gate_up, down = experts(torch.float32)
    x, weights, ids = routing(4, torch.float32)
    out = moe.fused_moe(x, gate_up, down, weights, ids)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, per_pair(x, gate_up, down, weights, ids),
                               rtol=1e-5, atol=1e-6)


def test_grouped_fp8():
    gate_up, down = experts(torch.float32)
    gate_up_fp8, down_fp8 = gate_up.to(torch.float8_e4m3fn), down.to(torch.float8_e4m3fn)
    blocks = -(-INTER // moe.BLOCK)                 # gate and up quantized apart
    gate_up_scale = torch.rand(EXPERTS, 2 * blocks, HIDDEN // moe.BLOCK) + 0.5
    down_scale = torch.rand(EXPERTS, HIDDEN // moe.BLOCK, blocks) + 0.5
    x, weights, ids = routing(4, torch.float64)
    ids[1, 0] = -1
    out = moe.fused_moe(x, gate_up_fp8, down_fp8, weights, ids, gate_up_scale, down_scale)
    ref = per_pair(x, moe.dequantize_blocks(gate_up_fp8, gate_up_scale, torch.float64, 2),
                   moe.dequantize_blocks(down_fp8, down_scale, torch.float64), weights, ids)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-14)
