"""CUDA graphs on several GPUs, on the embedded model (trained: its MTP drafts are accepted) in
float32 with MTP k=3 (dynamic k: every verify width and the plain step have graphs) and async
scheduling on, whole sequences:

  * two GPUs: tp=2 (plain, with the draft at tp=1, with sequence parallelism) replaying graphs
    with their TP collectives captured (prefill and mixed steps too, but under sequence
    parallelism) gives tp=2 eager's tokens exactly (a two-rank sum is
    one addition, so the bits cannot change); dp=2 ep=2 with DeepEP graphs (low-latency kernels
    captured) gives its eager run's tokens exactly, one request first (rank 1 idles on dummy
    forwards), then 16;
  * four GPUs: dp=4 ep=4 and tp=2 dp=2 ep=4 with the MTP draft (DeepEP where installed), one
    request then 16;
  * against one GPU, where the split reductions round differently, the share of identical
    sequences is printed and must be >= 90%.

Every run asserts first that drafts were accepted and that every rank replayed graphs. Hard
limits: pytest-timeout, and a short collective timeout so that a hang becomes an error.
"""
import importlib.util
import os
import time

import pytest
import torch

from lmdeploy_lite import GenerationConfig, PytorchEngineConfig, SpeculativeConfig
from lmdeploy_lite.api import EMBEDDED_MODEL_DIR
from lmdeploy_lite.pytorch.engine.build import build_engine
from lmdeploy_lite.pytorch.engine.executor.mp import MPEngineLoop
from lmdeploy_lite.tokenizer import load_tokenizer
from tests.helpers.broken import run_requests

pytestmark = pytest.mark.gpu

BASE = dict(device='cuda', dtype='float32', block_size=16, session_len=512, max_batch_size=16,
            async_scheduling=True, enable_prefix_caching=False)
GEN = GenerationConfig(max_new_tokens=64, ignore_eos=True)
SPEC = SpeculativeConfig(num_speculative_tokens=3, dynamic=True)
TEXTS = ['def fibonacci(n):', 'import os\n\n\ndef main(', 'class Stack:\n    def __init__(self',
         'for i in range(10):', 'def parse_args(argv', 'with open(path) as f:',
         'import json\n\ndata = json.', 'def merge_sort(items', 'try:\n    import numpy',
         'class Node:\n    def __init__(self, value', 'def read_config(path):',
         'if __name__ == "__main__":', 'def is_prime(n):', 'import sys\n\ndef usage(',
         'def flatten(nested):', 'async def fetch(session, url']
REPLAY_LOG = 'LMDEPLOY_LITE_TEST_REPLAY_LOG'


def _skip(gpus: int, deepep: bool = False) -> None:
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count < gpus:
        pytest.skip(f'needs {gpus} GPUs, this machine has {count}')
    if deepep and importlib.util.find_spec('deep_ep') is None:
        pytest.skip('deep_ep is not installed (../shared/reference/gpu.md: the DeepEP V1 wheel)')


@pytest.fixture(scope='module')
def prompts() -> list[list[int]]:
    tokenizer = load_tokenizer(EMBEDDED_MODEL_DIR)
    return [tokenizer.encode(t) for t in TEXTS]


