"""backends/cuda rms_norm, add_rms_norm, gated_rms_norm and silu_mul against backends/default: fp32
(and fp64; fp16 for add_rms_norm) on any kernel device, odd row widths (masked tails),
non-contiguous inputs, empty batches; the model with the in-place add_rms_norm on CPU; bf16 at
Qwen3.5 sizes and under a CUDA graph on a GPU."""
from __future__ import annotations

import importlib

import pytest
import torch

from lmdeploy_lite.pytorch.backends.default import norm as reference


def cuda_ops():
    """The kernel module (imported once the `kernel_device` fixture has checked for Triton)."""
    return importlib.import_module('lmdeploy_lite.pytorch.backends.cuda.norm')


def randn(*shape, device, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(device, dtype)


def tolerances(dtype):
    return {torch.float64: dict(atol=1e-12, rtol=1e-12), torch.float32: dict(atol=1e-5, rtol=1e-5),
            }.get(dtype, dict(atol=2e-2, rtol=2e-2))


@pytest.mark.parametrize('dtype', [torch.float32, torch.float64])
@pytest.mark.parametrize('shape', [(7, 1000), (2, 3, 128), (0, 64)])
def test_rms_norm(kernel_device, dtype, shape):
    x = randn(*shape, device=kernel_device, dtype=dtype)
    weight = randn(shape[-1], device=kernel_device, dtype=dtype, seed=1)
    out = cuda_ops().rms_norm(x, weight, 1e-6)
    assert out.shape == x.shape and out.dtype == dtype
    torch.testing.assert_close(out, reference.rms_norm(x, weight, 1e-6), **tolerances(dtype))


def _random_shapes(count: int, seed: int = 3) -> list[tuple[int, int]]:
    gen = torch.Generator().manual_seed(seed)
    return [(int(torch.randint(1, 20, (), generator=gen)),
             int(torch.randint(1, 6000, (), generator=gen))) for _ in range(count)]


# 4096: Qwen3.5-9B's hidden size; odd widths for the masked tail; 1-wide rows; an empty batch
ADD_RMS_NORM_SHAPES = [(1, 4096), (9, 4096), (5, 1000), (2, 3, 257), (4, 1), (0, 64)] + \
    _random_shapes(3)


@pytest.mark.parametrize('dtype', [torch.float32, torch.float16, torch.float64])
@pytest.mark.parametrize('shape', ADD_RMS_NORM_SHAPES)
def test_add_rms_norm(kernel_device, dtype, shape):
    """The sum equals torch's `residual + x` bit for bit (rounded to the dtype before the norm),
    is written into the residual buffer in place, and the norm of it matches the reference."""
    x = randn(*shape, device=kernel_device, dtype=dtype)
    residual = randn(*shape, device=kernel_device, dtype=dtype, seed=2) * 4
    weight = randn(shape[-1], device=kernel_device, dtype=dtype, seed=1) * 0.1
    want_normed, want_residual = reference.add_rms_norm(x, residual.clone(), weight, 1e-6)
    torch.testing.assert_close(want_normed, reference.rms_norm(residual + x, weight, 1e-6),
                               atol=0, rtol=0)
    normed, new_residual = cuda_ops().add_rms_norm(x, residual, weight, 1e-6)
    assert normed.shape == new_residual.shape == x.shape
    assert normed.dtype == new_residual.dtype == dtype
    torch.testing.assert_close(new_residual, want_residual, atol=0, rtol=0)
    torch.testing.assert_close(normed, want_normed, **tolerances(dtype))
    torch.testing.assert_close(residual, want_residual, atol=0, rtol=0)       # in place


@pytest.mark.parametrize('dtype', [torch.float32, torch.float16])
def test_add_rms_norm_strided(kernel_device, dtype):
    """A residual that is a column slice of a wider buffer is updated in place through its row
    stride (the rest of the buffer untouched); a transposed one goes to a copy; x is strided."""
    x = randn(4, 6, 96, device=kernel_device, dtype=dtype).transpose(0, 1)        # [6, 4, 96]
    weight = randn(96, device=kernel_device, dtype=dtype, seed=1)
    buffer = randn(24, 200, device=kernel_device, dtype=dtype, seed=2)
    original = buffer.clone()
    residual = buffer[:, :96].view(6, 4, 96)
    want_normed, want_residual = reference.add_rms_norm(x, residual.clone(), weight, 1e-6)
    normed, new_residual = cuda_ops().add_rms_norm(x, residual, weight, 1e-6)
    torch.testing.assert_close(new_residual, want_residual, atol=0, rtol=0)
    torch.testing.assert_close(normed, want_normed, **tolerances(dtype))
    assert new_residual.data_ptr() == buffer.data_ptr()
    torch.testing.assert_close(buffer[:, :96].view(6, 4, 96), want_residual, atol=0, rtol=0)
    assert torch.equal(buffer[:, 96:], original[:, 96:])

    transposed = randn(4, 6, 96, device=kernel_device, dtype=dtype, seed=4).transpose(0, 1)
    want_normed, want_residual = reference.add_rms_norm(x, transposed.clone(), weight, 1e-6)
    normed, new_residual = cuda_ops().add_rms_norm(x, transposed, weight, 1e-6)
    torch.testing.assert_close(new_residual, want_residual, atol=0, rtol=0)
    torch.testing.assert_close(normed, want_normed, **tolerances(dtype))


def test_add_rms_norm_rejects_mismatched_residual(kernel_device):
    x = randn(3, 64, device=kernel_device)
    weight = randn(64, device=kernel_device, seed=1)
    with pytest.raises(ValueError, match='residual'):
        cuda_ops().add_rms_norm(x, x.double(), weight, 1e-6)
    with pytest.raises(ValueError, match='residual'):
        cuda_ops().add_rms_norm(x, x[:2].clone(), weight, 1e-6)


@pytest.mark.parametrize('moe', [False, True], ids=['dense', 'moe'])
@torch.no_grad()
def test_model_with_in_place_add_rms_norm(kernel_device, tiny_ckpt, monkeypatch, moe):
    """The Qwen3.5 target and its MTP head with the kernel (which overwrites each residual it is
    given) in place of the reference: the same hidden states, so no consumed residual is read
    again. CPU only (the kernel in the interpreter, everything else the default ops); on a GPU
    tests/gpu compare the whole CUDA backend with the default one."""
    if kernel_device != 'cpu':
        pytest.skip('runs the kernel in the interpreter inside the default-backend model')
    from lmdeploy_lite.pytorch.backends.default import DefaultBackend
    from lmdeploy_lite.pytorch.config import CacheConfig
    from lmdeploy_lite.pytorch.cache_engine import CacheEngine
    from lmdeploy_lite.pytorch.models.loader import build_model, load_mtp_weights
    from lmdeploy_lite.pytorch.models.qwen3_5_mtp import Qwen3_5MTP
    from tests.helpers.step_inputs import make_inputs, shuffled_block_tables

    path = tiny_ckpt(moe)
    target = build_model(path, torch.float32, 'cpu', progress=False)
    mtp = Qwen3_5MTP(target.config, torch.float32, 'cpu', target.embed_tokens, target.lm_head)
    load_mtp_weights(mtp, path, progress=False)
    gen = torch.Generator().manual_seed(5)
    seqs = [torch.randint(2, 512, (n,), generator=gen) for n in (9, 14)]
    tables = shuffled_block_tables(len(seqs), 8)
    cache_config = CacheConfig(block_size=4, num_blocks=len(seqs) * 8 + 1,
                               num_state_slots=len(seqs) + 1)

    def run():
        target_caches = CacheEngine(target.config, cache_config, torch.float32, 'cpu')
        mtp_caches = CacheEngine(target.config, cache_config, torch.float32, 'cpu',
                                 layer_types=('full_attention',))
        inputs = make_inputs(seqs, [0, 0], tables, [0, 1])
        hidden = target(inputs, target_caches)
        draft_hidden = mtp(inputs.input_ids.roll(-1), hidden, inputs, mtp_caches)
        step = make_inputs([[7], [9]], [9, 14], tables, [0, 1], is_decoding=True)
        return hidden, draft_hidden, target(step, target_caches)

    expected = run()
    monkeypatch.setattr(DefaultBackend, 'add_rms_norm', staticmethod(cuda_ops().add_rms_norm))
    for got, want in zip(run(), expected):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize('dtype', [torch.float32, torch.float64])
def test_gated_rms_norm_per_head(kernel_device, dtype):
    """[T, heads, dv] as the gated delta net calls it, x a non-contiguous view."""
    x = randn(3, 5, 4, 96, device=kernel_device, dtype=dtype)[:, 1:].transpose(0, 1)
    gate = randn(4, 3, 4, 96, device=kernel_device, dtype=dtype, seed=2)
    weight = randn(96, device=kernel_device, dtype=dtype, seed=1)
    out = cuda_ops().gated_rms_norm(x, gate, weight, 1e-6)
    assert out.shape == x.shape
    torch.testing.assert_close(out, reference.gated_rms_norm(x, gate, weight, 1e-6),
                               **tolerances(dtype))


@pytest.mark.parametrize('dtype', [torch.float32, torch.float64])
def test_gated_rms_norm_reads_a_strided_gate_in_place(kernel_device, dtype):
    """The gate as the gated delta net passes z: [T, heads, dv] split from a wider projection
    output (rows of a token apart by its width), read without a copy."""
    x = randn(5, 3, 96, device=kernel_device, dtype=dtype)
    gate = randn(5, 40 + 3 * 96, device=kernel_device, dtype=dtype, seed=2)[:, 40:].view(5, 3, 96)
    weight = randn(96, device=kernel_device, dtype=dtype, seed=1)
    torch.testing.assert_close(cuda_ops().gated_rms_norm(x, gate, weight, 1e-6),
                               reference.gated_rms_norm(x, gate, weight, 1e-6), **tolerances(dtype))


@pytest.mark.parametrize('rotary_dim', [32, 96])
@pytest.mark.parametrize('tokens', [4, 0])
@pytest.mark.parametrize('dtype', [torch.float32, torch.float64])
def test_rms_norm_rope(kernel_device, dtype, tokens, rotary_dim):
    """Attention's q/k norm and partial RoPE in one kernel, x strided as q (every other
    head_dim block of q_proj's [q_h | gate_h]), k (a column range of the fused qkv output) and
    a transposed x (no unit last stride: copied, its heads kept apart):
    close to the default op, and to what the unfused CUDA norm and the default rotary give: to
    the bit under the interpreter (each product and sum rounded as torch rounds them); on a GPU
    within the dtype's tolerance (its compiler may fuse a product with the sum)."""
    from lmdeploy_lite.pytorch.nn.rotary import RotaryEmbedding
    cos, sin = RotaryEmbedding(rotary_dim, 1e7, kernel_device)(
        torch.arange(100, 100 + tokens, device=kernel_device), dtype)
    wide = randn(tokens, 8 + 4 * 2 * 96, device=kernel_device, dtype=dtype)
    weight = randn(96, device=kernel_device, dtype=dtype, seed=1)
    transposed = randn(tokens, 96, 3, device=kernel_device, dtype=dtype).transpose(1, 2)
    for x in (wide[:, 8:].view(tokens, 4, 2 * 96)[..., :96], wide[:, 8:8 + 2 * 96].view(-1, 2, 96),
              transposed):
        out = cuda_ops().rms_norm_rope(x, weight, 1e-6, cos, sin)
        assert out.shape == x.shape and out.is_contiguous()
        torch.testing.assert_close(out, reference.rms_norm_rope(x, weight, 1e-6, cos, sin),
                                   **tolerances(dtype))
        unfused = reference.apply_rotary(cuda_ops().rms_norm(x, weight, 1e-6), cos, sin)
        exact = dict(atol=0, rtol=0) if kernel_device == 'cpu' else tolerances(dtype)
        torch.testing.assert_close(out, unfused, **exact)


@pytest.mark.parametrize('shape', [(5, 600), (2, 3, 2 * 48), (0, 32)])
def test_silu_mul(kernel_device, shape):
    gate_up = randn(*shape, device=kernel_device)
    out = cuda_ops().silu_mul(gate_up)
    assert out.shape == (*shape[:-1], shape[-1] // 2)
    torch.testing.assert_close(out, reference.silu_mul(gate_up), atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
def test_norms_bf16_model_sizes(dtype):
    """Hidden 2048 and 8192 rows, GDN output norm [T, 32, 128], MoE/MLP activations, decode to
    prefill batch sizes; fp32 math inside, so the kernels are at least as close to the fp32
    result as the reference is."""
    for tokens in (1, 64, 513):
        for hidden in (2048, 8192):
            x = randn(tokens, hidden, device='cuda', dtype=dtype)
            weight = randn(hidden, device='cuda', dtype=dtype, seed=1) * 0.1
            torch.testing.assert_close(cuda_ops().rms_norm(x, weight, 1e-6),
                                       reference.rms_norm(x, weight, 1e-6), **tolerances(dtype))
        x = randn(tokens, 32, 128, device='cuda', dtype=dtype)
        gate = randn(tokens, 32, 128, device='cuda', dtype=dtype, seed=2)
        weight = 1 + randn(128, device='cuda', dtype=dtype, seed=1) * 0.1
        torch.testing.assert_close(cuda_ops().gated_rms_norm(x, gate, weight, 1e-6),
                                   reference.gated_rms_norm(x, gate, weight, 1e-6),
                                   **tolerances(dtype))
        gate_up = randn(tokens, 2 * 512, device='cuda', dtype=dtype)
        torch.testing.assert_close(cuda_ops().silu_mul(gate_up), reference.silu_mul(gate_up),
                                   **tolerances(dtype))


@pytest.mark.gpu
@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
@pytest.mark.parametrize('tokens', [1, 4, 513])
def test_rms_norm_rope_16_bit_model_sizes(tokens, dtype):
    """q [T, 8, 256] strided in q_proj's output, rotary 64 of 256 (the 0.8B and 9B shapes):
    what the unfused CUDA norm and the default rotary give in the 16-bit dtype, within a unit
    of its last place (on an H100, ~5% of the rotated values are one apart)."""
    from lmdeploy_lite.pytorch.nn.rotary import RotaryEmbedding
    cos, sin = RotaryEmbedding(64, 1e7, 'cuda')(torch.arange(tokens, device='cuda') * 37, dtype)
    q = randn(tokens, 8, 2 * 256, device='cuda', dtype=dtype)[..., :256]
    weight = randn(256, device='cuda', dtype=dtype, seed=1) * 0.1
    unfused = reference.apply_rotary(cuda_ops().rms_norm(q, weight, 1e-6), cos, sin)
    torch.testing.assert_close(cuda_ops().rms_norm_rope(q, weight, 1e-6, cos, sin), unfused,
                               **tolerances(dtype))


@pytest.mark.gpu
@pytest.mark.parametrize('hidden', [2048, 4096, 5000, 8192])
@pytest.mark.parametrize('tokens', [1, 64, 513])
def test_add_rms_norm_bf16_model_sizes(tokens, hidden):
    """bf16 at Qwen3.5 hidden sizes (4096: the 9B) and an odd one: the sum bit-equal to torch's
    bf16 add, the norm within bf16 tolerance of the reference."""
    x = randn(tokens, hidden, device='cuda', dtype=torch.bfloat16)
    residual = randn(tokens, hidden, device='cuda', dtype=torch.bfloat16, seed=2) * 4
    weight = randn(hidden, device='cuda', dtype=torch.bfloat16, seed=1) * 0.1
    want_normed, want_residual = reference.add_rms_norm(x, residual.clone(), weight, 1e-6)
    normed, new_residual = cuda_ops().add_rms_norm(x, residual, weight, 1e-6)
    torch.testing.assert_close(new_residual, want_residual, atol=0, rtol=0)
    torch.testing.assert_close(normed, want_normed, **tolerances(torch.bfloat16))
    assert new_residual.data_ptr() == residual.data_ptr()


@pytest.mark.gpu
def test_add_rms_norm_cuda_graph_chain():
    """A chain of three fused adds (a decoder stack's residual stream, the first residual an
    intermediate of the captured region), captured once and replayed twice with new inputs:
    equals an eager run each time (the in-place residual writes repeat correctly)."""
    dtype, hidden = torch.bfloat16, 4096
    add_rms_norm = cuda_ops().add_rms_norm
    weights = [randn(hidden, device='cuda', dtype=dtype, seed=10 + i) * 0.1 for i in range(3)]
    static_in = randn(16, hidden, device='cuda', dtype=dtype)

    def stack(inp):
        residual, hidden_states = inp * 2, inp.sin()          # intermediates, as in the model
        for w in weights:
            hidden_states, residual = add_rms_norm(hidden_states, residual, w, 1e-6)
        return hidden_states + residual

    stack(static_in)                                           # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = stack(static_in)
    for seed in (1, 2):
        static_in.copy_(randn(16, hidden, device='cuda', dtype=dtype, seed=seed))
        graph.replay()
        torch.testing.assert_close(static_out, stack(static_in.clone()), atol=0, rtol=0)
