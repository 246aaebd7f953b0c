"""Every wait is bounded (DESIGN.md invariant 3): a collective a peer never joins, the host's
wait for a step's device results. Expiry names rank, step and operation.

Multi-process tests have a hard pytest timeout and assert they finished in time.
"""
import queue
import re
import time

import pytest
import torch

from lmdeploy_lite import GenerationConfig, PytorchEngineConfig
from lmdeploy_lite.pytorch.config import DistConfig
from lmdeploy_lite.pytorch.distributed import CollectiveTimeout, DistContext
from lmdeploy_lite.pytorch.engine.step_output import InFlight
from lmdeploy_lite.pytorch.engine.executor.mp import MPEngineLoop
from lmdeploy_lite.pytorch.engine.step_plan import FIELDS
from lmdeploy_lite.pytorch.model_agent import StepResult
from tests.helpers.broken import STALL_AT_STEP, rank1_stalls

BASE = dict(dtype='float32', device='cpu', block_size=4, session_len=128)


@pytest.mark.timeout(120)
def test_a_rank_that_stops_participating_times_out_naming_rank_step_and_op(tiny_ckpt,
                                                                            monkeypatch):
    """dp=2 ep=2 (the world shares collectives and plans together: a pure-DP rank would not
    wait for rank 1 at all). Rank 1 stays alive but never reaches step STALL_AT_STEP's plan
    gather. Rank 0's gather raises after LMDEPLOY_LITE_DIST_TIMEOUT (trace check off, as in
    production: with it on the comparison waits for the peers too), the loop's error is that one
    line, the request in flight gets it, and close() returns leaving no process."""
    timeout_s = 3       # steps 0..2 before the stall take milliseconds each on the tiny model
    monkeypatch.setenv('LMDEPLOY_LITE_DIST_TIMEOUT', str(timeout_s))
    monkeypatch.setenv('LMDEPLOY_LITE_CHECK_COLLECTIVES', '0')
    path = tiny_ckpt(True, layout='plain')
    begin = time.monotonic()
    loop = MPEngineLoop(path, PytorchEngineConfig(dp=2, ep=2, **BASE), worker_hook=rank1_stalls)
    procs = list(loop._procs)
    try:
        sink = queue.Queue()
        submitted = time.monotonic()
        loop.submit([5, 6, 7, 8], GenerationConfig(max_new_tokens=100, ignore_eos=True), sink.put)
        items = [sink.get(timeout=timeout_s + 20)]
        while not isinstance(items[-1], BaseException):
            items.append(sink.get(timeout=timeout_s + 20))
        failed = time.monotonic()
        assert items[-1] is loop.error
        assert sum(len(i.new_token_ids) for i in items[:-1]) < 100       # it was in flight
        message = str(loop.error)
        assert re.fullmatch(rf'CollectiveTimeout: rank 0, step {STALL_AT_STEP}: all_gather on '
                            rf'the world group \(shape \[{len(FIELDS)}\], int64\) timed out after '
                            rf'{timeout_s} s \(LMDEPLOY_LITE_DIST_TIMEOUT\)', message), message
        assert timeout_s * 0.9 < failed - submitted < timeout_s + 5
    finally:
        closing = time.monotonic()
        loop.close()
        assert time.monotonic() - closing < 10
        for p in procs:
            if p.is_alive():
                p.kill()
    assert not any(p.is_alive() for p in procs)
    assert time.monotonic() - begin < 100


class NeverDone:
    """A CUDA event whose work never completes (a peer that never joins a device collective)."""

    def query(self) -> bool:
        return False


def test_the_wait_for_a_steps_device_results_is_bounded(monkeypatch):
    monkeypatch.setenv('LMDEPLOY_LITE_DIST_TIMEOUT', '0.3')
    dist = DistContext(DistConfig(dp=2), rank=1, step=7)
    stuck = InFlight(None, None, None, StepResult(torch.zeros(1, 1, dtype=torch.long)),
                     NeverDone())
    start = time.monotonic()
    with pytest.raises(CollectiveTimeout, match=r'^rank 1, step 7: waiting for the step\'s '
                       r'results on the device .* timed out after 0.3 s'):
        stuck.host_result(dist)
    assert 0.3 <= time.monotonic() - start < 2


@pytest.mark.gpu
def test_the_wait_for_a_busy_gpu_is_bounded_and_a_done_one_is_not_slowed(monkeypatch):
    monkeypatch.setenv('LMDEPLOY_LITE_DIST_TIMEOUT', '0.5')
    tokens = torch.zeros(4, 2, dtype=torch.long, device='cuda')
    torch.cuda._sleep(3 * 10 ** 9)                  # ~1.5 s of GPU work ahead of the copy
    busy = InFlight.launch(None, None, StepResult(tokens, None))
    with pytest.raises(CollectiveTimeout, match='timed out after 0.5 s'):
        busy.host_result(DistContext.single())
    torch.cuda.synchronize()
    done = InFlight.launch(None, None, StepResult(tokens + 1, None))
    assert done.host_result().output_tokens.tolist() == [[1, 1]] * 4
