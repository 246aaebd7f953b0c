"""DP / EP / TP with speculative decoding on CPU processes (gloo), against one process.

The speculative tests run the embedded model (trained, with an MTP head whose drafts are mostly
accepted: tests/helpers/accepting), so rollback, multi-token emission, stops inside accepted runs
and the post-broadcast of accepted counts happen on every rank; each asserts the acceptance it
exercised before it compares whole sequences and per-request draft counts with the single process.
Every test here starts real worker processes; each has a hard pytest timeout and asserts that
it finished, and the engine's own collective timeout is short, so a hang fails with a message.
"""
import multiprocessing
import queue
import re
import threading
import time

import pytest

from lmdeploy_lite import GenerationConfig, PytorchEngineConfig, SpeculativeConfig, pipeline
from lmdeploy_lite.pytorch.config import DistConfig, ModelConfig
from lmdeploy_lite.pytorch.engine.build import build_engine
from lmdeploy_lite.pytorch.engine.executor.mp import MPEngineLoop
from tests.helpers import accepting
from tests.helpers.accepting import assert_matches_reference
from tests.helpers.broken import Finished, rank0_steps_slowly, run_requests, skip_dummy_draft
from tests.helpers.collective_log import COLLECTIVE_LOG_DIR, count_object_broadcasts, read_broadcasts
from tests.helpers.forward_counts import FORWARD_COUNT_DIR, count_forwards, read_counts
from tests.helpers.graph_buffers import GRAPH_REPLAY_DIR, graph_buffers, read_replays

BASE = dict(dtype='float64', device='cpu', block_size=4, session_len=128)    # tiny checkpoints
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], list(range(20, 49)), [300, 301, 2, 450, 3, 3, 3, 17]]
GEN = GenerationConfig(max_new_tokens=24, ignore_eos=True)


@pytest.fixture(autouse=True)
def strict_collectives(monkeypatch):
    monkeypatch.setenv('LMDEPLOY_LITE_CHECK_COLLECTIVES', '1')     # always on in tests
    monkeypatch.setenv('LMDEPLOY_LITE_DIST_TIMEOUT', '20')


def embedded_pipeline(layout: dict, spec: SpeculativeConfig | None):
    return pipeline(accepting.model_dir(), PytorchEngineConfig(**layout, **accepting.BASE), spec,
                    progress=False)


@pytest.mark.timeout(300)
# a fixed k = 3 is not a variant of its own: the dynamic runs cycle through every k (3 included)
@pytest.mark.parametrize('k, draft_tp, dynamic', [(1, 1, False), (3, None, True), (3, 1, True)],
                         ids=['k1_draft_tp1', 'k3_dynamic', 'k3_draft_tp1_dynamic'])
def test_tp2_gives_plain_greedy_tokens_and_single_process_acceptance(k, draft_tp, dynamic,
                                                                     monkeypatch):
    """tp=2 target; the draft sharded like the target or replicated (draft tp=1); fixed k, or
    each step's k from the cycle (every switch, plain steps included)."""
    if dynamic:
        accepting.cycle_draft_counts(monkeypatch)
    # a dynamic run takes GREEDY's steps through the whole cycle; a fixed k needs fewer
    gen = accepting.GREEDY if dynamic else accepting.SHORT
    start = time.monotonic()
    draft = accepting.spec(k, tp=draft_tp, dynamic=dynamic)
    with embedded_pipeline(dict(tp=2), draft) as pipe:
        responses = pipe([list(p) for p in accepting.prompts()], gen)
    assert_matches_reference(responses, k, gen=gen, dynamic=dynamic)
    assert time.monotonic() - start < 240


@pytest.mark.timeout(300)
@pytest.mark.parametrize('layout, k, dynamic', [      # the dynamic runs cycle through every k
    (dict(dp=2, ep=2), 1, False), (dict(dp=2, ep=2), 3, True), (dict(dp=2), 3, True)],
    ids=['dp2_ep2_k1', 'dp2_ep2_k3_dynamic', 'dp2_ep1_k3_dynamic'])
