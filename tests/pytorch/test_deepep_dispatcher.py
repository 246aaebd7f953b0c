"""The EP dispatcher factory and the DeepEP dispatcher's tensor logic.

CPU: the factory's choice and fallbacks, the capacity rules, the pure helpers (low-latency
flattening, exact bf16 splitting), and the whole DeepEPDispatcher (both modes, each call in
the mode it is given; normal mode with and without `num_worst_tokens`' fixed rows; bf16 and
exact float32) on a one-rank stand-in for deep_ep.Buffer that follows DeepEP's documented
semantics, including bf16 low-latency's grouped rows run by FusedExperts' masked op.
GPU (2 GPUs, `deep_ep` importable): DeepEP against the all-to-all dispatcher on random inputs.
"""
import queue
import traceback
from types import SimpleNamespace

import pytest
import torch

from lmdeploy_lite.pytorch.backends.cuda import token_dispatcher as deepep
from lmdeploy_lite.pytorch.config import DistConfig
from lmdeploy_lite.pytorch.distributed import DistContext, Group
from lmdeploy_lite.pytorch.nn.moe import FusedExperts
from lmdeploy_lite.pytorch.model_inputs import ForwardSizes
from lmdeploy_lite.pytorch.nn.token_dispatcher import (ENV_CAPACITY, ENV_DISPATCHER,
                                                       AllToAllDispatcher, EPTransport,
                                                       GroupedRows, TopKRows, dispatch_capacity)


def ep_context(ep: int = 2, rank: int = 0) -> DistContext:
    """A DistContext that was never initialised (no collective runs); its own EP group key."""
    ctx = DistContext(DistConfig(dp=ep, ep=ep), rank)
    ctx.groups['ep'] = Group(ctx, 'ep', tuple(range(ep)), gloo=object())
    return ctx


def shared_buffer(ctx, num_experts: int, capacity: int, buffer=None) -> deepep.SharedBuffer:
    shared = deepep.SharedBuffer(ctx.ep.gloo, num_experts, capacity)
    shared.buffer = buffer
    return shared


def moe_layers(*dispatchers) -> torch.nn.Module:
    """A module tree whose layers hold these dispatchers, as SparseMoeBlocks do."""
    root = torch.nn.Module()
    for i, dispatcher in enumerate(dispatchers):
        layer = torch.nn.Module()
        layer.dispatcher = dispatcher
        root.add_module(f'layer{i}', layer)
    return root


# ---- the transport ----------------------------------------------------------------------------
def test_transport_falls_back_to_all_to_all_on_cpu(monkeypatch):
    monkeypatch.delenv(ENV_DISPATCHER, raising=False)
    ctx = ep_context()
    transport = EPTransport(ctx, 4, 64, 2, 16, 'cpu', torch.float32)
    model = moe_layers(AllToAllDispatcher(ctx, 4))
    transport.attach(model)                        # no DeepEP: the layers keep all-to-all,
    transport.prepare(ForwardSizes(4, 400, 4, 4, low_latency=True))    # and no capacity check
    assert not transport.deep_ep and isinstance(model.layer0.dispatcher, AllToAllDispatcher)
    monkeypatch.setenv(ENV_DISPATCHER, 'deepep')
    with pytest.raises(ValueError, match='deepep, but DeepEP cannot be used: the device is cpu'):
        EPTransport(ctx, 4, 64, 2, 16, 'cpu', torch.float32)
    EPTransport(DistContext.single(), 4, 64, 2, 16, 'cpu', torch.float32)     # ep=1: no choice
    monkeypatch.setenv(ENV_DISPATCHER, 'nccl')
    with pytest.raises(ValueError, match="LMDEPLOY_LITE_EP_DISPATCHER='nccl': must be one of"):
        EPTransport(ctx, 4, 64, 2, 16, 'cpu', torch.float32)


