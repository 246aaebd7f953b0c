"""`fused_moe`'s all-experts path (a few tokens, few experts) against experts run one pair at a
time: float64 to rounding, ids of -1 exactly 0 (even on a NaN padding row), FP8 experts."""
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


def test_runs_all_experts_only_for_few_tokens_and_experts():
    assert not moe.runs_all_experts(1, 2, 8)        # plain decode: 2 of 8 experts, one at a time
    assert not moe.runs_all_experts(3, 2, 8)
    assert moe.runs_all_experts(4, 2, 8)            # the k=3 verify
    assert moe.runs_all_experts(32, 2, 8)
    assert not moe.runs_all_experts(33, 2, 8)
    assert not moe.runs_all_experts(0, 2, 8)
    for num_tokens in (1, 4, 32, 128, 4096):        # real models never
        assert not moe.runs_all_experts(num_tokens, 8, 256)
        assert not moe.runs_all_experts(num_tokens, 10, 512)


@pytest.mark.parametrize('num_tokens', [4, 5, 8, 32])
def test_all_experts_equals_per_pair_float64(num_tokens):
    assert moe.runs_all_experts(num_tokens, TOP_K, EXPERTS)
    gate_up, down = experts(torch.float64)
    x, weights, ids = routing(num_tokens, torch.float64)
    ids[0, 1] = -1                                  # an expert elsewhere (EP)
    ids[2] = -1                                     # a padding row: no expert at all
    x[2] = float('nan')                             # ... holding garbage
    out = moe.fused_moe(x, gate_up, down, weights, ids)
    ref = per_pair(x, gate_up, down, weights, ids)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-14)
    assert torch.equal(out[2], torch.zeros(HIDDEN, dtype=torch.float64))
    pairs = moe._all_experts(x, gate_up, down, ids)
    torch.testing.assert_close(pairs, moe._experts_by_pair_list(x, gate_up, down, ids),
                               rtol=1e-12, atol=1e-14)


def test_all_experts_float32_and_weights_in_float32():
    gate_up, down = experts(torch.float32)
    x, weights, ids = routing(4, torch.float32)
    out = moe.fused_moe(x, gate_up, down, weights, ids)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, per_pair(x, gate_up, down, weights, ids),
                               rtol=1e-5, atol=1e-6)


def test_all_experts_fp8():
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
