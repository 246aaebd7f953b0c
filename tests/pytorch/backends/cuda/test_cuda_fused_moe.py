"""backends/cuda fused_moe against backends/default: both blockings (one pair per block up to
UNSORTED_MAX_PAIRS pairs, expert-sorted blocks beyond), -1 ids (no expert: contributes 0, as the
EP dispatcher pads), fp32 and x.dtype router weights, the k=1 / weight-1 call FusedExperts.run
makes, the sort's block layout; bf16 at Qwen3.5-35B-A3B sizes and CUDA-graph capture on a GPU.

fused_moe_masked (rows grouped by expert, DeepEP's low-latency layout): the default op against
the generic one, the kernel against the default op with counts 0 / partial / full, x a column
slice of a wider buffer with NaN in the rows past the counts (never read), rows and columns past
the output never written; bf16 model sizes and graph replay with new counts on a GPU. The
interpreter's tl.dot multiplies bf16 bit patterns (triton-lang/triton#11584), so its 16-bit
case runs in float16 on CPU and in bf16 on a GPU.

FP8 experts (weight-only; nn/moe.FusedExperts.to_fp8's layout, quantized on the CPU: the
interpreter rounds to FP8 wrongly, FP8 -> float32 is exact): both pair paths and the masked one
against the reference on the dequantized weights in float32, with H and I not multiples of 128
(partial edge blocks; gate and up quantized apart); on a GPU at the 35B-A3B's shapes and in a
CUDA graph."""
from __future__ import annotations

import importlib

import pytest
import torch

from lmdeploy_lite.pytorch.backends.default.moe import fused_moe as reference_fused_moe
from lmdeploy_lite.pytorch.backends.default.moe import \
    fused_moe_masked as reference_fused_moe_masked
from lmdeploy_lite.pytorch.models.fp8 import dequantize, quantize
from lmdeploy_lite.pytorch.nn.moe import FusedExperts


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


# ---- fused_moe_masked ---------------------------------------------------------------------------
def make_grouped(counts, capacity, hidden, inter, width, device, dtype, seed=0):
    """x [E, C, hidden] as the first columns of a [E, C, width] buffer whose rows past the
    counts hold NaN (as stale DeepEP rows may), experts like make_case's, counts [E] int32."""
    gen = torch.Generator().manual_seed(seed)
    experts = len(counts)
    buffer = torch.randn(experts, capacity, width, generator=gen)
    buffer[torch.arange(capacity)[None, :] >= torch.tensor(counts)[:, None]] = float('nan')
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden ** -0.5
    down = torch.randn(experts, hidden, inter, generator=gen) * inter ** -0.5
    counts = torch.tensor(counts, dtype=torch.int32)
    return (buffer.to(device, dtype)[..., :hidden], counts.to(device),
            gate_up.to(device, dtype), down.to(device, dtype))


def test_masked_reference_matches_fused_moe():
    """Row c < counts[e] of the grouped op is expert e on that row, as fused_moe computes it."""
    x, counts, gate_up, down = make_grouped([3, 0, 5, 1], 5, 24, 16, 32, 'cpu', torch.float64)
    out = reference_fused_moe_masked(x, counts, gate_up, down)
    assert out.shape == x.shape and out.dtype == x.dtype
    for expert, count in enumerate(counts.tolist()):
        rows = x[expert, :count]
        ids = torch.full((count, 1), expert)
        want = reference_fused_moe(rows, gate_up, down, torch.ones(count, 1, dtype=x.dtype), ids)
        torch.testing.assert_close(out[expert, :count], want, atol=1e-12, rtol=1e-12)
    assert not out[torch.arange(5)[None, :] >= counts[:, None]].isnan().any()   # NaN never read