def test_transport_gives_its_groups_layers_one_deep_ep_buffer(monkeypatch):
    """Target and draft layers on the EP group get DeepEP dispatchers over the transport's one
    buffer, allocated at attach (before the KV plan); a draft at ep=1 (a group of one) keeps
    its all-to-all; a later, wider layer is refused."""
    monkeypatch.delenv(ENV_DISPATCHER, raising=False)
    ctx = ep_context()
    transport = EPTransport(ctx, 4, 64, 2, 16, 'cpu', torch.bfloat16)
    transport.shared = shared_buffer(ctx, 4, 16)
    transport.shared._allocate = lambda: OneRankBuffer()
    draft_ep1 = Group(ctx, 'ep', (0,))
    alone = AllToAllDispatcher(ctx, 4)
    alone.group = draft_ep1
    target = moe_layers(AllToAllDispatcher(ctx, 4), AllToAllDispatcher(ctx, 4))
    draft = moe_layers(alone)
    transport.attach(target)
    assert isinstance(transport.shared.buffer, OneRankBuffer)
    transport.attach(draft)
    assert [type(m.dispatcher).__name__ for m in (target.layer0, target.layer1, draft.layer0)] == [
        'DeepEPDispatcher', 'DeepEPDispatcher', 'AllToAllDispatcher']
    assert target.layer0.dispatcher.shared is target.layer1.dispatcher.shared is transport.shared
    with pytest.raises(RuntimeError, match='built after the shared buffer was allocated'):
        deepep.DeepEPDispatcher(ctx, 4, 4096, 2, torch.bfloat16, transport.shared)


def test_the_drafts_meta_footprint_chooses_no_transport(monkeypatch):
    """The draft's footprint is measured on a meta-device build with the draft's own layout
    (spec_decode/build.draft_footprint): with DeepEP forced that build must not ask for DeepEP
    (it raised 'the device is meta' at every dp2 ep2 engine start on the GPUs)."""
    from lmdeploy_lite.messages import SpeculativeConfig
    from lmdeploy_lite.pytorch.config import ModelConfig
    from lmdeploy_lite.pytorch.spec_decode.build import draft_footprint
    from lmdeploy_lite.api import EMBEDDED_MODEL_DIR
    monkeypatch.setenv(ENV_DISPATCHER, 'deepep')
    config = ModelConfig.from_pretrained(EMBEDDED_MODEL_DIR)
    footprint = draft_footprint(SpeculativeConfig(num_speculative_tokens=3), config,
                                torch.bfloat16, DistConfig(dp=2, ep=2))
    assert footprint.num_kv_layers == 1 and footprint.weight_bytes > 0


def test_dispatch_capacity_default_and_override(monkeypatch):
    monkeypatch.delenv(ENV_CAPACITY, raising=False)
    assert dispatch_capacity(64, 3) == 256
    assert dispatch_capacity(8, 0) == 8
    assert dispatch_capacity(64, 3, tp=3) == 258        # the plan's tp-rounded count fits
    monkeypatch.setenv(ENV_CAPACITY, '40')
    assert dispatch_capacity(64, 3) == 40
    monkeypatch.setenv(ENV_CAPACITY, '-3')
    with pytest.raises(ValueError, match="DEEPEP_MAX_TOKENS_PER_RANK='-3'"):
        dispatch_capacity(64, 3)


def test_a_step_over_capacity_names_rank_step_and_both_numbers():
    """The plan's per-rank tokens (max_tokens / tp), not a rank's own count, are checked against
    the start-up capacity before the step (graph replays run no Python dispatch)."""
    ctx = ep_context(rank=1)
    ctx.config = DistConfig(tp=2, dp=2, ep=4)
    ctx.step = 7
    transport = EPTransport(ctx, 4, 64, 2, 16, 'cpu', torch.bfloat16)
    transport.shared = shared_buffer(ctx, 4, 16, OneRankBuffer())
    transport.prepare(ForwardSizes(2, 32, 2, 2, low_latency=True))       # 16 per rank
    transport.prepare(ForwardSizes(2, 34, 2, 2, low_latency=False))      # normal: no limit
    with pytest.raises(ValueError, match=r'at step 7: the plan has 17 tokens per rank \(rank 1\), '
                                         r'but the buffer holds 16 per rank \(DEEPEP_MAX_TOKENS'):
        transport.prepare(ForwardSizes(2, 34, 2, 2, low_latency=True))


def test_what_deepep_cannot_carry():
    assert deepep.DeepEPDispatcher.unsupported(4096, 8, torch.bfloat16) is None
    assert deepep.DeepEPDispatcher.unsupported(64, 2, torch.float32) is None
    assert 'at most 8192' in deepep.DeepEPDispatcher.unsupported(9216, 8, torch.bfloat16)
    assert 'at most 8192' in deepep.DeepEPDispatcher.unsupported(2048, 8, torch.float32)
    assert 'not torch.float64' in deepep.DeepEPDispatcher.unsupported(64, 2, torch.float64)
    assert deepep.ll_width(64) == 2048 and deepep.ll_width(2049) == 2560


