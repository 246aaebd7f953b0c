"""dp=2 ep=2 on two GPUs (the mp executor: rank r on cuda:r, device collectives on NCCL) with the
MTP draft and ONE request, so that rank 1 idles through the whole run and only runs dummy
target and draft forwards: it must complete with the single-GPU tokens (float32), with the
all-to-all dispatcher and, where `deep_ep` is installed, with DeepEP (LMDEPLOY_LITE_EP_DISPATCHER
picks; a worker hook, passed to MPEngineLoop, checks which one each rank built and that it sits
on its own GPU).

Hard limits: pytest-timeout, and a short collective timeout so that a hang becomes an error.
"""
import importlib.util
import time

import pytest
import torch

from lmdeploy_lite import GenerationConfig, PytorchEngineConfig, SpeculativeConfig
from lmdeploy_lite.pytorch.engine.build import build_engine
from lmdeploy_lite.pytorch.engine.executor.mp import MPEngineLoop
from tests.helpers.broken import run_requests

pytestmark = pytest.mark.gpu

BASE = dict(device='cuda', dtype='float32', block_size=16, session_len=256, max_batch_size=8,
            eager_mode=True)
PROMPT = list(range(20, 49))
GEN = GenerationConfig(max_new_tokens=32, ignore_eos=True)
SPEC = SpeculativeConfig(num_speculative_tokens=3)


def _skip_reason(dispatcher: str) -> str | None:
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count < 2:
        return f'needs 2 GPUs, this machine has {count}'
    if dispatcher == 'deepep' and importlib.util.find_spec('deep_ep') is None:
        return 'deep_ep is not installed (see ../shared/reference/gpu.md: the DeepEP V1 wheel)'
    return None


def _check_rank(engine, deepep: bool):
    rank, device = engine.dist.rank, torch.cuda.current_device()
    assert device == rank, f'rank {rank} is on cuda:{device}'
    assert engine.dist.ep.nccl is not None, 'no NCCL group for EP'
    built = engine.ep.deep_ep
    assert built == deepep, f'rank {rank}: DeepEP dispatchers built: {built}, wanted {deepep}'


def check_deepep(engine):              # worker hooks (top-level: pickled by reference)
    _check_rank(engine, True)


def check_alltoall(engine):
    _check_rank(engine, False)


@pytest.fixture(scope='module')
def single_gpu_tokens(tiny_ckpt):
    path = tiny_ckpt(True, layout='plain')
    if torch.cuda.device_count() < 2:
        return path, None
    engine = build_engine(path, PytorchEngineConfig(**BASE), SPEC, progress=False)
    tokens = engine.generate([PROMPT], GEN)[0].generated_ids
    del engine
    torch.cuda.empty_cache()
    return path, tokens


@pytest.mark.timeout(480)
@pytest.mark.parametrize('dispatcher', ['alltoall', 'deepep'])
def test_dp2_ep2_one_request_gives_single_gpu_tokens(dispatcher, single_gpu_tokens, monkeypatch):
    reason = _skip_reason(dispatcher)
    if reason:
        pytest.skip(reason)
    path, want = single_gpu_tokens
    monkeypatch.setenv('LMDEPLOY_LITE_EP_DISPATCHER', dispatcher)
    monkeypatch.setenv('LMDEPLOY_LITE_CHECK_COLLECTIVES', '1')
    monkeypatch.setenv('LMDEPLOY_LITE_DIST_TIMEOUT', '60')
    start = time.monotonic()
    hook = {'alltoall': check_alltoall, 'deepep': check_deepep}[dispatcher]
    loop = MPEngineLoop(path, PytorchEngineConfig(dp=2, ep=2, **BASE), SPEC, worker_hook=hook)
    try:
        response = run_requests(loop, [PROMPT], GEN, timeout_s=300)[0]
    finally:
        loop.close()
    assert response.finish_reason == 'length'
    assert len(response.token_ids) == GEN.max_new_tokens
    assert response.token_ids == want, (
        f'{dispatcher}: first difference at token '
        f'{next(i for i, (a, b) in enumerate(zip(response.token_ids, want)) if a != b)}')
    assert time.monotonic() - start < 420


