"""k chosen per step (SpeculativeConfig(dynamic=True), spec_decode/policy.py).

Exactness: whatever draft count each step runs (0: a plain decode step that only writes the
draft head's KV), greedy output equals plain greedy output; the cycle hook
(LMDEPLOY_LITE_SPEC_K_CYCLE) walks every switch deterministically, and the embedded model's
trained MTP head makes the drafts real (acceptance asserted first). The policy itself: unit tests
on synthetic timings, and engine runs whose step times come from a synthetic cost model, so the
choice it converges to is a function of the acceptance alone (no timed test).
"""
import pytest
import torch

from lmdeploy_lite.messages import GenerationConfig, PytorchEngineConfig, SpeculativeConfig
from lmdeploy_lite.pytorch.engine.build import build_engine
from lmdeploy_lite.pytorch.spec_decode.policy import DraftCountPolicy, batch_bucket
from tests.helpers import accepting

GREEDY = GenerationConfig(max_new_tokens=40, ignore_eos=True)


def engine_of(path, k, dynamic=True, **kw):
    cfg = dict(dtype='float64', device='cpu', block_size=4, session_len=160)
    cfg.update(kw)
    spec = SpeculativeConfig(num_speculative_tokens=k, dynamic=dynamic)
    return build_engine(path, PytorchEngineConfig(**cfg), spec, progress=False)


def record_draft_counts(engine) -> list[int]:
    """The plan's draft count of every step the engine runs from now on."""
    seen, gather = [], engine._gather_plan

    def gather_and_record(batch, sampling):
        plan = gather(batch, sampling)
        seen.append(plan.num_spec)
        return plan
    engine._gather_plan = gather_and_record
    return seen


@pytest.mark.parametrize('k', [2, 4])        # the cycle clamped to 2; every count up to 4
def test_every_switch_of_k_gives_plain_greedy(k, monkeypatch):
    """The embedded model (drafts mostly accepted), with chunked prefill: each step's k from the
    cycle, so steps verify fewer drafts than the last one made, more than it made (a row verifies
    only the real ones), none after a plain step, and plain steps follow drafting steps."""
    accepting.cycle_draft_counts(monkeypatch)
    prompts = [list(p) for p in accepting.many_prompts(6)]
    plain = accepting.reference(0, prompts, GREEDY)
    engine = build_engine(accepting.model_dir(), PytorchEngineConfig(
        **{**accepting.BASE, 'session_len': 160}, max_prefill_token_num=5),
        SpeculativeConfig(num_speculative_tokens=k), progress=False)
    seen = record_draft_counts(engine)
    got = [s.generated_ids for s in engine.generate(prompts, GREEDY)]
    accepting.assert_dynamic_acceptance(engine.spec_stats, k, positions=k)
    assert got == plain.token_ids
    assert set(seen) == set(range(k + 1)), seen          # every count ran
    # per-position figures count the steps that drafted each position
    stats = engine.spec_stats
    assert stats.drafted_per_position[0] == stats.num_drafts
    assert sum(stats.drafted_per_position) == stats.num_draft_tokens
    assert stats.drafted_per_position[k - 1] < stats.num_drafts     # fewer drafted deep
    assert all(0 < r <= 1 for r in stats.acceptance_by_position), stats


def test_every_switch_of_k_with_a_token_map_gives_plain_greedy(monkeypatch):
    """The cycle with a reduced draft vocabulary (a frequency map of the embedded model)."""
    from tests.helpers import token_maps
    accepting.cycle_draft_counts(monkeypatch)
    prompts = [list(p) for p in accepting.many_prompts(6)]
    engine = build_engine(accepting.model_dir(), PytorchEngineConfig(
        **{**accepting.BASE, 'session_len': 160}, max_prefill_token_num=5),
        token_maps.spec(3, token_maps.frequency_map(), dynamic=True), progress=False)
    got = [s.generated_ids for s in engine.generate(prompts, GREEDY)]
    accepting.assert_dynamic_acceptance(engine.spec_stats, 3, positions=3)
    assert got == accepting.reference(0, prompts, GREEDY).token_ids