# ---- pure helpers -----------------------------------------------------------------------------
def test_flatten_low_latency_marks_padding_rows():
    recv_x = torch.arange(2 * 3 * 4, dtype=torch.float32).view(2, 3, 4)   # [E=2, C=3, W=4]
    rows, ids = deepep.flatten_low_latency(recv_x, torch.tensor([2, 0], dtype=torch.int32), 3)
    assert ids.tolist() == [0, 0, -1, -1, -1, -1]
    assert rows.shape == (6, 3)
    assert rows[:2].tolist() == [[0, 1, 2], [4, 5, 6]]
    back = deepep.unflatten_low_latency(rows, 2, 5)
    assert back.shape == (2, 3, 5) and back.is_contiguous()
    assert back[..., :3].equal(recv_x[..., :3]) and not back[..., 3:].any()


@pytest.mark.parametrize('dtype', [torch.float32, torch.float16])
def test_split_into_bf16_parts_is_exact(dtype):
    exponents = torch.randint(-4, 4, (1000,), generator=torch.Generator().manual_seed(1))
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 10.0 ** exponents
    extremes = [1e-30, 3e38] if dtype == torch.float32 else [6e-8, 6e4]
    x = torch.cat([x, torch.tensor([0.0, -0.0] + extremes)]).to(dtype)
    parts = deepep.split_bf16(x, deepep.num_bf16_parts(dtype))
    assert parts.dtype == torch.bfloat16
    assert deepep.join_bf16(parts, dtype).equal(x)
    words = deepep.as_bf16_words(x)
    assert words.dtype == torch.bfloat16 and words.view(dtype).equal(x)


def test_slot_blocks_put_each_row_in_its_slot():
    values = torch.tensor([[1.5, -2.0], [3.25, 4.0]])
    blocks = deepep.slot_blocks(values, torch.tensor([1, 0]), top_k=3, parts=1)
    assert blocks.view(2, 3, 2).tolist() == [[[0, 0], [1.5, -2.0], [0, 0]],
                                             [[3.25, 4.0], [0, 0], [0, 0]]]


# ---- the dispatcher on a one-rank stand-in for deep_ep.Buffer ----------------------------------
class OneRankBuffer:
    """deep_ep.Buffer's documented results for a group of one rank (every expert local)."""

    def get_dispatch_layout(self, topk_idx, num_experts):
        return None, None, None, None, None

    def dispatch(self, x, topk_idx, topk_weights, **layout):
        assert topk_weights.dtype == torch.float32 and x.is_contiguous()
        return x.clone(), topk_idx, topk_weights, [], ('handle',), None

    def combine(self, x, handle):
        assert x.dtype == torch.bfloat16 and handle == ('handle',)
        return x.clone(), None, None

    def low_latency_dispatch(self, x, topk_idx, capacity, num_experts, use_fp8=True):
        assert x.dtype == torch.bfloat16 and not use_fp8 and x.shape[1] in deepep.LL_WIDTHS
        recv = torch.full((num_experts, capacity, x.shape[1]), float('nan'),
                          dtype=torch.bfloat16)                   # stale rows: garbage
        count = torch.zeros(num_experts, dtype=torch.int32)
        where = {}
        for t, e in ((t, e) for t in range(x.shape[0]) for e in topk_idx[t].tolist()):
            where[t, e] = int(count[e])
            recv[e, count[e]] = x[t]
            count[e] += 1
        return recv, count, where, None, None

    def low_latency_combine(self, x, topk_idx, topk_weights, handle):
        assert x.dtype == torch.bfloat16 and topk_weights.dtype == torch.float32
        out = torch.zeros(topk_idx.shape[0], x.shape[2])
        for (t, e), c in handle.items():
            slot = topk_idx[t].tolist().index(e)
            out[t] += topk_weights[t, slot] * x[e, c].float()
        return out.to(torch.bfloat16), None, None

    def clean_low_latency_buffer(self, capacity, width, num_experts):
        self.num_cleans = getattr(self, 'num_cleans', 0) + 1