def test_dp2_one_request_with_an_idle_rank_then_a_batch(layout, k, dynamic, tmp_path,
                                                        monkeypatch):
    """First exactly one request, then a batch over both ranks, in one engine; forwards counted
    per rank. dp=2 ep=2 (the seed scenario; MoE target and MoE MTP layer): the ranks run in
    lockstep, so the idle rank runs a dummy target AND draft forward for each of the busy rank's
    (or the busy rank's all-to-all has no partner). dp=2 ep=1: DP ranks share no collective and
    run independently, so the idle rank runs no forward at all. `dynamic`: each rank proposes
    its step's k from the cycle, the plan runs the smallest (ranks at different points of the
    cycle disagree), and the idle rank's dummy follows the plan's k."""
    if dynamic:
        accepting.cycle_draft_counts(monkeypatch)
    # a dynamic run takes GREEDY's steps through the whole cycle; a fixed k needs fewer
    gen = accepting.GREEDY if dynamic else accepting.SHORT
    start = time.monotonic()
    one = accepting.prompts()[1:2]
    loop = MPEngineLoop(accepting.model_dir(), PytorchEngineConfig(**layout, **accepting.BASE),
                        accepting.spec(k, dynamic=dynamic),
                        env={FORWARD_COUNT_DIR: str(tmp_path)},
                        worker_hook=count_forwards)
    try:
        alone = run_requests(loop, [list(p) for p in one], gen)
        counts_alone = read_counts(tmp_path, 2)
        batch = run_requests(loop, [list(p) for p in accepting.prompts()], gen)
        counts_batch = read_counts(tmp_path, 2)
    finally:
        loop.close()
    assert time.monotonic() - start < 240
    assert_matches_reference(alone, k, one, gen, dynamic=dynamic)
    assert_matches_reference(batch, k, None, gen, dynamic=dynamic)
    busy = alone[0].dp_rank
    idle = 1 - busy
    assert min(counts_alone[busy]) > 0, counts_alone            # target and draft forwards
    if layout.get('ep', 1) > 1:
        assert counts_alone[idle] == counts_alone[busy], counts_alone      # one dummy for each
    else:
        assert counts_alone[idle] == (0, 0), counts_alone
    assert sorted(r.dp_rank for r in batch) == [0, 0, 1, 1]              # the load is balanced
    assert min(counts_batch[idle]) > 0 and counts_batch[busy] > counts_alone[busy], counts_batch


@pytest.mark.timeout(300)
def test_staggered_arrivals_limits_and_a_stop_inside_an_accepted_run():
    """dp=2 ep=2, k=3: requests arrive at different times with different lengths and limits, so
    one rank is in prefill while the other decodes, one hits its length limit while the other
    drafts, and one stops on a token in the middle of a run of accepted drafts (what follows it
    in that step is dropped). The first prompt is long enough (68 tokens) for the MTP head's
    first pass at its drafting rows only (proposers/mtp.py), which every rank, the idle one's
    dummy included, must choose alike (its MoE dispatches across the ranks)."""
    k, prompts = 3, accepting.prompts()
    stop, stop_pos = accepting.reference(3, prompts[1:2]).stop_inside_accepted_run(0)
    long_prompt = tuple(t for p in prompts for t in p)[:35] * 2
    from lmdeploy_lite.pytorch.spec_decode.proposers.mtp import ROW_ONLY_MIN_TOKENS
    assert len(long_prompt) >= ROW_ONLY_MIN_TOKENS
    jobs = [(long_prompt, GenerationConfig(max_new_tokens=30, ignore_eos=True), 0.0),
            (prompts[2], GenerationConfig(max_new_tokens=5, ignore_eos=True), 0.2),
            (prompts[1], GenerationConfig(max_new_tokens=accepting.GREEDY.max_new_tokens,
                                          ignore_eos=True, stop_token_ids=[stop]), 0.5),
            (prompts[3], GenerationConfig(max_new_tokens=1, ignore_eos=True), 0.7)]
    results = [None] * len(jobs)
    start = time.monotonic()
    with embedded_pipeline(dict(dp=2, ep=2), accepting.spec(k)) as pipe:
        def run(i):
            prompt, gen, delay = jobs[i]
            time.sleep(delay)
            results[i] = pipe(list(prompt), gen)
        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(240)
        assert not any(t.is_alive() for t in threads), 'a request never finished'
    assert time.monotonic() - start < 240
    assert_matches_reference(results, k, [p for p, _, _ in jobs], [g for _, g, _ in jobs])
    assert results[2].token_ids[-1] == stop and len(results[2].token_ids) == stop_pos + 1
    assert results[2].finish_reason == 'stop'
    assert [r.finish_reason for i, r in enumerate(results) if i != 2] == ['length'] * 3