@pytest.mark.parametrize('moe', [False, True])
def test_dynamic_k_on_random_heads_gives_plain_greedy(moe, tiny_ckpt, monkeypatch):
    """Tiny random checkpoints (dense and MoE, float64) against transformers-checked plain
    output, with the cycle and with the real policy."""
    path = tiny_ckpt(moe, layout='multimodal')
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12], list(range(20, 49))]
    plain = [s.generated_ids for s in engine_of(path, 1, dynamic=False).generate(prompts, GREEDY)]
    monkeypatch.setenv('LMDEPLOY_LITE_SPEC_K_CYCLE', '3,0,1,0,2,3')
    got = [s.generated_ids for s in engine_of(path, 3, max_prefill_token_num=7)
           .generate(prompts, GREEDY)]
    assert got == plain
    monkeypatch.delenv('LMDEPLOY_LITE_SPEC_K_CYCLE')
    assert [s.generated_ids for s in engine_of(path, 3).generate(prompts, GREEDY)] == plain


def synthetic_clock(engine, cost_per_draft: float):
    """Decode steps 'take' (1 + cost_per_draft * k) x a batch-proportional unit, whatever the
    machine does: the policy then sees a fixed cost model."""
    policy = engine.draft_policy
    observe = policy.observe_time

    def observe_synthetic(batch_size, k, seconds):
        observe(batch_size, k, 1e-3 * (1 + 0.1 * batch_size) * (1 + cost_per_draft * k))
    policy.observe_time = observe_synthetic


def test_policy_turns_speculation_off_when_nothing_is_accepted(tiny_ckpt):
    """A random MTP head accepts nearly nothing: with drafts costing 30% of a step each, the
    policy settles on plain decode steps (k=0), only revisiting k=1 now and then."""
    engine = engine_of(tiny_ckpt(False, layout='multimodal'), 3)
    synthetic_clock(engine, 0.3)
    seen = record_draft_counts(engine)
    engine.generate([[5, 6, 7, 8, 9], [10, 11, 12]], GenerationConfig(max_new_tokens=150,
                                                                       ignore_eos=True))
    late = seen[-60:]
    assert late.count(0) >= 50, seen
    assert engine.draft_policy.best(2) == 0


def test_policy_drafts_deep_when_drafts_are_accepted():
    """The embedded model accepts ~60-80% per position: with drafts costing 10% of a step each,
    the policy settles on k >= 2; the cost model of 100% per draft pushes it to k <= 1."""
    prompts = [list(p) for p in accepting.many_prompts(4)]
    gen = GenerationConfig(max_new_tokens=100, ignore_eos=True)
    for cost, allowed in ((0.1, {2, 3}), (1.0, {0, 1})):
        engine = build_engine(accepting.model_dir(), PytorchEngineConfig(
            **{**accepting.BASE, 'session_len': 160}),
            SpeculativeConfig(num_speculative_tokens=3), progress=False)
        synthetic_clock(engine, cost)
        seen = record_draft_counts(engine)
        engine.generate(prompts, gen)
        late = seen[-20:]
        assert sum(k in allowed for k in late) >= 16, (cost, seen)


# ---- the policy on its own ------------------------------------------------------------------
def feed(policy, batch, k_time, accept, steps):
    """Run `steps` steps: the policy proposes, the step takes k_time(k), rows accept per the
    cumulative acceptance list `accept` (row i of the batch accepts `accept`-weighted counts)."""
    chosen = []
    for _ in range(steps):
        k = policy.propose(batch)
        chosen.append(k)
        policy.observe_time(batch, k, k_time(k))
        if k:
            # deterministic rows: a fraction accept[i] of rows get past position i
            accepted = [sum(1 for i in range(k) if r < round(accept[i] * batch))
                        for r in range(batch)]
            policy.observe_acceptance([k] * batch, accepted)
    return chosen