class FixedRowsOneRankBuffer(OneRankBuffer):
    """A DeepEP with `num_worst_tokens` (intranode): the normal dispatch receives into that many
    rows, those past the received tokens stale (NaN) with ids -1."""
    runtime = SimpleNamespace(get_num_rdma_ranks=lambda: 1)

    def dispatch(self, x, topk_idx, topk_weights, num_worst_tokens=0, **layout):
        assert num_worst_tokens >= x.shape[0]
        pad = num_worst_tokens - x.shape[0]
        recv_x = torch.cat([x, x.new_full((pad, x.shape[1]), float('nan'))])
        recv_idx = torch.cat([topk_idx, topk_idx.new_full((pad, topk_idx.shape[1]), -1)])
        recv_weights = torch.cat([topk_weights, topk_weights.new_full((pad, topk_idx.shape[1]),
                                                                      float('nan'))])
        return recv_x, recv_idx, recv_weights, [], ('handle', x.shape[0]), None

    def combine(self, x, handle):
        assert x.dtype == torch.bfloat16 and handle[0] == 'handle'
        return x[:handle[1]].clone(), None, None


def toy_experts(x, local_ids):
    """Expert e: tanh(x * (e + 1)) - e; padding rows (-1): 0."""
    scale = (local_ids.clamp(min=0) + 1).to(x.dtype)[:, None]
    out = torch.tanh(x * scale) - local_ids.clamp(min=0).to(x.dtype)[:, None]
    return torch.where((local_ids >= 0)[:, None], out, 0)


def run_toy_experts(expert_x, routing, first_expert=0):
    """toy_experts on what a dispatcher hands over (global expert = first_expert + local id):
    rows and local ids, rows grouped by expert (`GroupedRows`; a new tensor, not written into
    routing.out, so combine must copy it in), or tokens with their top-k (`TopKRows`: each
    token's weighted sum over its slots, in slot order)."""
    if isinstance(routing, TopKRows):
        out = torch.zeros_like(expert_x, dtype=torch.float32)
        for slot in range(routing.ids.shape[1]):
            ids = routing.ids[:, slot]
            pairs = toy_experts(expert_x, torch.where(ids >= 0, ids + first_expert, -1))
            out += pairs.float() * routing.weights[:, slot, None].float()
        return out.to(expert_x.dtype)
    if isinstance(routing, GroupedRows):
        experts, capacity, hidden = expert_x.shape
        valid = torch.arange(capacity, device=expert_x.device)[None, :] < routing.counts[:, None]
        local = torch.arange(experts, device=expert_x.device)[:, None].expand(experts, capacity)
        ids = torch.where(valid, local + first_expert, -1).reshape(-1)
        return toy_experts(expert_x.reshape(-1, hidden), ids).view(experts, capacity, hidden)
    return toy_experts(expert_x, torch.where(routing >= 0, routing + first_expert, -1))


@pytest.mark.parametrize('mode', ['normal', 'normal_fixed_rows', 'low_latency'])
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
def test_dispatch_combine_matches_the_all_to_all_arithmetic(dtype, mode):
    """Normal mode without `num_worst_tokens` (host-synced row counts) and with it (fixed rows:
    capacity x ep, no host sync), and low-latency mode, against the all-to-all's arithmetic."""
    low_latency = mode == 'low_latency'
    num_experts, hidden, top_k, tokens = 4, 64, 2, 7
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k]
                       for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=gen).to(dtype)
    ctx = ep_context(ep=1)
    dispatcher = deepep.DeepEPDispatcher(ctx, num_experts, hidden, top_k, dtype,
                                         shared_buffer(ctx, num_experts, tokens))
    fixed = mode == 'normal_fixed_rows'
    dispatcher.shared.buffer = FixedRowsOneRankBuffer() if fixed else OneRankBuffer()
    plan_capacity = tokens + 3 if fixed else tokens      # fixed rows: 3 stale ones past them
    expert_x, routing, handle = dispatcher.dispatch(x, ids, weights, plan_capacity, low_latency)
    assert dispatcher.shared.fixed_normal_rows() == fixed
    capacity = dispatcher.shared.ll_capacity
    if low_latency and dtype == torch.bfloat16:      # grouped by expert: [E, capacity, H]
        assert isinstance(routing, GroupedRows) and expert_x.shape == (num_experts, capacity,
                                                                       hidden)
    elif low_latency:                                # fixed shapes: E * capacity rows
        assert expert_x.shape == (num_experts * capacity, hidden)
    elif fixed and dtype == torch.bfloat16:          # the received tokens, ids -1 past them
        assert isinstance(routing, TopKRows) and expert_x.shape == (plan_capacity, hidden)
    elif fixed:                                      # one row per (token, slot)
        assert expert_x.shape == (plan_capacity * top_k, hidden)
        assert routing.shape == (plan_capacity * top_k,) and (routing[tokens * top_k:] == -1).all()
    assert expert_x.dtype == dtype
    out = dispatcher.combine(run_toy_experts(expert_x, routing), handle)
    pairs = toy_experts(x.repeat_interleave(top_k, 0), ids.reshape(-1)).view(tokens, top_k, -1)
    want = (pairs * weights[..., None]).sum(1)                  # AllToAllDispatcher.combine
    if dtype == torch.float32:
        assert out.equal(want)                                   # exact transport
    else:
        torch.testing.assert_close(out.float(), want.float(), atol=3e-2, rtol=2e-2)
    more = [torch.cat([t, t[:1]]) for t in (x, ids, weights)]
    with pytest.raises(ValueError, match="8 tokens on rank 0 at step 0, but the plan's capacity "
                                         "is 7 per rank"):
        dispatcher.dispatch(*more, tokens, low_latency)
    if low_latency:
        with pytest.raises(ValueError, match='the plan has 8 tokens per rank .rank 0., but the '
                                             'buffer holds 7 per rank'):
            dispatcher.dispatch(*more, tokens + 1, low_latency)
    else:                                            # normal mode has no per-rank limit
        dispatcher.dispatch(*more, tokens + 1, low_latency)