@pytest.fixture(scope='module')
def one_gpu(prompts):
    """The single-GPU tokens (graphs on) of the first prompt alone, then of all of them (None
    where every test of this file skips: fewer than two GPUs)."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        return None
    engine = build_engine(EMBEDDED_MODEL_DIR, PytorchEngineConfig(**BASE), SPEC, progress=False)
    one = engine.generate(prompts[:1], GEN)[0].generated_ids
    many = [s.generated_ids for s in engine.generate(prompts, GEN)]
    assert engine.spec_stats.num_accepted_tokens > 0
    del engine
    torch.cuda.empty_cache()
    return [one] + many


def log_replays(engine):             # worker hook (top-level: pickled by reference)
    """Every graph replay of this rank (decode and prefill) is logged to $REPLAY_LOG.<rank>."""
    from lmdeploy_lite.pytorch.backends.cuda.graph_runner import GraphRunner, PrefillGraphRunner
    if not engine.engine_config.eager_mode and engine.device.type == 'cuda':
        assert engine.agent.target.graphs, f'rank {engine.dist.rank}: no graphs captured'
    path, rank = os.environ[REPLAY_LOG], engine.dist.rank

    def count(cls):
        call = cls.__call__

        def counted(self, inputs, *extras):
            with open(f'{path}.{rank}', 'a') as f:
                f.write(f'{self.name}\n')
            return call(self, inputs, *extras)
        cls.__call__ = counted
    count(GraphRunner)
    count(PrefillGraphRunner)


def run_layout(prompts, config: PytorchEngineConfig, spec: SpeculativeConfig, tmp_path,
               tag: str) -> tuple[list[list[int]], list[int]]:
    """(tokens of prompt 0 alone then of all prompts, graph replays per rank, prefill graphs'
    included); the ranks log their replays where $REPLAY_LOG says (set by the
    `short_timeouts` fixture's test)."""
    os.environ[REPLAY_LOG] = str(tmp_path / f'{tag}.replays')     # restored by the fixture
    loop = MPEngineLoop(EMBEDDED_MODEL_DIR, config, spec, worker_hook=log_replays)
    try:
        first = run_requests(loop, prompts[:1], GEN, timeout_s=300)
        rest = run_requests(loop, prompts, GEN, timeout_s=300)
    finally:
        loop.close()
    done = first + rest
    assert all(r.finish_reason == 'length' for r in done)
    accepted = sum(r.spec_stats.num_accepted_tokens for r in done if r.spec_stats)
    assert accepted > 0, f'{tag}: no draft was accepted'
    return [r.token_ids for r in done], replay_counts(tmp_path, tag, config.tp * config.dp)


def replay_counts(tmp_path, tag: str, ranks: int, name: str | None = None) -> list[int]:
    """Graph replays per rank of a `run_layout` run (of the graphs called `name`: all)."""
    counts = []
    for rank in range(ranks):
        log = tmp_path / f'{tag}.replays.{rank}'
        lines = log.read_text().splitlines() if log.exists() else []
        counts.append(sum(name is None or line == name for line in lines))
    return counts


def report_against_one_gpu(tag: str, got: list[list[int]], want: list[list[int]]):
    same = sum(g == w for g, w in zip(got, want, strict=True))
    print(f'{tag} vs one GPU (float32): {same}/{len(want)} sequences identical')
    assert same >= 0.9 * len(want), f'{tag}: only {same}/{len(want)} sequences match one GPU'


@pytest.fixture
def short_timeouts(monkeypatch):
    monkeypatch.setenv('LMDEPLOY_LITE_CHECK_COLLECTIVES', '1')
    monkeypatch.setenv('LMDEPLOY_LITE_DIST_TIMEOUT', '60')
    monkeypatch.setenv(REPLAY_LOG, '')          # run_layout sets it; undone after the test


VARIANTS = {
    'tp2': (dict(tp=2), SPEC),
    'tp2_draft_tp1': (dict(tp=2), SpeculativeConfig(num_speculative_tokens=3, dynamic=True,
                                                    tp=1)),
    'tp2_sequence_parallel': (dict(tp=2, sequence_parallel=True), SPEC),
}


@pytest.mark.timeout(600)
@pytest.mark.parametrize('variant', list(VARIANTS))
def test_tp2_graphs_equal_tp2_eager(variant, prompts, one_gpu, tmp_path, short_timeouts):
    _skip(2)
    layout, spec = VARIANTS[variant]
    start = time.monotonic()
    eager, eager_replays = run_layout(prompts, PytorchEngineConfig(**BASE, **layout,
                                                                   eager_mode=True),
                                      spec, tmp_path, f'{variant}_eager')
    graphs, replays = run_layout(prompts, PytorchEngineConfig(**BASE, **layout), spec,
                                 tmp_path, f'{variant}_graphs')
    assert eager_replays == [0, 0]
    assert all(replays), f'{variant}: graph replays per rank {replays}'
    prefill = replay_counts(tmp_path, f'{variant}_graphs', 2, 'target prefill')
    if not layout.get('sequence_parallel'):     # (sequence parallel prefills run eagerly)
        assert all(prefill), f'{variant}: prefill graph replays per rank {prefill}'
    print(f'{variant}: graph replays per rank {replays} (prefill {prefill}), '
          f'{time.monotonic() - start:.0f} s')
    mismatch = [i for i, (g, e) in enumerate(zip(graphs, eager, strict=True)) if g != e]
    assert not mismatch, f'{variant}: graphs differ from eager in sequences {mismatch}'
    report_against_one_gpu(variant, graphs, one_gpu)


@pytest.mark.timeout(600)
def test_dp2_ep2_deepep_graphs_equal_eager(prompts, one_gpu, tmp_path, short_timeouts,
                                           monkeypatch):
    _skip(2, deepep=True)
    monkeypatch.setenv('LMDEPLOY_LITE_EP_DISPATCHER', 'deepep')
    layout = dict(dp=2, ep=2)
    eager, _ = run_layout(prompts, PytorchEngineConfig(**BASE, **layout, eager_mode=True), SPEC,
                          tmp_path, 'dp2ep2_eager')
    graphs, replays = run_layout(prompts, PytorchEngineConfig(**BASE, **layout), SPEC,
                                 tmp_path, 'dp2ep2_graphs')
    assert all(replays), f'dp2 ep2: graph replays per rank {replays}'
    print(f'dp2 ep2 DeepEP: graph replays per rank {replays}')
    mismatch = [i for i, (g, e) in enumerate(zip(graphs, eager, strict=True)) if g != e]
    assert not mismatch, f'dp2 ep2: DeepEP graphs differ from eager in sequences {mismatch}'
    report_against_one_gpu('dp2 ep2 DeepEP graphs', graphs, one_gpu)


@pytest.mark.timeout(600)
@pytest.mark.parametrize('layout', [dict(dp=4, ep=4), dict(tp=2, dp=2, ep=4)],
                         ids=['dp4_ep4', 'tp2_dp2_ep4'])
def test_four_gpus_with_the_mtp_draft(layout, prompts, one_gpu, tmp_path, short_timeouts):
    _skip(4)
    deepep = importlib.util.find_spec('deep_ep') is not None
    tag = '_'.join(f'{k}{v}' for k, v in layout.items())
    got, replays = run_layout(prompts, PytorchEngineConfig(**BASE, **layout), SPEC, tmp_path, tag)
    print(f'{tag} ({"DeepEP" if deepep else "all-to-all, eager"}): graph replays per rank '
          f'{replays}')
    if deepep:
        assert all(replays), f'{tag}: graph replays per rank {replays}'
    report_against_one_gpu(tag, got, one_gpu)