# ---- CUDA graphs with EP: DeepEP's low-latency kernels inside the captured decode steps ------
PROMPTS = [PROMPT] + [list(range(3 + i, 40 + 3 * i)) for i in range(7)]
REPLAY_LOG = 'LMDEPLOY_LITE_TEST_REPLAY_LOG'


def check_deepep_graphs(engine):      # worker hook: graphs captured; log every replay to a file
    import os

    from lmdeploy_lite.pytorch.backends.cuda.graph_runner import GraphRunner
    _check_rank(engine, True)
    runners = [engine.agent.target.graph, *engine.agent.proposer.graphs.values()]
    assert all(r is not None and r.graphs for r in runners), 'decode graphs were not captured'
    path, rank = os.environ[REPLAY_LOG], engine.dist.rank
    call = GraphRunner.__call__

    def counted(self, inputs, *extras):
        with open(f'{path}.{rank}', 'a') as f:
            f.write(f'{self.name}\n')          # called only when a graph fits: a replay
        return call(self, inputs, *extras)
    GraphRunner.__call__ = counted


@pytest.mark.timeout(560)
@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
def test_dp2_ep2_deepep_cuda_graphs(dtype, tiny_ckpt, tmp_path, monkeypatch):
    """dp=2 ep=2 with DeepEP and CUDA graphs (decode steps replay with DeepEP's low-latency
    dispatch/combine captured): one request (rank 1 idles on dummy inputs, replaying too), then
    8 requests. float32: the single-GPU tokens exactly; bf16: completes, match rate reported.
    Both ranks must have replayed graphs, with the collective trace check on."""
    reason = _skip_reason('deepep')
    if reason:
        pytest.skip(reason)
    path = tiny_ckpt(True, layout='plain')
    base = dict(BASE, dtype=dtype)
    engine = build_engine(path, PytorchEngineConfig(**base), SPEC, progress=False)
    want_one = engine.generate([PROMPT], GEN)[0].generated_ids
    want_all = [s.generated_ids for s in engine.generate(PROMPTS, GEN)]
    del engine
    torch.cuda.empty_cache()
    monkeypatch.setenv('LMDEPLOY_LITE_EP_DISPATCHER', 'deepep')
    monkeypatch.setenv(REPLAY_LOG, str(tmp_path / 'replays'))
    monkeypatch.setenv('LMDEPLOY_LITE_CHECK_COLLECTIVES', '1')
    monkeypatch.setenv('LMDEPLOY_LITE_DIST_TIMEOUT', '60')
    start = time.monotonic()
    config = PytorchEngineConfig(dp=2, ep=2, **dict(base, eager_mode=False))
    loop = MPEngineLoop(path, config, SPEC, worker_hook=check_deepep_graphs)
    try:
        one = run_requests(loop, [PROMPT], GEN, timeout_s=300)[0].token_ids
        many = [r.token_ids for r in run_requests(loop, PROMPTS, GEN, timeout_s=300)]
    finally:
        loop.close()
    assert time.monotonic() - start < 500
    assert len(one) == GEN.max_new_tokens and all(len(t) == GEN.max_new_tokens for t in many)
    for rank in (0, 1):
        log = tmp_path / f'replays.{rank}'
        replays = log.read_text().splitlines() if log.exists() else []
        assert replays, f'rank {rank} never replayed a graph'
        print(f'rank {rank}: {len(replays)} graph replays')
    got, want = [one] + many, [want_one] + want_all
    if dtype == 'float32':
        assert got == want
    else:
        agreeing = sum(next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), len(w))
                       for g, w in zip(got, want, strict=True))
        print(f'bf16 dp=2 ep=2 DeepEP graphs vs one GPU: '
              f'{agreeing / (len(want) * GEN.max_new_tokens):.1%} of tokens before the first '
              f'divergence, {sum(g == w for g, w in zip(got, want))}/{len(want)} identical')
