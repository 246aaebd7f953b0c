"""The mixed-step budget from measured step times (engine/mixed_budget.py,
PytorchEngineConfig.max_mixed_step_cost): on synthetic clocks it settles on the largest chunk rung
that keeps a chunk step within `cost` decode steps, across a CUDA-graph-like cliff too; in the
engine it changes no token (float64, one process and tp=2 ranks, whose schedules must agree
through the StepPlan or the per-step collective check fails)."""
import time

import pytest

from lmdeploy_lite import GenerationConfig, PytorchEngineConfig, pipeline
from lmdeploy_lite.pytorch.engine.mixed_budget import MixedBudget
from tests.helpers import accepting
from tests.helpers.accepting import reference


def _settle(policy: MixedBudget, decoding: int, decode_s: float, chunk_s, steps: int = 30):
    """Run `steps` rounds of (two decode steps, one chunk step of the proposed budget, the prompt
    always longer than it); returns the budgets proposed."""
    budgets = []
    for _ in range(steps):
        policy.observe_decode(decoding, decode_s)
        policy.observe_decode(decoding, decode_s)
        budget = policy.propose(decoding)
        budgets.append(budget)
        policy.observe_chunk(decoding, budget, chunk_s(budget - decoding))
    return budgets


def test_budget_before_any_decode_step_is_measured():
    """Nothing decodes: the ceiling (a plain prefill step). Decoding but no like pair of decode
    steps yet: the smallest rung over the decode rows first (64 tokens for 32 rows), then its
    step stands in for a decode step's time (as when prompts keep arriving)."""
    policy = MixedBudget(2.0, ceiling=4096)
    assert policy.propose(0) == 4096
    policy.observe_decode(32, 0.003)              # one decode step: not yet a like pair
    assert policy.propose(32) == 64
    policy.observe_chunk(32, 64, 0.004)           # a 64-token step: 32 rows + 32 prompt tokens
    assert policy.propose(32) == 128               # 128 unmeasured: tried
    policy.observe_chunk(32, 128, 0.0085)          # > 2 x the 64-token step
    assert policy.propose(32) == 64
    policy.observe_decode(32, 0.003)
    policy.observe_decode(32, 0.003)               # now measured: 2 x 3 ms < 1.25 x 4 ms
    assert policy.propose(32) == 64


def test_budget_settles_on_the_largest_rung_within_the_cost():
    """A chunk step costs the decode step plus 10 us a prompt token: within 2x up to 300 of
    them, so the step settles at 256 tokens (rungs of the step's tokens, decode rows included,
    tried once each on the way up, 512 measured over)."""
    budgets = _settle(MixedBudget(2.0, ceiling=4096), 32, 0.003, lambda n: 0.003 + 1e-5 * n)
    assert budgets[:4] == [64, 128, 256, 512]
    assert budgets[-10:] == [256] * 10


def test_budget_rungs_are_the_captured_token_counts():
    """A step's tokens are rounded up to a prefill graph's bucket: 40 decode rows take chunks
    that fill 64, 128, .. 512, then 768 tokens, not 40 + a power of two (which pads to the next
    bucket); a measured chunk counts toward the bucket its whole step filled."""
    from lmdeploy_lite.pytorch.backends.cuda.graph_runner import prefill_buckets
    policy = MixedBudget(4.0, ceiling=8192)
    budgets = _settle(policy, 40, 0.003, lambda n: 0.003 + 1e-6 * n, steps=8)
    assert budgets == [64, 128, 256, 512, 768, 1024, 1536, 2048]
    assert set(budgets) <= set(prefill_buckets(8192))
    assert {rung for _, rung in policy.chunk} == set(budgets)


def test_budget_stays_below_a_cliff_and_within_the_ceiling():
    """Steps that fit a captured bucket (<= 512 tokens here) cost 2 ms over the decode step,
    longer ones 40 ms: the budget stays under the cliff; a lower ceiling caps it."""
    def graph_cliff(n):
        return 0.005 if 32 + n <= 512 else 0.043
    assert _settle(MixedBudget(2.0, ceiling=4096), 32, 0.003, graph_cliff)[-5:] == [512] * 5
    assert _settle(MixedBudget(3.0, ceiling=100), 32, 0.003, graph_cliff)[-5:] == [100] * 5
    # a flat cost (a CPU's prefill-mode step: 2.5 decode steps whatever the chunk): chunks
    # grow while their steps stay within 1.25x the smallest chunk's, instead of pinning there
    flat = _settle(MixedBudget(2.0, ceiling=4096), 8, 0.012, lambda n: 0.030 + 2e-5 * n)
    assert flat[-5:] == [256] * 5
    # buckets apart: a batch of 8 starts from the smallest rung, measuring its own times
    policy = MixedBudget(2.0, ceiling=4096)
    _settle(policy, 32, 0.003, graph_cliff)
    assert policy.propose(8) == 16


@pytest.mark.parametrize('k', [0, 3])
def test_adaptive_budget_changes_no_token(k):
    """Prompts arriving while others decode, one process: the budget follows the CPU's clock
    (so it varies run to run), the tokens do not."""
    from tests.pytorch.engine.test_mixed_steps import CFG, _prompts, _run
    seqs, scheduled, _ = _run(k, max_prefill_token_num=64, max_mixed_token_num=48,
                              max_mixed_step_cost=2.0)
    policy = _run.engine.scheduler.mixed_budget
    assert policy.decode and policy.chunk, (policy.decode, policy.chunk)
    assert [s.generated_ids for s in seqs] == reference(0, _prompts(), **CFG).token_ids


@pytest.mark.timeout(300)
def test_tp_ranks_agree_on_the_adaptive_budget(monkeypatch):
    """tp=2 processes, each with its own clock: the plan's smallest proposal is every rank's
    budget (a rank scheduling on its own would break the collective check or hang). Long
    prompts, prefilled in chunks, ride with the short ones' decode steps; with async
    scheduling, so mixed steps are also continued before their results (every rank alike)."""
    monkeypatch.setenv('LMDEPLOY_LITE_CHECK_COLLECTIVES', '1')
    monkeypatch.setenv('LMDEPLOY_LITE_DIST_TIMEOUT', '60')
    short = [list(p) for p in accepting.prompts()]
    prompts = short + [short[0] * 8 + short[1] * 4, short[2] * 6]
    gen = GenerationConfig(max_new_tokens=24, ignore_eos=True)
    config = PytorchEngineConfig(**accepting.BASE, tp=2, max_prefill_token_num=64,
                                 max_mixed_token_num=48, max_mixed_step_cost=2.0,
                                 async_scheduling=True)
    start = time.monotonic()
    with pipeline(accepting.model_dir(), config, progress=False) as pipe:
        got = pipe(prompts, gen)
    assert time.monotonic() - start < 240
    assert [list(r.token_ids) for r in got] == reference(0, prompts, gen).token_ids
