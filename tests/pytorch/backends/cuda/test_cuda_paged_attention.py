"""backends/cuda paged attention against backends/default on fresh random inputs: decode (n=1),
verify (n=4) with forced and default split counts, prefill with mixed lengths and a chunked
continuation, GQA ratios 1 and 4, shuffled block tables, caches holding stale random data past
every sequence's KV; the caches after the call must equal the default's."""
from __future__ import annotations

import importlib
from dataclasses import fields

import pytest
import torch

from lmdeploy_lite.pytorch.backends.default import paged_attention as default_paged_attention
from lmdeploy_lite.pytorch.model_inputs import ModelInputs
from tests.helpers.step_inputs import make_inputs, shuffled_block_tables


@pytest.fixture(autouse=True, scope='module')
def interpreter_scalar_index():
    """Triton 3.6's interpreter turns a scalar into an int with `int(array of shape (1,))`, which
    numpy >= 2.4 rejects, so `range` with runtime bounds fails under the interpreter
    (triton-lang/triton#9171). Patch it to squeeze first, as the upstream fix does."""
    if torch.cuda.is_available():
        yield
        return
    interpreter = pytest.importorskip('triton.runtime.interpreter')
    original = interpreter._patch_lang_tensor

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, '__index__', lambda self: int(self.handle.data.squeeze()))
    interpreter._patch_lang_tensor = patch_lang_tensor
    yield
    interpreter._patch_lang_tensor = original


class HostReadsForbidden(ModelInputs):
    """ModelInputs whose host-side lengths raise: the decode path must never read them."""

    @property
    def _host_lens(self):
        raise AssertionError('decode path read sequence lengths on the host')


def cuda_ops():
    """The kernel module (imported once the `kernel_device` fixture has checked for Triton)."""
    return importlib.import_module('lmdeploy_lite.pytorch.backends.cuda.paged_attention')


def tolerances(dtype):
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)