@pytest.mark.parametrize('accept, draft_cost, want', [
    ([0.9, 0.8, 0.7, 0.6], 0.1, 4),           # cheap drafts, high acceptance: all of them
    ([0.8, 0.6, 0.5, 0.4], 0.25, 3),          # E/t = 1.44, 1.60, 1.657, 1.65 at k = 1..4
    ([0.8, 0.4, 0.1, 0.0], 0.25, 2),          # E/t = 1.44, 1.47, 1.43, 1.25
    ([0.0, 0.0, 0.0, 0.0], 0.2, 0),           # nothing accepted: plain decode
    ([0.5, 0.2, 0.1, 0.0], 0.8, 0),           # expensive drafts
])
def test_policy_converges_to_the_best_k(accept, draft_cost, want):
    policy = DraftCountPolicy(4)
    chosen = feed(policy, 8, lambda k: 0.01 * (1 + draft_cost * k), accept, 400)
    assert policy.best(8) == want, (policy.rates(batch_bucket(8)), chosen[-40:])
    assert chosen[-50:].count(want) >= 40, chosen[-50:]


def test_a_new_bucket_skips_shallower_ks_that_cannot_win():
    """High acceptance and cheap drafts: once k=2 and k=3 are measured, k=1 and k=0 are rated
    below them on measured positions and step times, so the opening steps never run them (each
    tried k costs `explore_steps` steps); with nothing accepted and drafts costing 30% of a
    step, k=0 is soon rated best, so tried, and kept."""
    cost = lambda k: 0.01 * (1 + 0.1 * k)                      # noqa: E731
    chosen = feed(DraftCountPolicy(3), 1, cost, [0.9, 0.85, 0.8], 20)
    assert set(chosen) <= {2, 3}, chosen
    chosen = feed(DraftCountPolicy(3), 1, lambda k: 0.01 * (1 + 0.3 * k), [0.0] * 3, 24)
    assert 0 in chosen[:10] and chosen[-8:] == [0] * 8, chosen


def test_a_new_bucket_skips_deeper_ks_that_cannot_win():
    """After a hard start at batch 1, a new bucket (batch 8, the 2-core CPU's step times) whose
    rows accept 30% a position: plain decoding is best and a deeper k could not win even at the
    upper end of its acceptance interval, so k=2 and k=3 are never tried (the policy before
    tried each for three steps). Where drafts are accepted, the deeper ks are still tried and
    k=3 is reached."""
    batch1 = {0: 0.0103, 1: 0.0150, 2: 0.0182, 3: 0.0222}.get
    batch8 = {0: 0.0177, 1: 0.0277, 2: 0.0360, 3: 0.0441}.get
    for accept, allowed, last in (([0.3, 0.09, 0.027], {0, 1}, 0),
                                  ([0.9, 0.81, 0.73], {0, 1, 2, 3}, 3)):
        policy = DraftCountPolicy(3)
        feed(policy, 1, batch1, [0.0] * 3, 6)
        policy.break_sequence()
        chosen = feed(policy, 8, batch8, accept, 30)
        assert set(chosen) <= allowed and chosen[-10:] == [last] * 10, (accept, chosen)


