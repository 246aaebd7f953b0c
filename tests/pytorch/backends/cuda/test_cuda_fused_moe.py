"""backends/cuda fused_moe against backends/default: both blockings (one pair per block up to
UNSORTED_MAX_PAIRS pairs, expert-sorted blocks beyond), -1 ids (no expert: contributes 0, as the
EP dispatcher pads), fp32 and x.dtype router weights, the k=1 / weight-1 call FusedExperts.run
makes, the sort's block layout; bf16 at Qwen3.5-35B-A3B sizes and CUDA-graph capture on a GPU."""
from __future__ import annotations

import importlib

import pytest
import torch

from lmdeploy_lite.pytorch.backends.default.moe import fused_moe as reference_fused_moe


def cuda_ops():
    """The kernel module (imported once the `kernel_device` fixture has checked for Triton)."""
    return importlib.import_module('lmdeploy_lite.pytorch.backends.cuda.fused_moe')


def make_case(tokens, hidden, inter, experts, top_k, device, dtype, seed=0, drop=0.1):
    """Random x and experts (outputs of order 1), distinct top-k ids per token with a fraction
    `drop` of them -1, router weights summing to 1 over each token's slots."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden ** -0.5
    down = torch.randn(experts, hidden, inter, generator=gen) * inter ** -0.5
    ids = torch.rand(tokens, experts, generator=gen).argsort(dim=-1)[:, :top_k]
    ids[torch.rand(tokens, top_k, generator=gen) < drop] = -1
    weights = torch.rand(tokens, top_k, generator=gen).softmax(-1)
    return (x.to(device, dtype), gate_up.to(device, dtype), down.to(device, dtype),
            weights.to(device), ids.to(device))


@pytest.mark.parametrize('tokens,top_k', [(1, 4), (5, 3), (40, 3)])   # 4 and 15 pairs, then 120
@pytest.mark.parametrize('weight_dtype', [torch.float32, None])       # None: x.dtype
def test_fused_moe_matches_default(kernel_device, tokens, top_k, weight_dtype):
    x, gate_up, down, weights, ids = make_case(tokens, 64, 48, 8, top_k, kernel_device,
                                               torch.float32, drop=0.2)
    ids[0, 0] = -1
    weights = weights.to(weight_dtype or x.dtype)
    out = cuda_ops().fused_moe(x, gate_up, down, weights, ids)
    assert out.shape == x.shape and out.dtype == x.dtype
    torch.testing.assert_close(out, reference_fused_moe(x, gate_up, down, weights, ids),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize('rows', [0, 6, 70])
def test_fused_moe_unweighted_rows(kernel_device, rows):
    """FusedExperts.run's call: k = 1, weight 1; rows with id -1 come back exactly 0."""
    x, gate_up, down, _, ids = make_case(rows, 32, 16, 4, 1, kernel_device, torch.float32,
                                         drop=0.3)
    ones = torch.ones(rows, 1, device=kernel_device)
    out = cuda_ops().fused_moe(x, gate_up, down, ones, ids)
    assert torch.all(out[ids[:, 0] < 0] == 0)
    torch.testing.assert_close(out, reference_fused_moe(x, gate_up, down, ones, ids),
                               atol=1e-5, rtol=1e-5)


def test_sort_pairs_layout():
    """Every routed pair sits in exactly one slot of a block of its expert; -1 pairs in none;
    padding slots hold P; unused trailing blocks have expert E."""
    pytest.importorskip('triton')
    experts, block_m = 5, 4
    ids = torch.tensor([3, -1, 0, 3, 3, 1, 3, 3, 0, -1, 3, 4])
    pair_ids, block_expert = cuda_ops()._sort_pairs(ids, experts, block_m)
    num_pairs = ids.numel()
    assert pair_ids.shape == ((num_pairs // block_m + experts) * block_m,)
    slots = pair_ids.view(-1, block_m)
    placed = pair_ids[pair_ids < num_pairs]
    assert sorted(placed.tolist()) == [i for i, e in enumerate(ids.tolist()) if e >= 0]
    for block, expert in zip(slots, block_expert.tolist()):
        routed = block[block < num_pairs]
        assert torch.all(ids[routed.long()] == expert)
        if expert == experts:
            assert routed.numel() == 0
    assert block_expert.tolist()[:5] == [0, 1, 3, 3, 4]


@pytest.mark.gpu
@pytest.mark.parametrize('experts', [64, 256])
@pytest.mark.parametrize('tokens', [1, 8, 64, 512])
def test_fused_moe_bf16_model_sizes(tokens, experts):
    """H=2048, I=512, top-8 (Qwen3.5-35B-A3B) against the default op on the same inputs in fp32."""
    x, gate_up, down, weights, ids = make_case(tokens, 2048, 512, experts, 8, 'cuda',
                                               torch.bfloat16, drop=0.05)
    out = cuda_ops().fused_moe(x, gate_up, down, weights.to(torch.bfloat16), ids).float()
    ref = reference_fused_moe(x.float(), gate_up.float(), down.float(), weights, ids)
    assert (out - ref).norm() / ref.norm() < 1e-2
    torch.testing.assert_close(out, ref, atol=3e-2 * ref.abs().max().item(), rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize('tokens', [8, 64])                # one pair per block; sorted blocks
def test_fused_moe_cuda_graph_replay(tokens):
    """Captured once, replayed with new ids and weights: equals an eager call."""
    x, gate_up, down, weights, ids = make_case(tokens, 2048, 512, 128, 8, 'cuda', torch.bfloat16)
    fused_moe = cuda_ops().fused_moe
    fused_moe(x, gate_up, down, weights, ids)              # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, gate_up, down, weights, ids)
    x2, _, _, weights2, ids2 = make_case(tokens, 2048, 512, 128, 8, 'cuda', torch.bfloat16, seed=1)
    x.copy_(x2)
    weights.copy_(weights2)
    ids.copy_(ids2)
    graph.replay()
    torch.testing.assert_close(out, fused_moe(x, gate_up, down, weights, ids), atol=0, rtol=0)