def test_low_latency_bf16_experts_run_masked_into_the_combine_buffer():
    """bf16 low-latency: FusedExperts.run takes DeepEP's [E, C, H] rows (a view of the receive
    buffer, NaN past the counts) with their counts and writes into the buffer combine sends; the
    result equals the experts on the tokens without EP."""
    num_experts, hidden, inter, top_k, tokens = 4, 64, 32, 2, 6
    gen = torch.Generator().manual_seed(5)
    experts = FusedExperts(hidden, inter, num_experts, torch.bfloat16, 'cpu')
    experts.gate_up_proj.copy_(torch.randn(num_experts, 2 * inter, hidden, generator=gen) / 8)
    experts.down_proj.copy_(torch.randn(num_experts, hidden, inter, generator=gen) / 6)
    x = torch.randn(tokens, hidden, generator=gen).bfloat16()
    ids = torch.stack([torch.randperm(num_experts - 1, generator=gen)[:top_k]
                       for _ in range(tokens)])                 # expert 3 gets no token
    weights = torch.rand(tokens, top_k, generator=gen).softmax(-1).bfloat16()
    ctx = ep_context(ep=1)
    dispatcher = deepep.DeepEPDispatcher(ctx, num_experts, hidden, top_k, torch.bfloat16,
                                         shared_buffer(ctx, num_experts, tokens))
    dispatcher.shared.buffer = OneRankBuffer()
    expert_x, routing, handle = dispatcher.dispatch(x, ids, weights, tokens, low_latency=True)
    assert isinstance(routing, GroupedRows) and routing.counts[3] == 0
    assert routing.out.shape == (num_experts, dispatcher.shared.ll_capacity,
                                 dispatcher.shared.width)
    expert_out = experts.run(expert_x, routing)
    assert expert_out.shape == expert_x.shape and expert_out.data_ptr() == routing.out.data_ptr()
    out = dispatcher.combine(expert_out, handle)
    torch.testing.assert_close(out.float(), experts(x, weights, ids).float(), atol=2e-2,
                               rtol=2e-2)


