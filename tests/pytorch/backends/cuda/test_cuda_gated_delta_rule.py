"""backends/cuda gated delta rule against backends/default: outputs and the WHOLE state cache
(slots a step must not touch stay unchanged). Decode and short prefills run our Triton kernels
(Triton's interpreter on CPU); longer prefills run fla-core's chunk kernel on a GPU with fla
installed."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from lmdeploy_lite.pytorch.backends import default
from lmdeploy_lite.pytorch.backends.cuda import gated_delta_rule as cuda_gdr
from tests.helpers.step_inputs import make_inputs, shuffled_block_tables

NUM_SLOTS = 7


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def step(q_lens, history_lens, slots, index, decoding, device):
    batch = len(q_lens)
    inputs = make_inputs([[0] * n for n in q_lens], history_lens,
                         shuffled_block_tables(batch, 4), slots, index, decoding)
    return inputs.to(device)


def gdn_args(num_tokens, nk, nv, dk, dv, dtype, device, seed):
    """q, k, v as strided views of one projection [T, 2 nk dk + nv dv] (as the model splits the
    conv output); g (fp32 log decay) and beta [T, nv]."""
    gen = torch.Generator().manual_seed(seed)
    mixed = torch.randn(num_tokens, 2 * nk * dk + nv * dv, generator=gen)
    q, k, v = mixed.to(device, dtype).split([nk * dk, nk * dk, nv * dv], dim=-1)
    q, k, v = q.view(-1, nk, dk), k.view(-1, nk, dk), v.view(-1, nv, dv)
    g = (-torch.rand(num_tokens, nv, generator=gen) * 0.5).to(device, state_dtype(dtype))
    beta = torch.rand(num_tokens, nv, generator=gen).to(device, dtype)
    return q, k, v, g, beta


def random_cache(num_spec, nv, dk, dv, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    cache = torch.randn(NUM_SLOTS, 1 + num_spec, nv, dk, dv, generator=gen) * 0.3
    return cache.to(device, state_dtype(dtype))


def assert_rel_close(actual, expected, tol):
    """Relative error in the Frobenius norm (for bf16 paths, where elementwise bounds are noisy)."""
    err = (actual.double() - expected.double()).norm() / expected.double().norm().clamp_min(1e-12)
    assert err < tol, f'relative error {err:.2e} > {tol}'


def check_step(op_name, q_lens, history_lens, slots, index, decoding, dims, dtype, device,
               rel_tol=None, op=None, cache_dtype=None, padding_rows=()):
    """Run the cuda op (`op`, by default the one named `op_name`) and the default op on the same
    inputs and identical cache copies (in `cache_dtype`, by default fp32, fp64 for fp64);
    compare elementwise (fp32/fp64) or by relative norm error (bf16 activations or state, or
    `rel_tol` if given). `padding_rows` (state slot 0, reserved): their outputs and slot 0
    are not compared."""
    nk, nv, dk, dv, num_spec = dims
    inputs = step(q_lens, history_lens, slots, index, decoding, device)
    args = gdn_args(sum(q_lens), nk, nv, dk, dv, dtype, device, seed=sum(q_lens))
    cache = random_cache(num_spec, nv, dk, dv, dtype, device, seed=len(q_lens))
    cache = cache.to(cache_dtype or cache.dtype)
    expected_cache = cache.clone()
    out = (op or getattr(cuda_gdr, op_name))(*args, cache, inputs)
    expected = getattr(default, op_name)(*args, expected_cache, inputs)
    if padding_rows:
        expected_cache[0] = cache[0]
        for row in padding_rows:
            start = sum(q_lens[:row])
            out[start:start + q_lens[row]] = expected[start:start + q_lens[row]]
    assert out.dtype == args[2].dtype and out.shape == expected.shape
    tol = None if cache.dtype == torch.bfloat16 else {torch.float64: 1e-10,
                                                      torch.float32: 1e-5}.get(dtype)
    if rel_tol is not None or tol is None:
        assert_rel_close(out, expected, rel_tol or 1e-2)
        assert_rel_close(cache, expected_cache, rel_tol or 1e-2)
    else:
        torch.testing.assert_close(out, expected, atol=tol, rtol=tol)
        torch.testing.assert_close(cache, expected_cache, atol=tol, rtol=tol)


def dtypes(device):
    return [torch.float32, torch.float64] + ([torch.bfloat16] if device == 'cuda' else [])


# ----------------------------------------------------------------------------- decode / verify

@pytest.mark.parametrize('num_tokens', [1, 4])
def test_decode_matches_default(kernel_device, num_tokens):
    """3 sequences in non-contiguous rows 5, 1, 3, reading slots 2, 0 (fresh: ignored), 3; GVA
    ratio 2. The cache holds random values everywhere, so a stray write or read shows."""
    for dtype in dtypes(kernel_device):
        check_step('gated_delta_rule_decode', [num_tokens] * 3, [7, 0, 12], [5, 1, 3], [2, 0, 3],
                   True, (2, 4, 16, 16, 3), dtype, kernel_device)


def test_decode_uneven_dims_and_no_gva(kernel_device):
    """dk, dv not powers of two (masked tiles), nk == nv, one spec slot."""
    check_step('gated_delta_rule_decode', [2, 2], [3, 5], [6, 0], [1, 0], True,
               (2, 2, 12, 20, 1), torch.float32, kernel_device)


def test_decode_without_uniform_length_uses_default(kernel_device):
    check_step('gated_delta_rule_decode', [1, 3], [4, 6], [2, 4], [0, 1], True,
               (2, 4, 8, 8, 2), torch.float32, kernel_device)


@pytest.mark.gpu
@pytest.mark.parametrize('num_tokens', [1, 4])
@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float32])
def test_decode_realistic_sizes(num_tokens, dtype):
    """Qwen3.5 sizes: dk = dv = 128, nk = 16, nv = 32, k = 3 drafts."""
    check_step('gated_delta_rule_decode', [num_tokens] * 6, [9, 0, 33, 4, 100, 1],
               [6, 0, 2, 5, 4, 3], [1, 0, 3, 0, 2, 1], True, (16, 32, 128, 128, 3), dtype, 'cuda')


@pytest.mark.parametrize('num_tokens', [1, 4])
@pytest.mark.parametrize('batch_tiles', ['small', 'large'])
def test_decode_is_batch_invariant(kernel_device, num_tokens, batch_tiles, monkeypatch):
    """A sequence's outputs and states are the same bits alone and in a batch of 6 (its graph
    bucket, the requests it shares a step with and async scheduling must not change a token),
    whether the batch takes the same tiling as the sequence alone or the large one
    (`decode_tiling`): Qwen3.5 sizes on the GPU (fp32 and bf16-stored state), small ones on
    the CPU."""
    realistic = kernel_device == 'cuda'
    nk, nv, dk, dv, num_spec = (16, 32, 128, 128, 3) if realistic else (2, 4, 32, 32, 3)
    act = torch.bfloat16 if realistic else torch.float32
    hist, slots, index = [9, 0, 33, 4, 100, 1], [6, 0, 2, 5, 4, 3], [1, 0, 3, 0, 2, 1]
    batch = step([num_tokens] * 6, hist, slots, index, True, kernel_device)
    alone = step([num_tokens], hist[2:3], slots[2:3], index[2:3], True, kernel_device)
    args = gdn_args(6 * num_tokens, nk, nv, dk, dv, act, kernel_device, seed=11)
    own = [x[2 * num_tokens:3 * num_tokens] for x in args]        # sequence 2's rows
    for cache_dtype in [torch.float32, torch.bfloat16] if realistic else [torch.float32]:
        cache = random_cache(num_spec, nv, dk, dv, torch.float32, kernel_device, seed=5)
        cache = cache.to(cache_dtype)
        in_batch, by_itself = cache.clone(), cache.clone()
        out_alone = cuda_gdr.gated_delta_rule_decode(*own, by_itself, alone)
        if batch_tiles == 'large':
            monkeypatch.setattr(cuda_gdr, 'SMALL_TILE_PROGRAMS', nv)      # alone: nv programs
        assert (cuda_gdr.decode_tiling(dv, 6 * nv) == cuda_gdr.decode_tiling(dv, nv)) == (
            batch_tiles == 'small')
        out_batch = cuda_gdr.gated_delta_rule_decode(*args, in_batch, batch)
        monkeypatch.undo()
        assert torch.equal(out_batch[2 * num_tokens:3 * num_tokens], out_alone)
        assert torch.equal(in_batch[slots[2]], by_itself[slots[2]]), cache_dtype


# ----------------------------------------------------------------------------- prefill

def test_prefill_falls_back_to_default_on_cpu():
    check_step('gated_delta_rule_prefill', [5, 3], [0, 4], [3, 1], [0, 1], False,
               (2, 4, 8, 8, 1), torch.float32, 'cpu')


@pytest.mark.gpu
@pytest.mark.parametrize('heads', [(16, 32), (4, 4)], ids=['gva2', 'no-gva'])
def test_prefill_fla_matches_default(heads):
    """fla's varlen chunk kernel: fresh sequences (one longer than two chunks, one of a single
    token), then a chunked continuation (history > 0) reading state indices 1, 0, 2. No row is
    in state slot 0 (reserved for padding, which the long-row split does not walk)."""
    pytest.importorskip('fla.ops.gated_delta_rule')
    assert cuda_gdr.fla_chunk_gated_delta_rule() is not None
    dims = (*heads, 128, 128, 2)
    # fla keeps normalised q/k, its WY factors and per-chunk states in bf16: allow 2e-2
    check_step('gated_delta_rule_prefill', [150, 1, 64], [0, 0, 0], [4, 1, 6], [0, 0, 0], False,
               dims, torch.bfloat16, 'cuda', rel_tol=2e-2)
    check_step('gated_delta_rule_prefill', [77, 130, 3], [150, 1, 64], [4, 1, 6], [1, 0, 2],
               False, dims, torch.bfloat16, 'cuda', rel_tol=2e-2)
    check_step('gated_delta_rule_prefill', [77, 130, 3], [150, 1, 64], [4, 1, 6], [1, 0, 2],
               False, dims, torch.float32, 'cuda', rel_tol=2e-3)  # fla: tf32 dots


# A varlen prefill step: fresh sequences (one of a single token), then a continuation of
# sequences with history reading slots 1, 0, 2, 3 (one fresh among them) and a padding row
# (q_len 0, whose row must stay untouched). The cache holds random values everywhere.
SHORT_STEPS = (([5, 1, 9], [0, 0, 0], [4, 0, 6], [0, 0, 0]),
               ([7, 0, 3, 12, 2], [5, 8, 1, 0, 40], [4, 0, 6, 2, 5], [1, 0, 2, 3, 0]))


def test_recurrent_prefill_matches_default(kernel_device):
    """`recurrent_prefill` (our kernel for short chunks) against the default op (chunk form):
    small uneven heads (masked tiles, GVA 2) in fp32 and fp64 under the interpreter, Qwen3.5
    heads in fp32 and bf16 on a GPU (there a float64 model's prefill takes the default op, and
    the kernel's fp32 `scale` argument, 128 ** -0.5 rounded, leaves fp64 ~1e-8 off)."""
    cpu = kernel_device == 'cpu'
    dims = (2, 4, 12, 20, 3) if cpu else (16, 32, 128, 128, 3)
    for q_lens, history, slots, index in SHORT_STEPS:
        for dtype in (torch.float32, torch.float64 if cpu else torch.bfloat16):
            check_step('gated_delta_rule_prefill', q_lens, history, slots, index, False, dims,
                       dtype, kernel_device, op=cuda_gdr.recurrent_prefill)
        if kernel_device == 'cuda':       # a bf16 state: fp32 math, the final state rounded
            check_step('gated_delta_rule_prefill', q_lens, history, slots, index, False, dims,
                       torch.bfloat16, kernel_device, op=cuda_gdr.recurrent_prefill,
                       cache_dtype=torch.bfloat16)


@pytest.mark.parametrize('block_v, walkers', [(64, 8), (16, 1)], ids=['default', 'loops'])
def test_chunked_walk_matches_default(kernel_device, monkeypatch, block_v, walkers):
    """A bf16 model's rows of several tokens walk in chunks of `gdn_chunk.CHUNK` on tensor cores:
    against the default op, rows longer and shorter than a chunk, whole chunks and partial ones,
    with and without history, beside one-token and padding rows. Under the interpreter in fp32
    (the same kernel with exact products) at 1e-5, as the walk; on a GPU in bf16 (tf32 products)
    by relative error, with an fp32 and a bf16 state; `loops`: narrow tiles and one resident
    program a multiprocessor, so a program takes several rows in turn."""
    monkeypatch.setattr(cuda_gdr, 'CHUNK_BLOCK_V', block_v)
    monkeypatch.setattr(cuda_gdr, 'CHUNK_WALKERS_PER_SM', walkers)
    cpu = kernel_device == 'cpu'
    if cpu:
        monkeypatch.setattr(cuda_gdr, 'CHUNKED_DTYPES', (torch.float32,))
    dims = (2, 4, 12, 20, 3) if cpu else (16, 32, 128, 128, 3)
    steps = (([37, 1, 16, 0, 5], [0, 9, 3, 0, 2], [4, 1, 6, 0, 5], [0, 2, 1, 0, 3]),
             *SHORT_STEPS)
    for q_lens, history, slots, index in steps:
        for cache_dtype in (None,) if cpu else (None, torch.bfloat16):   # fp32 / bf16 state
            check_step('gated_delta_rule_prefill', q_lens, history, slots, index, False, dims,
                       torch.float32 if cpu else torch.bfloat16, kernel_device,
                       op=cuda_gdr.recurrent_prefill, cache_dtype=cache_dtype)


def test_recurrent_prefill_bits_do_not_depend_on_tiling(kernel_device, monkeypatch):
    """The prefill walk's tiling follows the batch (`decode_tiling`): with an fp32 state
    (fixed-tree sums) its outputs and states are the same bits at every tiling, so a chunk's
    tokens do not depend on the rows it shares a step with, and a tiling may be chosen for speed
    alone (benchmarks/tune_gdn_prefill.py)."""
    cpu = kernel_device == 'cpu'
    nk, nv, dk, dv, num_spec = (2, 4, 32, 32, 3) if cpu else (16, 32, 128, 128, 3)
    q_lens, history, slots, index = SHORT_STEPS[1]
    inputs = step(q_lens, history, slots, index, False, kernel_device)
    args = gdn_args(sum(q_lens), nk, nv, dk, dv, torch.float32, kernel_device, seed=3)
    results = []
    for tiling in [(dv, max(1, dv // 16)), (dv // 2, 2), (16, 1)]:
        monkeypatch.setattr(cuda_gdr, 'decode_tiling', lambda dv, programs, t=tiling: t)
        cache = random_cache(num_spec, nv, dk, dv, torch.float32, kernel_device, seed=5)
        results.append((cuda_gdr.recurrent_prefill(*args, cache, inputs), cache))
    for out, cache in results[1:]:
        assert torch.equal(out, results[0][0]) and torch.equal(cache, results[0][1])


@pytest.mark.parametrize('walkers_per_sm', [1, None], ids=['one-walker-loops', 'default'])
def test_recurrent_prefill_split_by_row_kind_gives_one_launchs_bits(kernel_device, monkeypatch,
                                                                    walkers_per_sm):
    """`recurrent_prefill` walks rows of several tokens and one-token rows in two launches of
    different tiles (`_launch(walks=...)`), the walks by programs that each take several rows
    in turn where there are fewer programs than rows; outputs and the whole cache equal one
    launch over every row, for a step of walks, one-token rows and a padding row (fp32)."""
    if walkers_per_sm:
        monkeypatch.setattr(cuda_gdr, 'WALKERS_PER_SM', walkers_per_sm)
    cpu = kernel_device == 'cpu'
    nk, nv, dk, dv, num_spec = (2, 4, 32, 32, 3) if cpu else (16, 32, 128, 128, 3)
    q_lens, history, slots, index = [7, 1, 3, 0, 1, 12], [5, 8, 0, 0, 40, 2], [4, 1, 6, 0, 5, 2], \
        [1, 0, 0, 0, 2, 3]
    inputs = step(q_lens, history, slots, index, False, kernel_device)
    args = gdn_args(sum(q_lens), nk, nv, dk, dv, torch.float32, kernel_device, seed=7)
    split, whole = (random_cache(num_spec, nv, dk, dv, torch.float32, kernel_device, seed=5)
                    for _ in range(2))
    out_split = cuda_gdr.recurrent_prefill(*args, split, inputs)
    out_whole = cuda_gdr._launch(cuda_gdr._recurrent_prefill_kernel, *args, whole, inputs,
                                 inputs.q_start_loc, inputs.q_lens, inputs.q_lens, ROWS=0)
    assert torch.equal(out_split, out_whole) and torch.equal(split, whole)


def test_captured_recurrent_prefill_leaves_padding_rows_unwalked(kernel_device):
    """In a captured step (`sync_free`) the padding rows (state slot 0: a bucket's spare
    sequences, which may hold many of its tokens) are not walked: their outputs are zeros and
    slot 0's state is untouched; the real rows' outputs and states are the eager step's bits."""
    cpu = kernel_device == 'cpu'
    nk, nv, dk, dv, num_spec = (2, 4, 32, 32, 3) if cpu else (16, 32, 128, 128, 3)
    q_lens, history, slots, index = [7, 9, 3, 12], [5, 0, 0, 2], [4, 0, 6, 0], [1, 0, 0, 0]
    inputs = step(q_lens, history, slots, index, False, kernel_device)
    args = gdn_args(sum(q_lens), nk, nv, dk, dv, torch.float32, kernel_device, seed=11)
    cache = random_cache(num_spec, nv, dk, dv, torch.float32, kernel_device, seed=12)
    eager_cache, captured_cache = cache.clone(), cache.clone()
    eager = cuda_gdr.recurrent_prefill(*args, eager_cache, inputs)
    captured = cuda_gdr.recurrent_prefill(*args, captured_cache,
                                          dataclasses.replace(inputs, sync_free=True))
    real = torch.repeat_interleave(torch.tensor(slots) != 0, torch.tensor(q_lens))
    assert torch.equal(captured[real], eager[real])
    assert not captured[~real].any()
    assert torch.equal(captured_cache[[4, 6]], eager_cache[[4, 6]])
    assert torch.equal(captured_cache[0], cache[0])


def reference_chunk(q, k, v, g, beta, scale, initial_state, output_final_state,
                    use_qk_l2norm_in_kernel):
    """fla's `chunk_gated_delta_rule` signature ([1, T, ...], one sequence) over the default
    op's chunk form, in the initial state's dtype."""
    assert output_final_state and use_qk_l2norm_in_kernel and scale == q.shape[-1] ** -0.5
    prepared = default.gated_delta_rule._prepare(q[0], k[0], v[0], g[0], beta[0],
                                                 initial_state.dtype)
    return default.gated_delta_rule.chunk_gated_delta_rule(*(x[None] for x in prepared),
                                                          initial_state)


# (q_lens, history_lens, state slots, state index, long row): a fresh 150-token chunk beside
# decode rows, a spare row (q_len 0) and short chunks; a continuation (history > 0, read from
# slot index 2); a step whose "long" row is a short one (the runner's spare dummy); a long row
# first, whose eager window ends before the step does; a bucket's spare rows with tokens (slot
# 0: not walked, their outputs unread)
LONG_ROW_STEPS = (([1, 1, 150, 3, 0, 5], [7, 2, 0, 4, 0, 0], [4, 1, 6, 2, 0, 5], [0, 1, 0, 0, 0, 0], 2),
                  ([2, 97, 1], [5, 40, 3], [3, 6, 1], [1, 2, 0], 1),
                  ([4, 9, 6], [0, 3, 0], [2, 5, 0], [0, 0, 0], 2),
                  ([130, 2, 1, 80], [0, 6, 3, 0], [1, 4, 2, 3], [0, 1, 0, 0], 0),
                  ([1, 140, 1, 60, 57], [9, 0, 4, 0, 0], [3, 1, 2, 0, 0], [1, 0, 0, 0, 0], 1))


@pytest.mark.parametrize('eager', [False, True], ids=['captured', 'eager'])
@pytest.mark.parametrize('case', LONG_ROW_STEPS,
                         ids=['fresh', 'continued', 'spare', 'first', 'padded'])
def test_long_row_prefill_matches_default(kernel_device, case, eager):
    """A captured long step's split (graph_runner's long buckets): the long row as ONE sequence
    over the step's whole width, the other tokens taken with beta = 0 and log decay 0, the
    other rows by the recurrent kernel. Against the default op: outputs and the WHOLE cache
    (the window's foreign rows leave the long row's state exactly as its own tokens leave it).
    The chunk form stands in for fla; fp32 and fp64 in Triton's interpreter, fp32 on a GPU.
    `eager`: the window ends with the row's chunk, rounded up to 64 (an eager step: past the
    step's end when the row is last, zero rows)."""
    import dataclasses
    q_lens, history, slots, index, row = case
    long_row = torch.tensor([row], device=kernel_device)

    def op(*args):
        inputs = dataclasses.replace(args[-1], sync_free=True, long_row=long_row)
        cache, reserved = args[-2], args[-2][0].clone()
        out = cuda_gdr.long_row_prefill(
            *args[:-1], inputs, reference_chunk,
            width=cuda_gdr.eager_width(q_lens, row) if eager else None)
        assert slots[row] == 0 or torch.equal(cache[0], reserved), 'a padding row was walked'
        return out
    for dtype in (torch.float32, torch.float64) if kernel_device == 'cpu' else (torch.float32,):
        check_step('gated_delta_rule_prefill', q_lens, history, slots, index, False,
                   (2, 4, 12, 20, 3), dtype, kernel_device, op=op, padding_rows=[
                       i for i, slot in enumerate(slots) if slot == 0 and i != row])


@pytest.mark.gpu
@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float32])
def test_long_row_prefill_with_fla(dtype):
    """The same split with fla on a GPU at Qwen3.5 heads, a 700-token long row (ours' window
    is the step's 730 tokens), inside a CUDA graph: against the default op (fla's bf16 internals:
    2e-2; fp32: tf32 dots, 2e-3), and bit for bit the eager op's split of the same step (its
    window the step's first 11 chunks, 704 rows, to the row's end: the captured window's extra
    rows add exact zeros and its last chunk is the same), outputs and the whole cache."""
    import dataclasses
    chunk = cuda_gdr.fla_chunk_gated_delta_rule()
    if chunk is None:
        pytest.skip('fla is not installed')
    q_lens, history, slots, index = [1, 700, 1, 28, 0], [9, 0, 33, 4, 0], [6, 2, 5, 4, 0], \
        [1, 0, 3, 0, 0]
    dims = (16, 32, 128, 128, 3)
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-3

    def captured(*args):
        inputs = dataclasses.replace(args[-1], sync_free=True, long_row=torch.tensor([1],
                                                                                     device='cuda'))
        cache, before = args[-2], args[-2].clone()
        cuda_gdr.long_row_prefill(*args[:-1], inputs, chunk)        # compile, autotune
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = cuda_gdr.long_row_prefill(*args[:-1], inputs, chunk)
        cache.copy_(before)
        graph.replay()
        return out
    check_step('gated_delta_rule_prefill', q_lens, history, slots, index, False, dims, dtype,
               'cuda', rel_tol=tol, op=captured)
    inputs = step(q_lens, history, slots, index, False, 'cuda')
    args = gdn_args(sum(q_lens), 16, 32, 128, 128, dtype, 'cuda', seed=7)
    cache = random_cache(3, 32, 128, 128, dtype, 'cuda', seed=8)
    eager_cache, long_cache = cache.clone(), cache.clone()
    eager = cuda_gdr.gated_delta_rule_prefill(*args, eager_cache, inputs)
    split = cuda_gdr.long_row_prefill(*args, long_cache, dataclasses.replace(
        inputs, sync_free=True, long_row=torch.tensor([1], device='cuda')), chunk)
    assert torch.equal(split, eager) and torch.equal(long_cache, eager_cache)


@pytest.mark.gpu
@pytest.mark.parametrize('cache_dtype', [torch.float32, torch.bfloat16])
def test_short_prefill_matches_fla(cache_dtype, monkeypatch):
    """The short-prefill kernel and fla's chunk kernel agree (fla's bf16 internals: 2e-2) on
    the same step, outputs and the whole cache; a step of at most SHORT_PREFILL_TOKENS tokens
    per sequence takes the kernel, a longer one fla."""
    pytest.importorskip('fla.ops.gated_delta_rule')
    nk, nv, d = 16, 32, 128
    q_lens, history = [48, 17, 1, cuda_gdr.SHORT_PREFILL_TOKENS], [1472, 0, 9, 200]
    slots, index = [4, 6, 2, 5], [1, 0, 2, 0]
    args = gdn_args(sum(q_lens), nk, nv, d, d, torch.bfloat16, 'cuda', seed=3)
    cache = random_cache(2, nv, d, d, torch.float32, 'cuda', seed=4).to(cache_dtype)
    short_cache, fla_cache = cache.clone(), cache.clone()
    kernel, calls = cuda_gdr.recurrent_prefill, []

    def spy(*a):
        calls.append(a)
        return kernel(*a)
    monkeypatch.setattr(cuda_gdr, 'recurrent_prefill', spy)
    short = cuda_gdr.gated_delta_rule_prefill(
        *args, short_cache, step(q_lens, history, slots, index, False, 'cuda'))
    assert len(calls) == 1, 'a short step must take the recurrent kernel'
    monkeypatch.setattr(cuda_gdr, 'SHORT_PREFILL_TOKENS', 0)       # every row: fla's varlen
    monkeypatch.setattr(cuda_gdr, 'CAPTURED_PREFILL_TOKENS', 0)
    fla = cuda_gdr.gated_delta_rule_prefill(
        *args, fla_cache, step(q_lens, history, slots, index, False, 'cuda'))
    assert len(calls) == 1, 'a longer step must take fla'
    assert_rel_close(short, fla, 2e-2)
    assert_rel_close(short_cache, fla_cache, 2e-2)
    assert torch.equal(short_cache[[0, 1, 3]], cache[[0, 1, 3]])    # rows of no sequence


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
def test_gdn_gating_matches_default(dtype, kernel_device):
    from lmdeploy_lite.pytorch.backends.cuda.gated_delta_rule import gdn_gating
    from lmdeploy_lite.pytorch.backends.default.gated_delta_rule import gdn_gating as reference
    if dtype == torch.bfloat16 and kernel_device == 'cpu':
        pytest.skip('bf16 runs on CUDA only')
    gen = torch.Generator().manual_seed(3)
    fused = (torch.randn(7, 40, generator=gen) * 8).to(dtype).to(kernel_device)  # a, b are views
    a, b = fused[:, 32:36], fused[:, 36:40]
    a_log = torch.rand(4, generator=gen).mul(3).to(dtype).to(kernel_device)
    dt_bias = torch.randn(4, generator=gen).to(dtype).to(kernel_device)
    g, beta = gdn_gating(a, b, a_log, dt_bias)
    g_ref, beta_ref = reference(a, b, a_log, dt_bias)
    assert g.dtype == g_ref.dtype and beta.dtype == beta_ref.dtype
    torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-5)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(beta, beta_ref, rtol=tol, atol=tol)
