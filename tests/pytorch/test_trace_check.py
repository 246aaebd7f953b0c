"""The collective trace check names the bug class of vllm-ascend #9689 before gloo sees it.

Its proposer and its runner posted DP metadata gathers of different shapes on one group ("8 vs
4"): gloo aborts the process when such a gather runs, so a comparison at the end of the step
comes too late. With LMDEPLOY_LITE_CHECK_COLLECTIVES=1 every collective across DP ranks is
compared before it runs (distributed.py `traced`), shapes included.
"""
from __future__ import annotations

import time

import pytest

from lmdeploy_lite.messages import GenerationConfig, PytorchEngineConfig
from lmdeploy_lite.pytorch.engine.executor.mp import MPEngineLoop
from tests.helpers.broken import metadata_gather_per_rank_shape, run_requests


@pytest.mark.timeout(120)
def test_dp_metadata_gathers_of_different_shapes_are_named_before_they_run(tiny_ckpt,
                                                                            monkeypatch):
    """dp=2 ep=2, one request (rank 1 idle): both ranks post the extra gather, [8] and [4]; the
    step fails within seconds naming the all_gather and both shapes, not a killed rank."""
    monkeypatch.setenv('LMDEPLOY_LITE_CHECK_COLLECTIVES', '1')
    monkeypatch.setenv('LMDEPLOY_LITE_DIST_TIMEOUT', '60')
    config = PytorchEngineConfig(dtype='float64', device='cpu', block_size=4, session_len=64,
                                 dp=2, ep=2)
    loop = MPEngineLoop(tiny_ckpt(True), config, worker_hook=metadata_gather_per_rank_shape)
    try:
        start = time.monotonic()
        with pytest.raises(RuntimeError) as failure:
            run_requests(loop, [[5, 6, 7, 8, 9]], GenerationConfig(max_new_tokens=4,
                                                                    ignore_eos=True), 90)
        message = str(failure.value)
        assert time.monotonic() - start < 30, message      # not the 60 s collective timeout
        assert 'collective sequences differ' in message, message
        assert "('all_gather', 'world', (8,), 'int64')" in message, message
        assert "('all_gather', 'world', (4,), 'int64')" in message, message
    finally:
        loop.close()
