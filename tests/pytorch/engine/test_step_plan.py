"""StepPlan: one fixed-shape row per rank; every padded size derives from it."""
import torch

from lmdeploy_lite.messages import GenerationConfig
from lmdeploy_lite.pytorch.config import DistConfig
from lmdeploy_lite.pytorch.distributed import DistContext
from lmdeploy_lite.pytorch.engine.scheduler import ScheduledBatch
from lmdeploy_lite.pytorch.engine.sequence import Sequence
from lmdeploy_lite.pytorch.engine.step_plan import FIELDS, StepPlan


def batch(q_lens, decoding):
    seqs = [Sequence(i, [1] * 4, 4, GenerationConfig(), 0) for i in range(len(q_lens))]
    return ScheduledBatch(seqs, list(q_lens), decoding)


def test_row_is_fixed_shape_and_rounds_tokens_to_tp():
    assert StepPlan.local_row(batch([3, 4], False), tp=4, shutdown=False).tolist() == \
        [8, 2, 0, 1, 0, 0, 0, 0, 0]
    assert StepPlan.local_row(batch([1], True), tp=1, shutdown=False, sampled=True).tolist() == \
        [1, 1, 1, 1, 0, 1, 0, 0, 0]
    # a decode batch's tokens at the proposed draft count (its q_lens may be wider)
    assert StepPlan.local_row(batch([4, 4, 4], True), tp=2, shutdown=False,
                              num_spec=2).tolist() == [10, 3, 1, 1, 0, 0, 2, 0, 0]
    assert StepPlan.local_row(None, tp=2, shutdown=True).tolist() == [0, 0, 0, 0, 1, 0, 0, 0, 0]
    assert StepPlan.local_row(None, tp=1, shutdown=False).shape == (len(FIELDS),)
    assert StepPlan.local_row(None, tp=2, shutdown=False, num_events=5).tolist()[-1] == 5


def test_tp_peers_admit_the_fewest_events_any_of_them_has():
    """The plan spans the world (ep > 1, tp=2): ranks 2 and 3 form a TP group; each admits
    the events both have received, whatever ranks 0 and 1 have."""
    rows = torch.stack([StepPlan.local_row(None, 2, False, num_events=n) for n in (9, 9, 4, 6)])
    plan = StepPlan(rows, tp=2)
    assert plan.fewest_events((0, 1, 2, 3), (2, 3)) == 4
    assert plan.fewest_events((0, 1, 2, 3), (0, 1)) == 9
    assert StepPlan(rows[2:], tp=2).fewest_events((2, 3), (2, 3)) == 4


def test_sizes_are_functions_of_the_plan():
    rows = torch.stack([StepPlan.local_row(batch([4, 4], True), 2, False, num_spec=3),
                        StepPlan.local_row(None, 2, False)])
    plan = StepPlan(rows, tp=2)
    assert plan.any_work and plan.any_decoding and not plan.shutdown
    assert plan.max_tokens == 8 and plan.num_spec == 3
    assert plan.dummy_tokens_per_seq == 4       # idle rank mirrors a verify
    assert not plan.any_sampled            # a greedy step ships no draft distributions
    sampled = StepPlan(torch.stack([rows[0], StepPlan.local_row(batch([1], True), 2, False,
                                                                 sampled=True)]), tp=2)
    assert sampled.any_sampled             # one rank's sampled row: every rank sees it
    idle = StepPlan(torch.stack([StepPlan.local_row(None, 1, False)] * 2))
    assert not idle.any_work


def test_plan_agrees_on_the_smallest_mixed_budget():
    """Each working rank proposes the next step's mixed budget (0: none); the plan takes the
    smallest proposal, an idle rank's not counted."""
    rows = [StepPlan.local_row(batch([1, 1], True), 2, False, mixed_budget=budget)
            for budget in (96, 48, 0)] + [StepPlan.local_row(None, 2, False, mixed_budget=16)]
    assert StepPlan(torch.stack(rows), tp=2).mixed_budget == 48
    assert StepPlan(torch.stack(rows[2:]), tp=2).mixed_budget == 0


def test_single_process_gather_runs_no_collective():
    ctx = DistContext.single()
    plan = StepPlan.gather(batch([5], False), ctx)
    assert plan.rows.tolist() == [[5, 1, 0, 1, 0, 0, 0, 0, 0]] and ctx.trace == []


def test_the_plan_spans_the_ranks_that_share_collectives():
    """ep > 1: the world (MoE all-to-alls join every rank); ep = 1: the DP rank's own TP group,
    so pure-DP ranks plan and run independently."""
    def ctx(rank, **layout):
        return DistContext(DistConfig(**layout), rank)
    assert (ctx(1, dp=2, ep=2).plan.name, ctx(1, dp=2, ep=2).plan.ranks) == ('world', (0, 1))
    assert (ctx(1, dp=2).plan.name, ctx(1, dp=2).plan.ranks) == ('tp', (1,))
    assert ctx(3, tp=2, dp=2).plan.ranks == (2, 3)
    assert ctx(3, tp=2, dp=2, ep=4).plan.ranks == (0, 1, 2, 3)
    assert ctx(1, tp=2).plan.ranks == (0, 1)