@pytest.mark.parametrize('dtype', ['float32', '16-bit'])
def test_fused_moe_masked_matches_default(kernel_device, dtype):
    """counts 0, partial (one and two row blocks of 16) and full C = 20; H = 48 is not a
    multiple of BLOCK_K; out is a wider buffer: its columns past H and its rows past the counts
    keep their sentinel."""
    if dtype == 'float32':
        dtype = torch.float32
    else:
        dtype = torch.bfloat16 if kernel_device == 'cuda' else torch.float16
    counts, capacity, hidden = [0, 20, 5, 17], 20, 48
    x, counts_t, gate_up, down = make_grouped(counts, capacity, hidden, 24, 64, kernel_device,
                                              dtype)
    out = torch.full((len(counts), capacity, 56), -7.0, dtype=dtype, device=kernel_device)
    got = cuda_ops().fused_moe_masked(x, counts_t, gate_up, down, out=out)
    assert got.shape == x.shape and got.dtype == dtype and got.data_ptr() == out.data_ptr()
    valid = torch.arange(capacity, device=kernel_device)[None, :] < counts_t[:, None]
    assert torch.all(out[~valid] == -7) and torch.all(out[..., hidden:] == -7)
    if dtype == torch.float32:
        want = reference_fused_moe_masked(x, counts_t, gate_up, down)
        torch.testing.assert_close(got[valid], want[valid], atol=1e-5, rtol=1e-5)
    else:                              # against float32 math on the same 16-bit inputs
        want = reference_fused_moe_masked(x.float(), counts_t, gate_up.float(), down.float())
        got, want = got[valid].float(), want[valid]
        assert got.isfinite().all() and (got - want).norm() / want.norm() < 1e-2
    no_out = cuda_ops().fused_moe_masked(x, counts_t, gate_up, down)   # allocates [E, C, H]
    assert no_out.shape == x.shape and no_out[valid].equal(out[..., :hidden][valid])


def test_fused_moe_masked_float64_is_the_reference(kernel_device):
    x, counts, gate_up, down = make_grouped([2, 0], 3, 8, 4, 8, kernel_device, torch.float64)
    got = cuda_ops().fused_moe_masked(x, counts, gate_up, down)
    assert got[0, :2].equal(reference_fused_moe_masked(x, counts, gate_up, down)[0, :2])


@pytest.mark.gpu
@pytest.mark.parametrize('counts', [[1, 0, 3, 8], [0] * 4, [512] * 4])
def test_fused_moe_masked_bf16_model_sizes(counts):
    """H=2048, I=512, C=512 (the 35B-A3B's low-latency layout; E cut to the test's 4 experts
    plus 124 empty ones) against the default op in fp32 on the same inputs."""
    counts = counts + [0] * 124
    x, counts_t, gate_up, down = make_grouped(counts, 512, 2048, 512, 2048, 'cuda',
                                              torch.bfloat16)
    got = cuda_ops().fused_moe_masked(x, counts_t, gate_up, down).float()
    want = reference_fused_moe_masked(x.float(), counts_t, gate_up.float(), down.float())
    valid = torch.arange(512, device='cuda')[None, :] < counts_t[:, None]
    if valid.any():
        got, want = got[valid], want[valid]
        assert (got - want).norm() / want.norm() < 1e-2
        torch.testing.assert_close(got, want, atol=3e-2 * want.abs().max().item(), rtol=2e-2)


@pytest.mark.gpu
def test_fused_moe_masked_cuda_graph_replay():
    """Captured once, replayed with new rows and counts: equals an eager call on the valid rows."""
    counts = [3, 0, 1, 7] * 32
    x, counts_t, gate_up, down = make_grouped(counts, 64, 2048, 512, 2048, 'cuda', torch.bfloat16)
    fused_moe_masked = cuda_ops().fused_moe_masked
    out = torch.empty(x.shape[0], 64, 2048, dtype=x.dtype, device='cuda')
    fused_moe_masked(x, counts_t, gate_up, down, out=out)     # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_moe_masked(x, counts_t, gate_up, down, out=out)
    x2, counts2, _, _ = make_grouped([5, 2, 0, 64] * 32, 64, 2048, 512, 2048, 'cuda',
                                     torch.bfloat16, seed=1)
    x.copy_(x2)
    counts_t.copy_(counts2)
    graph.replay()
    valid = torch.arange(64, device='cuda')[None, :] < counts_t[:, None]
    eager = fused_moe_masked(x, counts_t, gate_up, down)
    torch.testing.assert_close(out[valid], eager[valid], atol=0, rtol=0)


