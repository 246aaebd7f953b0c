"""Deliberately broken engines for the multi-process tests, and a driver for engine loops.

A worker hook is a top-level function called with each rank's Engine before it serves; tests
pass it to MPEngineLoop / RayEngineLoop (`worker_hook=`), which pickle it by reference into every
rank. Production code has no way to set one (no environment variable, no config field).
"""
import queue
import time
from dataclasses import dataclass

import torch


def skip_dummy_draft(engine):
    """An idle rank skips its dummy draft forwards: the bug class of vLLM #35248."""
    proposer = engine.agent.proposer
    real = proposer.propose

    def propose(inputs, hidden, next_ids, rows, sampling, num_drafts=None, use_graphs=True):
        if inputs.is_dummy:
            k = proposer.num_spec_tokens if num_drafts is None else num_drafts
            return torch.zeros(rows.numel(), k, dtype=torch.long), None
        return real(inputs, hidden, next_ids, rows, sampling, num_drafts, use_graphs)
    proposer.propose = propose


STALL_AT_STEP = 3


def rank1_stalls(engine):
    """Rank 1 stops participating: from step STALL_AT_STEP on it never reaches the next plan
    gather (alive, in no collective), so its peers' gather can only time out."""
    if engine.dist.rank != 1:
        return
    real = engine.step

    def step():
        if engine.num_steps >= STALL_AT_STEP:
            while True:
                time.sleep(1)
        return real()
    engine.step = step


SLOW_STEP_S = 0.1


def rank0_steps_slowly(engine):
    """Rank 0 sleeps SLOW_STEP_S in every step with work: a request on it reports for a while,
    one message every SLOW_STEP_S, so the front-end's queue is never quiet meanwhile."""
    if engine.dist.rank != 0:
        return
    real = engine.step

    def step():
        if engine.has_work:
            time.sleep(SLOW_STEP_S)
        return real()
    engine.step = step


@dataclass
class Finished:
    token_ids: list[int]
    finish_reason: str | None
    spec_stats: object = None       # the last report's SpecDecodeStats (None: no draft)
    dp_rank: int | None = None      # the DP rank the front-end routed the request to


def run_requests(loop, prompts: list[list[int]], gen_config, timeout_s: float = 120
                 ) -> list[Finished]:
    """Submit every prompt to an engine loop and wait for all to finish (at most `timeout_s`);
    raises the first error a request's sink receives."""
    results: queue.Queue = queue.Queue()
    handles = [loop.submit(prompt, gen_config, lambda item, i=i: results.put((i, item)))
               for i, prompt in enumerate(prompts)]
    done = [Finished([], None) for _ in prompts]
    remaining, deadline = len(prompts), time.monotonic() + timeout_s
    while remaining:
        i, item = results.get(timeout=max(0.0, deadline - time.monotonic()))
        if isinstance(item, BaseException):
            raise item
        done[i].token_ids += item.new_token_ids
        done[i].spec_stats, done[i].dp_rank = item.spec_stats, handles[i].dp_rank
        if item.finished:
            done[i].finish_reason = item.finish_reason
            remaining -= 1
    return done


def second_metadata_gather(engine):
    """A rank with work posts a second DP metadata gather at the end of its step's forward, of
    another shape than the StepPlan's ([8] int64, where the plan's row is [7]), as
    vllm-ascend #9689's proposer did (its idle rank's dummy run posted none)."""
    real = engine.agent.step

    def step(inputs, sampling):
        result = real(inputs, sampling)
        if not inputs.is_dummy:
            engine.dist.plan.all_gather(torch.zeros(8, dtype=torch.int64))
        return result
    engine.agent.step = step


def metadata_gather_per_rank_shape(engine):
    """Every rank posts a second DP metadata gather after its step's forward, of a shape that
    depends on its work: [8] int64 on a rank with work, [4] on an idle rank's dummy step -- the
    exact failure of vllm-ascend #9689 (gloo: "8 vs 4"), which gloo answers by aborting the
    process once the gather runs."""
    real = engine.agent.step

    def step(inputs, sampling):
        result = real(inputs, sampling)
        size = 4 if inputs.is_dummy else 8
        engine.dist.plan.all_gather(torch.zeros(size, dtype=torch.int64))
        return result
    engine.agent.step = step