def test_a_large_batch_tries_a_shallower_k_than_the_smaller_ones_chose():
    """bench_spec's 0.8B on an H200 (2026-11-28), its batch sizes in turn as that benchmark runs
    them, rows accepting 0.8 / 0.6 / 0.5 (conditional). At batch 128 the verify's extra tokens
    cost their share of the compute: k=1 (4.85 ms) beats k=2 (6.41) by 4%. The new bucket starts
    at k=2, the best of batch 32, and the other ks' times, estimated from the prior's draft cost,
    rate k=1 below it: the policy before never tried k=1 there (dynamic 0.88x fixed k=1 on the
    GPU). An early revisit now tries k-1 where even its fastest possible step (time in
    proportion to the tokens a row verifies) could win, and keeps k=1."""
    policy, accept = DraftCountPolicy(3), [0.8, 0.48, 0.24]
    for batch, ms in ((8, [1.39, 1.65, 1.83, 2.02]), (32, [1.79, 2.32, 2.73, 3.19]),
                      (128, [3.09, 4.85, 6.41, 8.07])):
        policy.break_sequence()
        chosen = feed(policy, batch, lambda k, ms=ms: ms[k] / 1000, accept, 60)
    assert 1 in chosen[:30] and policy.best(128) == 1 and chosen[-30:].count(1) >= 26, chosen


def test_policy_follows_a_change_of_acceptance():
    """Acceptance drops to zero mid-run: the policy leaves k=4 for k=0; it comes back."""
    policy = DraftCountPolicy(4)
    cost = lambda k: 0.01 * (1 + 0.1 * k)                      # noqa: E731
    feed(policy, 4, cost, [0.9, 0.8, 0.7, 0.6], 200)
    assert policy.best(4) == 4
    feed(policy, 4, cost, [0.0] * 4, 400)
    assert policy.best(4) == 0
    feed(policy, 4, cost, [0.9, 0.8, 0.7, 0.6], 1200)
    assert policy.best(4) >= 3


def test_policy_per_batch_bucket():
    """Large batches make drafts expensive (a compute-bound verify): k differs by bucket."""
    policy = DraftCountPolicy(3)
    accept = [0.8, 0.6, 0.5]
    for _ in range(3):
        feed(policy, 8, lambda k: 0.01 * (1 + 0.1 * k), accept, 150)
        feed(policy, 128, lambda k: 0.05 * (1 + 1.0 * k), accept, 150)
    assert policy.best(8) == 3 and policy.best(128) == 0


def test_fixed_and_cycle_modes():
    assert [DraftCountPolicy(3, dynamic=False).propose(b) for b in (1, 64)] == [3, 3]
    cycle = DraftCountPolicy(2, cycle=(3, 0, 1))
    assert [cycle.propose(1) for _ in range(6)] == [2, 0, 1, 2, 0, 1]     # clamped to k


def test_state_graph_buffers_do_not_depend_on_k():
    """The draft tables are allocated once at the maximum k (DESIGN.md invariant 7)."""
    engine = build_engine(accepting.model_dir(), PytorchEngineConfig(**accepting.BASE),
                    SpeculativeConfig(num_speculative_tokens=3), progress=False)
    agent = engine.agent
    assert agent.drafts.shape[1] == 3 and agent.num_drafted.dtype == torch.long
    assert agent.draft_counts == [0, 1, 2, 3]


def test_policy_keeps_its_choice_on_near_ties():
    """Two ks that tie (k=1 and k=2 give the same tokens per second), timings jittering by
    +-4%: the policy keeps its running choice instead of flapping between them (a switch up
    wastes a verify width); without the margin it switches 5 times in the last 150 steps. (k=0,
    a third near-tie here, is tried by the periodic revisits below k=1 but never kept.)"""
    import random
    rng = random.Random(0)
    policy = DraftCountPolicy(2)
    # feed()'s rows accept 6 of 8 at each position: E(1) = 1.75, E(2) = 2.5
    cost = {0: 1.0, 1: 1.3, 2: 1.3 * 2.5 / 1.75}
    chosen = feed(policy, 8, lambda k: 0.01 * cost[k] * rng.uniform(0.96, 1.04), [0.8, 0.75],
                  600)
    late = [k for k in chosen[-150:] if k]
    assert sum(a != b for a, b in zip(late, late[1:])) <= 2, late    # the neighbours' revisit
    runs = ''.join(map(str, chosen)).replace('1', ' ').replace('2', ' ').split()
    assert all(len(run) <= policy.explore_steps + 1 for run in runs), chosen    # never kept


