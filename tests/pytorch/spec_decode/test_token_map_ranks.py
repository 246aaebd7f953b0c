"""A reduced draft vocabulary across ranks (gloo, CPU): the sharded reduced LM head against the
full one at TP=2, and greedy output with a token map equal to plain greedy output at tp=2 and at
dp=2 ep=2 with an idle rank (embedded model, float64, the frequency map of tests/helpers/
token_maps.py). Each engine test asserts the acceptance it exercised first, then compares whole
sequences with plain greedy and per-request draft counts with the single process's run with the
same map. Hard timeouts; the collective trace check is on; the engine's collective timeout is
short, so a hang fails with a message.
"""
import time

import pytest
import torch

from lmdeploy_lite import PytorchEngineConfig
from lmdeploy_lite.pytorch.engine.executor.mp import MPEngineLoop
from tests.helpers import accepting, token_maps
from tests.helpers.accepting import assert_real_acceptance, counts
from tests.helpers.broken import run_requests
from tests.helpers.forward_counts import FORWARD_COUNT_DIR, count_forwards, read_counts


@pytest.fixture(autouse=True)
def strict_collectives(monkeypatch):
    monkeypatch.setenv('LMDEPLOY_LITE_CHECK_COLLECTIVES', '1')     # always on in tests
    monkeypatch.setenv('LMDEPLOY_LITE_DIST_TIMEOUT', '20')


def _map_reference(k):
    return token_maps.reference(k, token_maps.frequency_map())


@pytest.mark.timeout(300)
def test_tp2_sharded_reduced_head_and_greedy_output(tmp_path):
    """tp=2: each rank's reduced head holds only the map ids of its vocab shard (padded to the
    same count), never the full head, and gives the full head's logits at the map ids: exactly
    with integer weights, untied and tied, for a map spread over both shards, one with every id
    in rank 0's shard and one with a single id in the short last shard (token_maps.
    check_reduced_heads, run on each rank). Then greedy output with the map equals plain."""
    k, start = 3, time.monotonic()
    loop = MPEngineLoop(accepting.model_dir(), PytorchEngineConfig(tp=2, **accepting.BASE),
                        token_maps.spec(k, token_maps.frequency_map()),
                        env={token_maps.REDUCED_HEAD_DIR: str(tmp_path)},
                        worker_hook=token_maps.check_reduced_heads)
    try:
        responses = run_requests(loop, [list(p) for p in accepting.prompts()], accepting.GREEDY)
    finally:
        loop.close()
    assert time.monotonic() - start < 240
    maps, tp = token_maps.head_maps(), 2
    for rank in range(tp):
        result = torch.load(tmp_path / f'rank{rank}.pt')
        rows, shard, size = result.pop('engine_rows')
        assert rows < shard and rows < size and result.pop('engine_rows_copied'), (rank, rows)
        assert result.pop('engine_logits_error') < 1e-12
        for (tied, name), (equal, full_ok, rows, shard) in result.items():
            head_map = maps[name]
            assert full_ok and equal, (rank, tied, name)
            assert rows == max(int((head_map // shard == r).sum()) for r in range(tp))
    assert_real_acceptance([r.spec_stats for r in responses], k)
    assert [r.token_ids for r in responses] == accepting.reference(0).token_ids
    assert [counts(r.spec_stats) for r in responses] == _map_reference(k)[1]


@pytest.mark.timeout(300)
def test_dp2_ep2_with_an_idle_rank_then_a_batch(tmp_path):
    """One request alone (the other DP rank idles, running a dummy target and draft forward
    for each of the busy rank's: its draft ends in the reduced head too), then a batch over
    both ranks, in one engine."""
    k, start = 3, time.monotonic()
    one = accepting.prompts()[1:2]
    loop = MPEngineLoop(accepting.model_dir(), PytorchEngineConfig(dp=2, ep=2, **accepting.BASE),
                        token_maps.spec(k, token_maps.frequency_map()),
                        env={FORWARD_COUNT_DIR: str(tmp_path)}, worker_hook=count_forwards)
    try:
        alone = run_requests(loop, [list(p) for p in one], accepting.GREEDY)
        counts_alone = read_counts(tmp_path, 2)
        batch = run_requests(loop, [list(p) for p in accepting.prompts()], accepting.GREEDY)
    finally:
        loop.close()
    assert time.monotonic() - start < 240
    assert_real_acceptance([r.spec_stats for r in batch], k)
    assert alone[0].spec_stats.num_accepted_tokens > 0
    busy = alone[0].dp_rank
    assert min(counts_alone[busy]) > 0 and counts_alone[1 - busy] == counts_alone[busy]
    assert sorted(r.dp_rank for r in batch) == [0, 0, 1, 1]
    assert [r.token_ids for r in alone] == accepting.reference(0, one).token_ids
    assert [r.token_ids for r in batch] == accepting.reference(0).token_ids
    assert [counts(r.spec_stats) for r in alone] == token_maps.reference(
        k, token_maps.frequency_map(), one)[1]
    assert [counts(r.spec_stats) for r in batch] == _map_reference(k)[1]