@pytest.mark.timeout(300)
def test_tp2_peers_admit_staggered_requests_and_an_abort_alike(tmp_path):
    """tp=2, k=3: a request arrives while another decodes and a third is aborted after its
    first tokens. Each TP rank reads the events from its own inbox and both admit what both
    have (StepPlan.fewest_events): the single process's tokens and draft counts, and no object
    broadcast on either rank (the inbox is not shared by a collective of its own)."""
    prompts = [list(p) for p in accepting.prompts()]
    start, results = time.monotonic(), queue.Queue()
    loop = MPEngineLoop(accepting.model_dir(), PytorchEngineConfig(tp=2, **accepting.BASE),
                        accepting.spec(3), env={COLLECTIVE_LOG_DIR: str(tmp_path)},
                        worker_hook=count_object_broadcasts)
    try:
        done = {i: Finished([], None) for i in range(3)}

        def submit(i):
            return loop.submit(prompts[i], accepting.GREEDY, lambda item: results.put((i, item)))
        submit(0)
        doomed = None
        while done[0].finish_reason is None or done[1].finish_reason is None:
            i, item = results.get(timeout=120)
            assert not isinstance(item, BaseException), item
            done[i].token_ids += item.new_token_ids
            done[i].spec_stats = item.spec_stats
            done[i].finish_reason = item.finish_reason if item.finished else None
            if i == 0 and len(done[0].token_ids) >= 6 and doomed is None:
                submit(1)                                       # arrives mid-run
                doomed = submit(2)
            elif i == 2 and done[2].token_ids and done[2].finish_reason is None:
                loop.abort(doomed)
    finally:
        loop.close()
    assert time.monotonic() - start < 240
    assert_matches_reference([done[0], done[1]], 3, prompts[:2])
    assert [read_broadcasts(str(tmp_path), r) for r in range(2)] == [0, 0]


@pytest.mark.timeout(300)
def test_tp2_whole_greedy_steps_through_graph_buffers(tmp_path, monkeypatch):
    """tp=2, both ranks' decode steps through the graph runners' static buffers (CPU: the CUDA
    graphs' copies and padding, run eagerly), so a greedy step of k drafts is one whole-step
    runner (SpecAgent.step_graphs: verify, the vocab-parallel LM head, acceptance, MTP head and
    chain) on each rank before the TP broadcast of rank 0's results; each step's k from the
    cycle (every switch, plain steps included): plain greedy tokens after real acceptance, with
    the collective trace check on. (EP layouts on CPU take the all-to-all dispatcher, which
    never replays.)"""
    accepting.cycle_draft_counts(monkeypatch)
    start = time.monotonic()
    loop = MPEngineLoop(accepting.model_dir(), PytorchEngineConfig(tp=2, **accepting.BASE),
                        accepting.spec(3, dynamic=True), env={GRAPH_REPLAY_DIR: str(tmp_path)},
                        worker_hook=graph_buffers)
    try:
        alone = run_requests(loop, [list(accepting.prompts()[1])], accepting.GREEDY)
        batch = run_requests(loop, [list(p) for p in accepting.prompts()], accepting.GREEDY)
        replays = read_replays(tmp_path, 2)
    finally:
        loop.close()
    assert time.monotonic() - start < 240
    assert_matches_reference(alone, 3, accepting.prompts()[1:2], dynamic=True)
    assert_matches_reference(batch, 3, dynamic=True)
    for rank in replays:          # each k's whole step on both ranks (the cycle: 1, 2 and 3)
        assert all(rank.get(f'spec step k={k}', 0) > 0 for k in (1, 2, 3)), replays


@pytest.mark.timeout(300)
def test_a_rank_that_skips_its_dummy_draft_is_named_not_hung(tiny_ckpt, monkeypatch):
    # the mismatch is named once the collective the idle rank skipped times out (the run
    # takes about this long); every legitimate wait before it, within step 0 on a tiny model
    # after both ranks reported ready, is milliseconds (3 s, as test_bounded_waits.py's: the
    # ranks' rendezvous at start-up waits this long for a peer too)
    monkeypatch.setenv('LMDEPLOY_LITE_DIST_TIMEOUT', '3')
    path = tiny_ckpt(True, layout='plain')
    start = time.monotonic()
    loop = MPEngineLoop(path, PytorchEngineConfig(dp=2, ep=2, **BASE),
                        SpeculativeConfig(num_speculative_tokens=2), worker_hook=skip_dummy_draft)
    try:
        with pytest.raises(RuntimeError, match=r'collective sequences differ at collective'):
            run_requests(loop, PROMPTS[2:3], GEN)
    finally:
        loop.close()
    assert time.monotonic() - start < 120