def test_each_call_has_its_mode_and_normal_kernels_dirty_the_low_latency_region():
    """No mode is stored: every dispatch runs in the mode it is given. The buffer remembers only
    whether normal kernels ran since its low-latency region was last cleaned: the next
    low-latency call (or `EPTransport.prepare` of a low-latency step, for graph replays) cleans it,
    once, on every rank alike (a traced collective)."""
    num_experts, hidden, top_k, tokens = 4, 64, 2, 3
    x = torch.randn(tokens, hidden)
    ids = torch.tensor([[0, 1], [2, 3], [1, 2]])
    weights = torch.full((tokens, top_k), 0.5)
    ctx = ep_context(ep=1)
    dispatcher = deepep.DeepEPDispatcher(ctx, num_experts, hidden, top_k, torch.float32,
                                         shared_buffer(ctx, num_experts, tokens))
    buffer = dispatcher.shared.buffer = OneRankBuffer()

    def cleans_after(low_latency: bool) -> int:
        dispatcher.dispatch(x, ids, weights, tokens, low_latency)
        return getattr(buffer, 'num_cleans', 0)
    assert [cleans_after(m) for m in (True, True, False, True, True)] == [1, 1, 1, 2, 2]
    cleans_after(False)
    transport = EPTransport(ctx, num_experts, hidden, top_k, tokens, 'cpu', torch.float32)
    transport.shared = dispatcher.shared
    transport.prepare(ForwardSizes(tokens, tokens, tokens, tokens, low_latency=True))
    assert buffer.num_cleans == 3 and cleans_after(True) == 3
    assert [op for op, *_ in ctx.trace].count('deepep_clean') == 3


# ---- two GPUs: DeepEP against all-to-all -----------------------------------------------------
def _two_gpu_skip_reason() -> str | None:
    import importlib.util
    if not torch.cuda.is_available():
        return 'needs CUDA'
    if torch.cuda.device_count() < 2:
        return f'needs 2 GPUs, this machine has {torch.cuda.device_count()}'
    if importlib.util.find_spec('deep_ep') is None:
        return 'deep_ep is not installed (see ../shared/reference/gpu.md)'
    return None


def _compare_worker(rank: int, init_method: str, results):
    """One rank: random tokens, the toy experts, DeepEP vs all-to-all, both modes, both
    dtypes; puts (rank, None) or (rank, traceback)."""
    try:
        torch.cuda.set_device(rank)
        device = torch.device('cuda', rank)
        ctx = DistContext.init(DistConfig(dp=2, ep=2), rank, init_method, device)
        num_experts, top_k = 8, 3
        shared = deepep.SharedBuffer(ctx.ep.gloo, num_experts, 32)    # one per group, as built
        for dtype, hidden in ((torch.bfloat16, 2048), (torch.bfloat16, 64), (torch.float32, 64)):
            reference = AllToAllDispatcher(ctx, num_experts)
            dispatcher = deepep.DeepEPDispatcher(ctx, num_experts, hidden, top_k, dtype, shared)
            gen = torch.Generator(device).manual_seed(rank)
            for low_latency, tokens in ((False, 50), (True, 32), (True, 5), (False, 1)):
                x = torch.randn(tokens, hidden, device=device, generator=gen).to(dtype)
                ids = torch.rand(tokens, num_experts, device=device,
                                 generator=gen).argsort(1)[:, :top_k]
                weights = torch.rand(tokens, top_k, device=device, generator=gen).to(dtype)
                results_of = []
                for d in (reference, dispatcher):
                    expert_x, routing, handle = d.dispatch(x, ids, weights, tokens, low_latency)
                    expert_out = run_toy_experts(expert_x, routing, d.first_expert)
                    results_of.append(d.combine(expert_out, handle))
                want, got = results_of
                if dtype == torch.float32:
                    assert got.equal(want), (hidden, low_latency, tokens)
                else:
                    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=2e-2)
        torch.cuda.synchronize()
        results.put((rank, None))
    except BaseException:
        results.put((rank, traceback.format_exc()))


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_deepep_matches_all_to_all_on_two_gpus(monkeypatch):
    reason = _two_gpu_skip_reason()
    if reason:
        pytest.skip(reason)
    import torch.multiprocessing as mp

    from lmdeploy_lite.pytorch.engine.executor.mp import free_port
    monkeypatch.setenv('LMDEPLOY_LITE_DIST_TIMEOUT', '60')
    ctx = mp.get_context('spawn')
    results = ctx.Queue()
    init_method = f'tcp://127.0.0.1:{free_port()}'
    procs = [ctx.Process(target=_compare_worker, args=(r, init_method, results), daemon=True)
             for r in range(2)]
    for p in procs:
        p.start()
    failures = {}
    try:
        for _ in procs:
            rank, error = results.get(timeout=240)
            failures[rank] = error
    except queue.Empty:
        pytest.fail(f'ranks {sorted(set(range(2)) - set(failures))} did not finish in 240 s '
                    f'(exit codes {[p.exitcode for p in procs]})')
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    errors = {r: e for r, e in failures.items() if e}
    assert not errors, '\n'.join(f'rank {r}:\n{e}' for r, e in errors.items())