# ---- FP8 experts ---------------------------------------------------------------------------------
def fp8_experts(gate_up: torch.Tensor, down: torch.Tensor, device) -> tuple:
    """(FP8 gate_up, its scales, FP8 down, its scales) as FusedExperts.to_fp8 makes them
    (quantized where the weights are: the CPU in interpreter runs), on `device`; and the
    dequantized float32 weights, each of gate and up by models/fp8.dequantize on its own."""
    experts, hidden, inter = down.shape
    module = FusedExperts(hidden, inter, experts, gate_up.dtype, gate_up.device)
    module.gate_up_proj.data.copy_(gate_up)
    module.down_proj.data.copy_(down)
    module.to_fp8(quantize)
    q_gate_up, s_gate_up = module.gate_up_proj.data, module.gate_up_scale.data
    assert q_gate_up.dtype == torch.float8_e4m3fn and s_gate_up.shape == (
        experts, 2 * -(-inter // 128), -(-hidden // 128))
    halves = zip(q_gate_up.split(inter, 1), s_gate_up.chunk(2, 1))
    dequantized = (torch.cat([dequantize(q, s) for q, s in halves], 1),
                   dequantize(module.down_proj.data, module.down_scale.data))
    fp8 = (q_gate_up, s_gate_up, module.down_proj.data, module.down_scale.data)
    return tuple(t.to(device) for t in fp8), tuple(t.to(device) for t in dequantized)


@pytest.mark.parametrize('tokens', [3, 40])                    # 9 pairs one by one; 120 sorted
def test_fp8_fused_moe_matches_the_reference_on_dequantized_weights(kernel_device, tokens):
    """H = 136 and I = 160: partial K and N blocks, gate and up scales apart; -1 ids."""
    x, gate_up, down, weights, ids = make_case(tokens, 136, 160, 6, 3, 'cpu', torch.float32)
    (q_gate_up, s_gate_up, q_down, s_down), (w_gate_up, w_down) = fp8_experts(
        gate_up * 4, down, kernel_device)
    x, weights, ids = x.to(kernel_device), weights.to(kernel_device), ids.to(kernel_device)
    got = cuda_ops().fused_moe(x, q_gate_up, q_down, weights, ids, gate_up_scale=s_gate_up,
                               down_scale=s_down)
    want = reference_fused_moe(x, w_gate_up, w_down, weights, ids)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(reference_fused_moe(x, q_gate_up, q_down, weights, ids, s_gate_up,
                                                   s_down), want, atol=1e-6, rtol=1e-6)
    assert not torch.allclose(want, reference_fused_moe(x, gate_up.to(x.device) * 4,
                                                        down.to(x.device), weights, ids))


def test_fp8_fused_moe_masked_matches_the_reference_on_dequantized_weights(kernel_device):
    counts, capacity = [0, 20, 5, 17], 20
    x, counts_t, gate_up, down = make_grouped(counts, capacity, 200, 160, 208, 'cpu',
                                              torch.float32)
    (q_gate_up, s_gate_up, q_down, s_down), (w_gate_up, w_down) = fp8_experts(
        gate_up, down, kernel_device)
    x, counts_t = x.to(kernel_device), counts_t.to(kernel_device)
    got = cuda_ops().fused_moe_masked(x, counts_t, q_gate_up, q_down, gate_up_scale=s_gate_up,
                                      down_scale=s_down)
    want = reference_fused_moe_masked(x, counts_t, w_gate_up, w_down)
    valid = torch.arange(capacity, device=kernel_device)[None, :] < counts_t[:, None]
    torch.testing.assert_close(got[valid], want[valid], atol=1e-5, rtol=1e-5)


def _fp8_case_35b(tokens, experts, seed=0):
    """The 35B-A3B's expert shapes in bf16 with FP8 experts (quantized on the GPU) and the
    float32 reference weights."""
    x, gate_up, down, weights, ids = make_case(tokens, 2048, 512, experts, 8, 'cuda',
                                               torch.bfloat16, seed=seed, drop=0.05)
    fp8, dequantized = fp8_experts(gate_up.float(), down.float(), 'cuda')
    return x, weights, ids, fp8, dequantized


@pytest.mark.gpu
@pytest.mark.parametrize('experts', [64, 256])
@pytest.mark.parametrize('tokens', [1, 8, 64, 512])
def test_fp8_fused_moe_model_sizes(tokens, experts):
    """H=2048, I=512, top-8 in bf16 with FP8 experts against the float32 reference on the
    dequantized weights (the bf16 kernel's tolerance: the weights are the same numbers)."""
    x, weights, ids, (q_gate_up, s_gate_up, q_down, s_down), (w_gate_up, w_down) = \
        _fp8_case_35b(tokens, experts)
    out = cuda_ops().fused_moe(x, q_gate_up, q_down, weights.to(torch.bfloat16), ids,
                               gate_up_scale=s_gate_up, down_scale=s_down).float()
    ref = reference_fused_moe(x.float(), w_gate_up, w_down, weights, ids)
    assert (out - ref).norm() / ref.norm() < 1e-2
    torch.testing.assert_close(out, ref, atol=3e-2 * ref.abs().max().item(), rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize('counts', [[1, 0, 3, 8], [512] * 4])
def test_fp8_fused_moe_masked_model_sizes(counts):
    counts = counts + [0] * 124
    x, counts_t, gate_up, down = make_grouped(counts, 512, 2048, 512, 2048, 'cuda',
                                              torch.bfloat16)
    (q_gate_up, s_gate_up, q_down, s_down), (w_gate_up, w_down) = fp8_experts(
        gate_up.float(), down.float(), 'cuda')
    got = cuda_ops().fused_moe_masked(x, counts_t, q_gate_up, q_down, gate_up_scale=s_gate_up,
                                      down_scale=s_down).float()
    want = reference_fused_moe_masked(x.float(), counts_t, w_gate_up, w_down)
    valid = torch.arange(512, device='cuda')[None, :] < counts_t[:, None]
    got, want = got[valid], want[valid]
    assert (got - want).norm() / want.norm() < 1e-2
    torch.testing.assert_close(got, want, atol=3e-2 * want.abs().max().item(), rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize('tokens', [8, 64])                # one pair per block; sorted blocks
def test_fp8_fused_moe_cuda_graph_replay(tokens):
    """FP8 experts captured once, replayed with new rows, ids and weights: equals an eager
    call; and the masked op likewise."""
    x, weights, ids, (q_gate_up, s_gate_up, q_down, s_down), _ = _fp8_case_35b(tokens, 256)
    scales = dict(gate_up_scale=s_gate_up, down_scale=s_down)
    fused_moe, masked = cuda_ops().fused_moe, cuda_ops().fused_moe_masked
    grouped = x.new_zeros(256, tokens, 2048)
    grouped[:, :tokens] = x[None]
    counts = torch.randint(0, tokens + 1, (256,), dtype=torch.int32, device='cuda')
    fused_moe(x, q_gate_up, q_down, weights, ids, **scales)  # compile outside the capture
    masked(grouped, counts, q_gate_up, q_down, **scales)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, q_gate_up, q_down, weights, ids, **scales)
        out_masked = masked(grouped, counts, q_gate_up, q_down, **scales)
    x2, weights2, ids2, _, _ = _fp8_case_35b(tokens, 256, seed=1)
    x.copy_(x2)
    weights.copy_(weights2)
    ids.copy_(ids2)
    grouped.copy_(grouped.roll(1, 0))
    counts.copy_(counts.roll(1, 0))
    graph.replay()
    torch.testing.assert_close(out, fused_moe(x, q_gate_up, q_down, weights, ids, **scales),
                               atol=0, rtol=0)
    valid = torch.arange(tokens, device='cuda')[None, :] < counts[:, None]
    eager = masked(grouped, counts, q_gate_up, q_down, **scales)
    torch.testing.assert_close(out_masked[valid], eager[valid], atol=0, rtol=0)