CPU_STEP_MS = {0: 8.0, 1: 11.7, 2: 15.5, 3: 16.0}      # a 2-core CPU's step at k = 0..3


def cpu_clock_rate(policy, seed: int, steps: int, acceptance, noise: float,
                   slowdown=lambda rng: 1.0, batch: int = 1, step_ms=None,
                   fixed: int = 3) -> float:
    """Tokens per second of `policy` (None: fixed k=`fixed`) for `batch` rows on the CPU's step
    times: step s accepts draft j with probability acceptance(s)[j] (given the drafts before
    it); its time is `step_ms`[k] (default CPU_STEP_MS) times `slowdown(rng)` (drawn first) and
    uniform noise of +-`noise`."""
    import random
    rng, tokens, seconds, step_ms = random.Random(seed), 0, 0.0, step_ms or CPU_STEP_MS
    for step in range(steps):
        slow = slowdown(rng)
        draws = [[rng.random() for _ in range(3)] for _ in range(batch)]
        k = policy.propose(batch) if policy else fixed
        accepted = []
        for row in draws:
            n = 0
            while n < k and row[n] < acceptance(step)[n]:
                n += 1
            accepted.append(n)
        t = step_ms[k] * slow * rng.uniform(1 - noise, 1 + noise) / 1e3
        if policy:
            policy.observe_time(batch, k, t)
            if k:
                policy.observe_acceptance([k] * batch, accepted)
        tokens, seconds = tokens + batch + sum(accepted), seconds + t
    return tokens / seconds


def test_policy_recovers_from_a_hard_start_on_a_noisy_cpu_clock():
    """The CPU main job's case (issue 39): step times of a 2-core CPU (`CPU_STEP_MS`, +-10%
    noise), one row, the first 8 steps hard to draft (conditional acceptance 0.6, 0.2, 0.2), then
    easy (0.95, 0.88, 0.85). The early deep drafts, few and mostly rejected, must not hold the
    policy below k=3: over 30 seeds of 130 steps it reaches on average >= 0.975x the tokens per
    second of fixed k=3 on the same draws, and >= 0.94x in all but the 3 worst seeds. (The
    policy of 2026-11-26, with decayed evidence and no prior: mean 0.914, 4th worst 0.758; 2 seeds
    of the first 5 stayed at k=1. Asking each of 5 seeds for 0.97x judged luck: the policy of
    2026-11-28 gave 0.97x or less in 22 of 100 seeds, mean 0.987.)"""
    def acceptance(step):
        return (0.6, 0.2, 0.2) if step < 8 else (0.95, 0.88, 0.85)
    ratios = sorted(cpu_clock_rate(DraftCountPolicy(3), seed, 130, acceptance, 0.1)
                    / cpu_clock_rate(None, seed, 130, acceptance, 0.1) for seed in range(30))
    assert sum(ratios) / len(ratios) >= 0.975 and ratios[3] >= 0.94, [round(r, 3) for r in ratios]


def test_policy_keeps_k3_through_bursts_of_slow_steps():
    """A shared 2-core CPU: the same step times (+-5%), but with probability 0.05 per step a
    burst of 3 steps 1.6-2x slower whatever k runs (the front-end thread, GC, another process);
    acceptance 0.9, 0.85, 0.8. A burst that lands on a k's few exploration steps, or on the
    running k, must not hold the policy away from k=3: over 300 steps each seed reaches >= 0.95x
    fixed k=3 on the same draws. (With a moving average and no second visit, seeds 1, 3, 4, 5, 6
    of these 8 gave 0.85-0.93x.)"""
    def bursts():
        left = [0]

        def slowdown(rng):
            if left[0] == 0 and rng.random() < 0.05:
                left[0] = 3
            slow = rng.uniform(1.6, 2.0) if left[0] else 1.0
            left[0] = max(0, left[0] - 1)
            return slow
        return slowdown

    def rate(policy, seed):
        return cpu_clock_rate(policy, seed, 300, lambda step: (0.9, 0.85, 0.8), 0.05, bursts())
    ratios = [rate(DraftCountPolicy(3), seed) / rate(None, seed) for seed in range(8)]
    assert min(ratios) >= 0.95, [round(r, 3) for r in ratios]


