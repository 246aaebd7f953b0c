"""Four ranks on CPU processes (what the CPU allows of the four-GPU issue): dp=4 ep=4 and tp=2
dp=2 ep=4 with the MTP draft (k=3) of the embedded model (drafts mostly accepted:
tests/helpers/accepting), first ONE request (three ranks idle for the whole run, running dummy
target and draft forwards), then 64 concurrent requests; the acceptance exercised is asserted,
then float64 tokens equal plain greedy and the single process's speculative run, draft counts
included, with the per-step collective check on. Hard timeouts: a hang fails with a message."""
import time

import pytest

from lmdeploy_lite import GenerationConfig, PytorchEngineConfig, pipeline
from tests.helpers import accepting
from tests.helpers.accepting import assert_matches_reference

K = 3
GEN = GenerationConfig(max_new_tokens=8, ignore_eos=True)


@pytest.fixture(autouse=True)
def strict_collectives(monkeypatch):
    monkeypatch.setenv('LMDEPLOY_LITE_CHECK_COLLECTIVES', '1')
    monkeypatch.setenv('LMDEPLOY_LITE_DIST_TIMEOUT', '60')


@pytest.mark.timeout(600)
# tp2 dp2 ep4 at a fixed k is not a variant of its own: the dynamic run cycles through every
# k, sequence-parallel in its prefill and mixed steps (the draft sharded like the target), and
# tests/pytorch/test_sequence_parallel.py runs the layout at k = 3 with the draft at tp=1
@pytest.mark.parametrize('layout, dynamic', [(dict(dp=4, ep=4), False),
                                             (dict(tp=2, dp=2, ep=4, sequence_parallel=True),
                                              True)],
                         ids=['dp4_ep4', 'tp2_dp2_ep4_sp_dynamic'])
def test_four_ranks_one_request_then_64(layout, dynamic, monkeypatch):
    """`dynamic`: k per step from the cycle on each rank, the plan's smallest proposal run."""
    if dynamic:
        accepting.cycle_draft_counts(monkeypatch)
    prompts = accepting.many_prompts(64)
    one = accepting.prompts()[1:2]
    start = time.monotonic()
    config = PytorchEngineConfig(**layout, **accepting.BASE, max_batch_size=64)
    with pipeline(accepting.model_dir(), config, accepting.spec(K, dynamic=dynamic),
                  progress=False) as pipe:
        alone = pipe([list(p) for p in one], accepting.GREEDY)     # the other tests' request
        many = pipe([list(p) for p in prompts], GEN)
    assert time.monotonic() - start < 500
    assert_matches_reference(alone, K, one, dynamic=dynamic)
    assert_matches_reference(many, K, prompts, GEN, dynamic=dynamic)
    assert all(r.finish_reason == 'length' for r in many)