@pytest.mark.timeout(300)
def test_a_dead_worker_is_reported_by_rank_and_nothing_is_left(tiny_ckpt):
    """Dense dp=2 first gives the single process's tokens; then SIGKILL of rank 1 while rank 0
    streams (a report every SLOW_STEP_S: pure-DP rank 0 runs on without its peer, and its
    traffic must not hide the death): within seconds the loop's error is one line naming the
    rank and the signal (no traceback: it is what the server shows), every live request gets it,
    and close() returns at once leaving no process."""
    path = tiny_ckpt(False, layout='plain')
    # 8 tokens: rank 0 sleeps SLOW_STEP_S in each of its steps (24 tokens: 2.4 s of sleep)
    short = GenerationConfig(max_new_tokens=8, ignore_eos=True)
    want = build_engine(path, PytorchEngineConfig(**BASE), progress=False).generate(PROMPTS[:2],
                                                                                   short)
    loop = MPEngineLoop(path, PytorchEngineConfig(dp=2, **BASE), worker_hook=rank0_steps_slowly)
    procs = loop._procs
    try:
        assert [r.token_ids for r in run_requests(loop, PROMPTS[:2], short)] == \
            [s.generated_ids for s in want]
        sinks = [queue.Queue() for _ in range(2)]            # one request on each rank
        for prompt, sink in zip(PROMPTS[:2], sinks):
            loop.submit(prompt, GenerationConfig(max_new_tokens=100, ignore_eos=True), sink.put)
        sinks[0].get(timeout=10)                 # rank 0 is streaming (for 100 x SLOW_STEP_S)
        procs[1].kill()
        killed = time.monotonic()
        while loop.error is None and time.monotonic() - killed < 10:
            time.sleep(0.05)
        assert loop.error is not None and time.monotonic() - killed < 3
        message = str(loop.error)
        assert re.fullmatch(rf'rank 1 \(pid {procs[1].pid}\) was killed by signal SIGKILL',
                            message), message
        for sink in sinks:        # tokens may come first; the last item is the error
            items = [sink.get(timeout=5)]
            while not isinstance(items[-1], BaseException):
                items.append(sink.get(timeout=5))
            assert items[-1] is loop.error
        with pytest.raises(RuntimeError, match='rank 1'):
            run_requests(loop, PROMPTS[:2], GEN)
    finally:
        start = time.monotonic()
        loop.close()
        assert time.monotonic() - start < 10
    assert not any(p.is_alive() for p in procs)


def test_invalid_layouts_name_the_numbers(tiny_ckpt):
    dense = ModelConfig.from_pretrained(tiny_ckpt(False, layout='plain'))
    moe = ModelConfig.from_pretrained(tiny_ckpt(True, layout='plain'))
    cases = [(DistConfig(tp=3), dense, 'tp=3: must divide num_attention_heads=4'),
             (DistConfig(dp=2, ep=2), dense, 'ep=2: expert parallelism needs a MoE model'),
             (DistConfig(dp=2, ep=3), moe, 'ep must equal dp x tp'),
             (DistConfig(dp=8, ep=8), moe, 'ep=8: must divide num_experts=4'),
             (DistConfig(dp=4), dense, 'only 2 devices')]
    for config, model, match in cases:
        with pytest.raises(ValueError, match=match):
            config.validate(model, num_devices=2)


def test_bad_layout_fails_before_any_process_starts(tiny_ckpt):
    path = tiny_ckpt(False, layout='plain')
    before = threading.active_count()
    with pytest.raises(ValueError, match='expert parallelism needs a MoE model'):
        pipeline(path, PytorchEngineConfig(dp=2, ep=2, **BASE), progress=False)
    with pytest.raises(ValueError, match='SpeculativeConfig.tp=3'):
        pipeline(path, PytorchEngineConfig(tp=2, **BASE), SpeculativeConfig(tp=3),
                 progress=False)
    assert threading.active_count() == before
    assert multiprocessing.active_children() == []            # no rank was spawned