def test_policy_times_plain_steps_where_a_verify_costs_its_tokens():
    """`pipeline()` at batch 32 on the 2-core CPU (issue 39): a verify's extra tokens cost their
    share of the compute, a k=1 step 2x a plain one (ms measured 2026-11-29), so with acceptance
    0.8, 0.8, 0.85 plain decoding is ~11% faster than any k. k=0's time cannot be drawn from the
    draft steps': the policy must time it and keep it. As `pipeline()` runs it: a warm-up call
    first (4 rows, 6 steps, hard to draft), then 64 steps of 32 rows; 10 seeds: mean >= 0.97x
    plain, each >= 0.95x (0.988 and 0.975 now). (The policy of 2026-11-28 never tried k=0 here:
    mean 0.90x.)"""
    step_ms = {0: 27.4, 1: 55.3, 2: 73.0, 3: 90.8}

    def rate(policy, seed):
        if policy:
            cpu_clock_rate(policy, seed, 6, lambda step: (0.5, 0.4, 0.4), 0.05, batch=4,
                           step_ms={0: 13.0, 1: 19.0, 2: 24.0, 3: 27.0})
            policy.break_sequence()
        return cpu_clock_rate(policy, seed, 64, lambda step: (0.8, 0.8, 0.85), 0.05, batch=32,
                              step_ms=step_ms, fixed=0)
    ratios = [rate(DraftCountPolicy(3), seed) / rate(None, seed) for seed in range(10)]
    assert sum(ratios) / len(ratios) >= 0.97 and min(ratios) >= 0.95, [round(r, 3) for r in ratios]



def _drafting_run(setup) -> tuple:
    """The embedded model, MTP k=3, the k cycle's draft counts: four requests of different
    lengths (they finish at different steps), two more arriving at steps 25 and 50; `setup(agent,
    flushes)` before the first step. (outputs, acceptance counts, the head's KV cache, the
    number of deferred writes each flush made)."""
    prompts = [list(p) for p in accepting.many_prompts(6)]
    lengths = [70, 40, 55, 70, 25, 62]
    engine = build_engine(accepting.model_dir(), PytorchEngineConfig(
        **{**accepting.BASE, 'session_len': 160}), SpeculativeConfig(num_speculative_tokens=3),
        progress=False)
    agent, flushes = engine.agent, []
    flush = agent.proposer.flush_kv
    agent.proposer.flush_kv = lambda: (flushes.append(len(agent.proposer.deferred)), flush())
    setup(agent)
    seqs = [engine.add_request(p, GenerationConfig(max_new_tokens=n, ignore_eos=True))
            for p, n in zip(prompts[:4], lengths)]
    steps = 0
    while engine.has_work:
        engine.step()
        steps += 1
        if steps in (25, 50):
            i = 4 + (steps == 50)
            seqs.append(engine.add_request(prompts[i], GenerationConfig(
                max_new_tokens=lengths[i], ignore_eos=True)))
    agent.proposer.flush_kv()
    return ([s.generated_ids for s in seqs], accepting.counts(engine.spec_stats),
            [c.clone() for c in agent.proposer.caches[0]], flushes)