def random_caches(batch, max_kv_len, block_size, n_kv, head_dim, dtype, device, gen):
    """Caches for `batch` sequences of up to `max_kv_len` tokens (one spare block each, block 0
    unused), full of random values: positions past a sequence's KV hold stale data."""
    shape = (batch * (max_kv_len // block_size + 2) + 1, block_size, n_kv, head_dim)
    k_cache = torch.randn(*shape, generator=gen).to(device, dtype)
    return k_cache, torch.randn(*shape, generator=gen).to(device, dtype)


def compare_step(q_lens, history_lens, caches, nq, decoding, dtype, device, gen, num_splits=None,
                 sync_free=False):
    """Run one step with both backends on equal copies of `caches` (updated in place with the
    default's result) and compare outputs and caches. `sync_free`: a captured prefill's inputs
    (no host lengths)."""
    ops = cuda_ops()
    k_cache, v_cache = caches
    n_kv, head_dim = k_cache.shape[2:]
    batch, total = len(q_lens), sum(q_lens)
    tables = shuffled_block_tables(batch, (k_cache.shape[0] - 1) // batch, seed=batch)
    inputs = make_inputs([[0] * n for n in q_lens], history_lens, tables, list(range(batch)),
                         is_decoding=decoding).to(device)
    if decoding or sync_free:
        inputs = HostReadsForbidden(**{f.name: getattr(inputs, f.name) for f in fields(inputs)
                                       if f.name not in ('host_lens', 'sync_free')},
                                    sync_free=sync_free)
    q = torch.randn(total, nq, head_dim, generator=gen).to(device, dtype)
    k = torch.randn(total, n_kv, head_dim, generator=gen).to(device, dtype)
    v = torch.randn(total, n_kv, head_dim, generator=gen).to(device, dtype)
    scale = head_dim ** -0.5
    k_ours, v_ours = k_cache.clone(), v_cache.clone()
    if num_splits is None:
        out = ops.paged_attention(q, k, v, k_ours, v_ours, inputs, scale)
    else:
        ops.store_kv(k, v, k_ours, v_ours, inputs)
        attention = ops.decode_attention if decoding else ops.prefill_attention
        out = attention(q, k_ours, v_ours, inputs, scale, num_splits=num_splits)
    reference_inputs = make_inputs([[0] * n for n in q_lens], history_lens, tables,
                                   list(range(batch)), is_decoding=decoding).to(device)
    ref = default_paged_attention(q, k, v, k_cache, v_cache, reference_inputs, scale)
    assert torch.equal(k_ours, k_cache) and torch.equal(v_ours, v_cache)
    torch.testing.assert_close(out, ref, **tolerances(dtype))


def kernel_dtypes(device):
    return [torch.float32] + ([torch.bfloat16] if device == 'cuda' else [])


HISTORY_LENS = [0, 7, 50, 29, 23]           # a history-0 padding row; not block multiples
DECODE_CASES = [   # q_len, nq, n_kv, block_size, num_splits, history_lens
    (1, 4, 4, 4, None, HISTORY_LENS),       # decode, GQA 1
    (1, 8, 2, 8, None, HISTORY_LENS),       # decode, GQA 4
    (4, 8, 2, 4, None, HISTORY_LENS),       # verify k + 1 = 4, GQA 4
    (4, 4, 4, 16, 3, HISTORY_LENS),         # verify, GQA 1, three splits
    (1, 8, 2, 16, 4, HISTORY_LENS),         # decode, four splits (some empty for short sequences)
    (4, 8, 2, 8, 1, HISTORY_LENS),          # verify, one split
    # 16 tokens x GQA 8 = 128 rows: two row tiles per KV head (four of fp32's 32 rows); three
    # sequences (the padding row, whose second split is empty, a long and a mid one) keep that
    # at half the interpreter's time; the other lengths are the cases above
    (16, 8, 1, 16, 2, [0, 50, 23]),
]


@pytest.mark.parametrize('q_len,nq,n_kv,block_size,num_splits,history_lens', DECODE_CASES,
                         ids=['-'.join(map(str, case[:5])) for case in DECODE_CASES])
def test_decode_matches_default(kernel_device, q_len, nq, n_kv, block_size, num_splits,
                                history_lens):
    gen = torch.Generator().manual_seed(q_len * 100 + nq + block_size)
    for dtype in kernel_dtypes(kernel_device):
        caches = random_caches(len(history_lens), 70, block_size, n_kv, 16, dtype, kernel_device, gen)
        compare_step([q_len] * len(history_lens), history_lens, caches, nq, True, dtype,
                     kernel_device, gen, num_splits)


@pytest.mark.parametrize('nq,n_kv,sync_free,num_splits', [
    (2, 2, False, None), (8, 2, False, None), (8, 2, True, None), (2, 1, True, 3)],
    ids=['gqa1', 'gqa4', 'gqa4-device-tiles', 'gqa2-device-tiles-3-splits'])
def test_prefill_and_chunked_continuation_match_default(kernel_device, nq, n_kv, sync_free,
                                                        num_splits):
    """`sync_free`: the query-tile map built on the device (a captured step), with a sequence of
    no new tokens among them. `num_splits`: each tile's history split (some splits empty)."""
    gen = torch.Generator().manual_seed(nq)
    schedule = [[5, 40, 1, 17], [3, 34, 0 if sync_free else 9, 1]]   # then a chunk after each
    for dtype in kernel_dtypes(kernel_device):
        caches = random_caches(4, 80, 8, n_kv, 32, dtype, kernel_device, gen)
        history_lens = [0] * 4
        for q_lens in schedule:
            compare_step(q_lens, history_lens, caches, nq, False, dtype, kernel_device, gen,
                         num_splits=num_splits, sync_free=sync_free)
            history_lens = [h + n for h, n in zip(history_lens, q_lens)]


@pytest.mark.parametrize('q_lens,history_lens,tiles_in_use', [
    ([2] * 12 + [33, 1, 0, 1], [3, 0] * 6 + [9, 20, 0, 0], 12 + 2),
    ([1, 1, 0, 1], [20, 0, 0, 7], 0)], ids=['walks-and-one-token-rows', 'one-token-rows-only'])
def test_device_tile_map_gives_the_host_maps_bits(kernel_device, q_lens, history_lens,
                                                  tiles_in_use):
    """A captured step's query tiles (the map built on the device, programs bounded by the
    shapes, each looping over several of the tiles in use) and an eager step's (host map, one
    program a tile) give the same bits; rows of one new token take the decode kernel in both
    (one of them fresh, one a padding row of none; a step of such rows only launches no
    query tile when eager), and match the default."""
    ops = cuda_ops()
    gen = torch.Generator().manual_seed(5)
    batch, total, nq, n_kv, head_dim = len(q_lens), sum(q_lens), 4, 2, 16
    k_cache, v_cache = random_caches(batch, 64, 8, n_kv, head_dim, torch.float32,
                                     kernel_device, gen)
    tables = shuffled_block_tables(batch, (k_cache.shape[0] - 1) // batch, seed=batch)
    inputs = make_inputs([[0] * n for n in q_lens], history_lens, tables, list(range(batch)),
                         is_decoding=False).to(kernel_device)
    captured = HostReadsForbidden(**{f.name: getattr(inputs, f.name) for f in fields(inputs)
                                     if f.name not in ('host_lens', 'sync_free')}, sync_free=True)
    q, k, v = (torch.randn(total, n, head_dim, generator=gen).to(kernel_device)
               for n in (nq, n_kv, n_kv))
    ops.store_kv(k, v, k_cache, v_cache, inputs)
    tiles = ops._device_tiles(captured, 32, total)
    assert tiles[0, -1].item() == tiles_in_use           # of room for T / 32 + B
    eager = ops.prefill_attention(q, k_cache, v_cache, inputs, head_dim ** -0.5, num_splits=2)
    graph = ops.prefill_attention(q, k_cache, v_cache, captured, head_dim ** -0.5, num_splits=2)
    assert torch.equal(eager, graph)
    ref = default_paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), inputs,
                                  head_dim ** -0.5)
    torch.testing.assert_close(graph, ref, **tolerances(torch.float32))


def test_empty_step_returns_empty(kernel_device):
    ops = cuda_ops()
    none = torch.zeros(0, dtype=torch.long)
    inputs = ModelInputs(none, none, none, none, torch.zeros(0, 1, dtype=torch.long), none, none,
                         is_decoding=False).to(kernel_device)
    q, kv = torch.empty(0, 4, 16, device=kernel_device), torch.empty(0, 2, 16, device=kernel_device)
    cache = torch.zeros(2, 4, 2, 16, device=kernel_device)
    assert ops.paged_attention(q, kv, kv, cache, cache.clone(), inputs, 0.25).shape == (0, 4, 16)


def test_num_splits_depends_on_host_values_only():
    ops = cuda_ops()
    assert ops.decode_num_splits(num_programs=4, max_kv_tiles=512, num_sms=132) == ops.MAX_SPLITS
    assert ops.decode_num_splits(num_programs=4, max_kv_tiles=3, num_sms=132) == 3
    assert ops.decode_num_splits(num_programs=512, max_kv_tiles=512, num_sms=132) == 1


def test_split_span_keeps_equal_lengths_and_splits_a_long_row_finer(kernel_device):
    """Equal lengths split as the even share always did; one long row among short ones takes
    SPREAD x the splits (4 -> 16 for 8k among 32 rows of ~150), the short rows few."""
    ops = cuda_ops()

    def splits_used(kv_len, num_splits, span, block_n=32):
        split_len = max(-(-(-(-kv_len // num_splits)) // block_n) * block_n, span)
        return -(-kv_len // split_len)
    even = ops.decode_num_splits(num_programs=33 * 2, max_kv_tiles=512, num_sms=132)
    num_splits = min(ops.MAX_SPLITS, ops.SPREAD * even)
    span = int(ops.split_span(torch.full((33,), 2047, device=kernel_device), 1, even * 33, 32))
    assert (even, span) == (4, 512) and splits_used(2048, num_splits, span) == even
    span = int(ops.split_span(torch.tensor([150] * 32 + [8191], device=kernel_device), 1,
                               even * 33, 32))
    assert splits_used(8192, num_splits, span) == 16 and splits_used(151, num_splits, span) == 2


def test_split_span_kernel_is_the_formula(kernel_device):
    """The one-launch span equals its arithmetic in torch (the ten launches it replaced)."""
    gen = torch.Generator().manual_seed(0)
    for num_seqs, q_len, block_n in [(1, 1, 32), (33, 4, 64), (256, 1, 16), (7, 2, 128)]:
        history = torch.randint(0, 9000, (num_seqs,), generator=gen)
        splits = int(torch.randint(1, 300, (), generator=gen))
        total = history.sum() + q_len * num_seqs
        span = (total + splits - 1) // splits
        expected = int(((span + block_n - 1) // block_n * block_n).clamp(min=block_n))
        got = cuda_ops().split_span(history.to(kernel_device), q_len, splits, block_n)
        assert got.shape == (1,) and int(got) == expected


# ----------------------------------------------------------------------------- GPU, real sizes

@pytest.mark.gpu
@pytest.mark.parametrize('q_len', [1, 4])
def test_decode_realistic_sizes_bf16(q_len):
    gen = torch.Generator().manual_seed(q_len)
    history_lens = [0, 4096 - q_len, 1000, 2047, 17, 3333, 64, 4000 - q_len]
    caches = random_caches(len(history_lens), 4096, 64, 4, 256, torch.bfloat16, 'cuda', gen)
    compare_step([q_len] * len(history_lens), history_lens, caches, 16, True, torch.bfloat16,
                 'cuda', gen)


@pytest.mark.gpu
def test_prefill_realistic_sizes_bf16():
    gen = torch.Generator().manual_seed(0)
    caches = random_caches(3, 4096, 64, 4, 256, torch.bfloat16, 'cuda', gen)
    compare_step([1000, 3000, 17], [0, 0, 0], caches, 16, False, torch.bfloat16, 'cuda', gen)
    compare_step([96, 1000, 1], [1000, 3000, 17], caches, 16, False, torch.bfloat16, 'cuda', gen)
    caches = random_caches(4, 4096, 64, 4, 256, torch.bfloat16, 'cuda', gen)
    for num_splits in (None, 5):         # a chunk of a long prompt beside decode rows: split
        compare_step([992, 1, 1, 1], [3000, 17, 0, 1000], caches, 16, False, torch.bfloat16,
                     'cuda', gen, num_splits=num_splits)


@pytest.mark.gpu
def test_decode_replays_in_cuda_graph_for_new_lengths():
    """Captured once, replayed after the device history_lens change: matches the default."""
    ops = cuda_ops()
    gen = torch.Generator().manual_seed(1)
    nq, n_kv, head_dim, q_len, batch = 16, 4, 256, 4, 4
    k_cache, v_cache = random_caches(batch, 4096, 64, n_kv, head_dim, torch.bfloat16, 'cuda', gen)
    tables = shuffled_block_tables(batch, (k_cache.shape[0] - 1) // batch, seed=batch)
    inputs = make_inputs([[0] * q_len] * batch, [10, 0, 500, 2000], tables, list(range(batch)),
                         is_decoding=True).to('cuda')
    q = torch.randn(batch * q_len, nq, head_dim, generator=gen).to('cuda', torch.bfloat16)
    k = torch.randn(batch * q_len, n_kv, head_dim, generator=gen).to('cuda', torch.bfloat16)
    v = torch.randn_like(k)
    ops.paged_attention(q, k, v, k_cache, v_cache, inputs, head_dim ** -0.5)   # compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.paged_attention(q, k, v, k_cache, v_cache, inputs, head_dim ** -0.5)
    new_history = [3000, 1, 0, 999]
    inputs.history_lens.copy_(torch.tensor(new_history))
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    graph.replay()
    reference_inputs = make_inputs([[0] * q_len] * batch, new_history, tables,
                                   list(range(batch)), is_decoding=True).to('cuda')
    ref = default_paged_attention(q, k, v, k_ref, v_ref, reference_inputs, head_dim ** -0.5)
    assert torch.equal(k_ref, k_cache) and torch.equal(v_ref, v_cache)
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
