"""DP / EP with speculative decoding on CPU processes (gloo), against one process.

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
from lmdeploy_lite.pytorch.engine.engine import Engine
from lmdeploy_lite.pytorch.engine.executor.mp import MPEngineLoop
from tests.helpers.broken import run_requests, skip_dummy_draft

BASE = dict(dtype='float64', device='cpu', block_size=4, session_len=128)
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], list(range(20, 49)), [300, 301, 2, 450, 3, 3, 3, 17]]
GEN = GenerationConfig(max_new_tokens=24, ignore_eos=True)


@pytest.fixture(autouse=True)
def strict_collectives(monkeypatch):
    monkeypatch.setenv('LMDEPLOY_LITE_CHECK_COLLECTIVES', '1')     # always on in tests
    monkeypatch.setenv('LMDEPLOY_LITE_DIST_TIMEOUT', '20')


def single_process(path, spec, prompts, gen=GEN):
    engine = Engine(path, PytorchEngineConfig(**BASE), spec, progress=False)
    seqs = engine.generate(prompts, gen)
    return [s.generated_ids for s in seqs], engine.spec_stats.mean_accepted_length


def run_pipeline(path, layout, spec, prompts, gen=GEN):
    with pipeline(path, PytorchEngineConfig(**layout, **BASE), spec, progress=False) as pipe:
        responses = pipe(prompts, gen)
    return responses


@pytest.mark.timeout(300)
@pytest.mark.parametrize('moe, layout', [(False, dict(tp=2)), (True, dict(tp=2)),
                                         (False, dict(dp=2)), (True, dict(dp=2, ep=2)),
                                         (True, dict(tp=2, dp=2, ep=4))])
def test_layouts_give_single_process_tokens_and_acceptance(moe, layout, tiny_ckpt):
    path = tiny_ckpt(moe, layout='multimodal')
    spec = SpeculativeConfig(num_speculative_tokens=3)
    want, want_len = single_process(path, spec, PROMPTS)
    responses = run_pipeline(path, layout, spec, PROMPTS)
    assert [r.token_ids for r in responses] == want
    if layout.get('tp', 1) > 1:          # the draft replicated (tp=1) under a TP target
        replicated = SpeculativeConfig(num_speculative_tokens=3, tp=1)
        responses = run_pipeline(path, layout, replicated, PROMPTS)
    assert [r.token_ids for r in responses] == want
    # per-request acceptance is layout independent
    single = Engine(path, PytorchEngineConfig(**BASE), spec, progress=False)
    for r, p in zip(responses, PROMPTS):
        s = single.generate([p], GEN)[0]
        assert r.spec_stats.mean_accepted_length == s.spec_stats.mean_accepted_length


@pytest.mark.timeout(300)
@pytest.mark.parametrize('k', [1, 3])
def test_one_request_leaves_a_rank_idle_for_the_whole_run(k, tiny_ckpt):
    """The seed scenario: dp=2 ep=2, MoE target and MoE MTP layer, exactly one request. The idle
    rank must run dummy target AND draft forwards or the busy rank's all-to-all has no partner."""
    path = tiny_ckpt(True, layout='plain')
    spec = SpeculativeConfig(num_speculative_tokens=k)
    want, _ = single_process(path, spec, PROMPTS[2:3])
    start = time.monotonic()
    responses = run_pipeline(path, dict(dp=2, ep=2), spec, PROMPTS[2:3])
    assert [r.token_ids for r in responses] == want
    assert time.monotonic() - start < 200


@pytest.mark.timeout(300)
def test_staggered_arrivals_and_limits_on_both_ranks(tiny_ckpt):
    """Requests arrive at different times with different lengths and limits, so one rank is in
    prefill while the other decodes, and one hits its length limit while the other drafts."""
    path = tiny_ckpt(True, layout='plain')
    spec = SpeculativeConfig(num_speculative_tokens=3)
    jobs = [(PROMPTS[0], GenerationConfig(max_new_tokens=30, ignore_eos=True), 0.0),
            (PROMPTS[2], GenerationConfig(max_new_tokens=5, ignore_eos=True), 0.2),
            (PROMPTS[1], GenerationConfig(max_new_tokens=17, ignore_eos=True), 0.5),
            (PROMPTS[3], GenerationConfig(max_new_tokens=1, ignore_eos=True), 0.7)]
    want = [single_process(path, spec, [p], g)[0][0] for p, g, _ in jobs]
    results = [None] * len(jobs)
    with pipeline(path, PytorchEngineConfig(dp=2, ep=2, **BASE), spec, progress=False) as pipe:
        def run(i):
            prompt, gen, delay = jobs[i]
            time.sleep(delay)
            results[i] = pipe(prompt, gen).token_ids
        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(240)
        assert not any(t.is_alive() for t in threads), 'a request never finished'
    assert results == want


@pytest.mark.timeout(300)
def test_a_rank_that_skips_its_dummy_draft_is_named_not_hung(tiny_ckpt, monkeypatch):
    monkeypatch.setenv('LMDEPLOY_LITE_DIST_TIMEOUT', '8')
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
    """SIGKILL of one rank: within seconds the loop's error is one line naming the rank and the
    signal (no traceback: it is what the server shows), every live request gets it, and close()
    returns at once leaving no process."""
    path = tiny_ckpt(False, layout='plain')
    pipe = pipeline(path, PytorchEngineConfig(dp=2, **BASE), progress=False)
    loop, procs = pipe._loop, pipe._loop._procs
    try:
        assert pipe(PROMPTS[0], GEN).generate_token_len == GEN.max_new_tokens
        sinks = [queue.Queue() for _ in range(2)]            # one request on each rank
        for prompt, sink in zip(PROMPTS[:2], sinks):
            loop.submit(prompt, GenerationConfig(max_new_tokens=100, ignore_eos=True), sink.put)
        procs[1].kill()
        killed = time.monotonic()
        while loop.error is None and time.monotonic() - killed < 10:
            time.sleep(0.05)
        assert loop.error is not None and time.monotonic() - killed < 5
        message = str(loop.error)
        assert re.fullmatch(rf'rank 1 \(pid {procs[1].pid}\) was killed by signal SIGKILL',
                            message), message
        for sink in sinks:        # tokens may come first; the last item is the error
            items = [sink.get(timeout=5)]
            while not isinstance(items[-1], BaseException):
                items.append(sink.get(timeout=5))
            assert items[-1] is loop.error
        with pytest.raises(RuntimeError, match='rank 1'):
            pipe(PROMPTS[:2], GEN)
    finally:
        start = time.monotonic()
        pipe.close()
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