def _assert_same_drafts(run, reference):
    (out, counts, cache, _), (out_ref, counts_ref, cache_ref, _) = run, reference
    assert out == out_ref and counts == counts_ref and counts[2] > 0
    for got, want in zip(cache, cache_ref):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_deferred_draft_kv_writes_change_no_draft(monkeypatch):
    """On the CPU the draft head's KV writes of plain steps wait and run as one pass
    (MTPProposer.defer_kv): against the same run writing each step's at once, every draft is the
    same (acceptance by position equal) and the head's KV cache ends the same, through runs of
    plain steps longer than one flush, sequences that finish (their blocks freed) and arrivals."""
    from lmdeploy_lite.pytorch.spec_decode.proposers.mtp import DEFERRED_STEPS
    monkeypatch.setenv('LMDEPLOY_LITE_SPEC_K_CYCLE', ','.join(['0'] * (DEFERRED_STEPS + 3)
                                                              + ['3', '3', '3', '0', '2', '2']))
    run = _drafting_run(lambda agent: None)
    assert run[0] and max(run[3]) == DEFERRED_STEPS and min(f for f in run[3] if f) < DEFERRED_STEPS
    _assert_same_drafts(run, _drafting_run(lambda agent: setattr(agent, 'defers_kv', False)))


def test_the_head_run_at_its_drafting_rows_only_drafts_the_same(monkeypatch):
    """On the CPU a step of enough tokens runs the head's layer at the drafting rows only
    (`_head_at_rows`; here every step, the threshold set to 0), on other devices a prefill or
    mixed step does (`row_only` False): either way the same drafts and KV cache as the whole
    first pass, over prefills, verifies of every k and plain steps."""
    from lmdeploy_lite.pytorch.spec_decode.proposers import mtp
    monkeypatch.setenv('LMDEPLOY_LITE_SPEC_K_CYCLE', '3,3,1,0,2,3,3')
    monkeypatch.setattr(mtp, 'ROW_ONLY_MIN_TOKENS', 0)
    whole = _drafting_run(lambda agent: setattr(agent.proposer, '_rows_only', lambda _: False))
    _assert_same_drafts(_drafting_run(lambda agent: None), whole)
    _assert_same_drafts(_drafting_run(lambda agent: setattr(agent.proposer, 'row_only', False)),
                        whole)


def test_every_rank_of_a_step_runs_the_same_first_head_pass():
    """Off the CPU the head's first pass runs at the drafting rows only in a step where some
    rank prefills (its whole pass has no graph there). The choice is the plan's, so that a rank
    that verifies beside one that prefills makes the same MoE dispatches (EP), and a step where
    every working rank decodes runs the whole (captured) pass."""
    from lmdeploy_lite.pytorch.engine.step_plan import StepPlan
    from lmdeploy_lite.pytorch.spec_decode.proposers.mtp import MTPProposer
    from lmdeploy_lite.pytorch.strategies.base import pack_model_inputs
    from tests.pytorch.engine.test_step_plan import batch
    engine = build_engine(accepting.model_dir(), PytorchEngineConfig(**accepting.BASE),
                          SpeculativeConfig(num_speculative_tokens=3), progress=False)
    proposer: MTPProposer = engine.agent.proposer
    proposer.row_only = False                               # as on a GPU
    verify, prefill = batch([4, 4], True), batch([9, 30], False)

    def choices(*batches) -> list[bool]:
        plan = StepPlan(torch.stack([StepPlan.local_row(b, 1, False, num_spec=3)
                                     for b in batches]), tp=1)
        inputs = [pack_model_inputs([[1] * n for n in b.q_lens], [0] * len(b.q_lens),
                                    [[0]] * len(b.q_lens), [0] * len(b.q_lens), b.is_decoding,
                                    engine.device) for b in batches]
        for rank in inputs:
            rank.sizes = plan.forward_sizes(rank.num_tokens, rank.batch_size)
        return [proposer._rows_only(rank) for rank in inputs]
    assert choices(verify, prefill) == [True, True]
    assert choices(prefill, prefill) == [True, True]
    assert choices(verify, verify) == [False, False]
