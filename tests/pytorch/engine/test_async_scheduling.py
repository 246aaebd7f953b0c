"""Async scheduling (PytorchEngineConfig.async_scheduling): decode step N+1 is launched before
the host applies step N's results. It must change nothing: the same whole sequences (greedy:
plain greedy's) and the same per-request drafted/accepted counts, positions included, as the
synchronous engine, under speculation, chunked prefill, forced preemption, stops inside accepted
runs, seeded sampling and aborts; and the draft tokens never travel to the host between steps.
The model is the embedded one (tests/helpers/accepting): its MTP head's drafts are mostly
accepted, and every speculative test asserts that first, so none of them can pass on the
reject-all path alone. One test runs in float64; the rest in float32 (twice as fast): async and
sync run the same kernels on the same shapes, so they agree bit for bit, and on this trained
model float32 speculative output equals float32 plain greedy."""
import itertools
import time

import pytest
import torch

from lmdeploy_lite.api import EMBEDDED_MODEL_DIR
from lmdeploy_lite.messages import GenerationConfig, PytorchEngineConfig, SpeculativeConfig
from lmdeploy_lite.pytorch.engine.build import build_engine
from lmdeploy_lite.pytorch.engine.engine import Engine
from tests.helpers import accepting
from tests.helpers.accepting import assert_real_acceptance, counts, reference

# 16 new tokens (accepting.GREEDY's 24 less a third of the steps): every sequence still runs
# several verify steps with accepted drafts at every position (mean accepted length 1.82 at
# k=1, 2.95 at k=3, above accepting's floors), stops inside accepted runs and preemptions
GREEDY = GenerationConfig(max_new_tokens=16, ignore_eos=True)

FLOAT32 = dict(dtype='float32')
# a cache too small for every sequence at once (preemptions) and prompts prefilled in chunks.
# Without the prefix cache: a hit makes a recompute shorter, which moves later preemptions, and
# a sequence recomputed after it generated starts its verify windows elsewhere (other accepted
# counts, the same tokens); async scheduling reserves blocks ahead, so the two engines would
# preempt at different steps. The prefix cache under async scheduling: test_prefix_cache.py.
CHUNKED_PREEMPTED = dict(FLOAT32, block_size=8, session_len=64, max_prefill_token_num=8,
                         num_gpu_blocks=10, enable_prefix_caching=False)


def _prompts() -> list[list[int]]:
    return [list(p) for p in accepting.prompts()]


def _reference(k: int, gen: GenerationConfig = GREEDY, **cfg) -> accepting.Reference:
    """The synchronous engine's run (cached), float32 unless cfg says otherwise."""
    return reference(k, gen=gen, **{**FLOAT32, **cfg})


def _engine(k: int, async_scheduling: bool, **cfg) -> Engine:
    """The embedded model with MTP k (0: plain), accepting.BASE in float32 updated by cfg;
    max_batch_size the number of prompts (as the reference's: accepting.reference)."""
    config = PytorchEngineConfig(async_scheduling=async_scheduling,
                                 **{**accepting.BASE, **FLOAT32,
                                    'max_batch_size': len(_prompts()), **cfg})
    return build_engine(EMBEDDED_MODEL_DIR, config, accepting.spec(k), progress=False)


def _run_async(k: int, gen: GenerationConfig = GREEDY, **cfg):
    """(token ids per prompt, SpecDecodeStats per prompt, engine) with async scheduling on."""
    engine = _engine(k, True, **cfg)
    seqs = engine.generate(_prompts(), gen)
    assert engine.num_continued_steps > 0, 'async scheduling never overlapped a step'
    return [s.generated_ids for s in seqs], [s.spec_stats if k else None for s in seqs], engine


@pytest.mark.parametrize('scenario, k', [('float64', 0), ('float64', 1), ('float64', 3),
                                         ('chunked_preempted', 1), ('chunked_preempted', 3)])
def test_async_changes_no_token_and_no_count(scenario, k, monkeypatch):
    cfg = dict(dtype='float64') if scenario == 'float64' else CHUNKED_PREEMPTED
    sync = _reference(k, **cfg)                  # the synchronous engine, same config
    tokens, stats, engine = _run_async(k, **cfg)
    if k:
        assert_real_acceptance(stats, k)
    assert tokens == sync.token_ids == _reference(0, dtype=cfg['dtype']).token_ids
    assert all(len(t) == GREEDY.max_new_tokens for t in tokens)           # whole sequences
    assert [counts(s) for s in stats] == sync.counts
    if scenario != 'float64':
        assert engine.scheduler.num_preemptions, 'the cache was meant to be too small for ' \
            'every sequence'


@pytest.mark.parametrize('k', [1, 3])
def test_stop_inside_an_accepted_run_emits_nothing_after_it(k):
    """A stop token that the synchronous engine emits in the middle of a step's run of accepted
    drafts: every sequence ends at its first occurrence (plain greedy cut there), nothing of the
    run after it is emitted, and the counts match the synchronous engine's."""
    stop, position = _reference(k).stop_inside_accepted_run(1)
    gen = GenerationConfig(max_new_tokens=GREEDY.max_new_tokens, ignore_eos=True,
                           stop_token_ids=[stop])
    want = [t[:t.index(stop) + 1] if stop in t else t for t in _reference(0).token_ids]
    assert len(want[1]) == position + 1
    sync = _reference(k, gen)
    tokens, stats, _ = _run_async(k, gen)
    assert_real_acceptance(stats, k)
    assert tokens == sync.token_ids == want
    assert [counts(s) for s in stats] == sync.counts


@pytest.mark.parametrize('k', [1, 3])
def test_seeded_sampling_gives_the_same_tokens_and_counts(k):
    gen = GenerationConfig(max_new_tokens=GREEDY.max_new_tokens, ignore_eos=True, do_sample=True,
                           temperature=0.7,
                           top_k=20, random_seed=7)
    sync = _reference(k, gen)
    tokens, stats, _ = _run_async(k, gen)
    assert_real_acceptance(stats, k)
    assert tokens == sync.token_ids and [counts(s) for s in stats] == sync.counts
    assert tokens != _reference(k).token_ids                 # it did sample


@pytest.mark.parametrize('k', [0, 3])
def test_abort_mid_generation(k):
    """Aborting one request mid-run leaves the others' tokens and counts unchanged; the aborted
    one's output is a prefix of what it would have produced (how long a prefix differs: the
    async engine has launched one step more when the abort arrives)."""
    outputs = {}
    for async_scheduling in (False, True):
        engine = _engine(k, async_scheduling)
        seqs = [engine.add_request(p, GREEDY) for p in _prompts()]
        for _ in range(4):
            engine.step()
        engine.abort(seqs[1])
        while engine.has_work:
            engine.step()
        assert seqs[1].finish_reason == 'abort'
        outputs[async_scheduling] = [(s.generated_ids, counts(s.spec_stats if k else None))
                                     for s in seqs]
    if k:
        assert_real_acceptance([s.spec_stats for s in seqs], k)
    full = _reference(0).token_ids
    for i in (0, 2, 3):
        assert outputs[True][i] == outputs[False][i] == (full[i], _reference(k).counts[i])
    for aborted, _ in (outputs[False][1], outputs[True][1]):
        assert 0 < len(aborted) < len(full[1]) and full[1][:len(aborted)] == aborted


class _HostReadGuard(torch.Tensor):
    """The draft table: reading it (or an index of it) on the host raises; any other op
    returns a plain tensor."""
    HOST_READS = {'tolist', 'item', 'cpu', 'numpy', '__bool__', '__int__', '__index__'}

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, '__name__', '')
        if name in cls.HOST_READS:
            raise AssertionError(f'the draft tokens were read on the host ({name})')
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **(kwargs or {}))
        if name == '__getitem__':
            return out.as_subclass(cls)
        return out


@pytest.mark.parametrize('k', [1, 3])
def test_decode_loop_never_reads_drafts_on_the_host(k):
    engine = _engine(k, True)
    engine.agent.drafts = engine.agent.drafts.as_subclass(_HostReadGuard)
    seqs = engine.generate(_prompts(), GREEDY)
    assert engine.num_continued_steps > 0
    assert isinstance(engine.agent.drafts, _HostReadGuard)
    assert_real_acceptance([s.spec_stats for s in seqs], k)
    assert [s.generated_ids for s in seqs] == _reference(0).token_ids
    assert [counts(s.spec_stats) for s in seqs] == _reference(k).counts


def test_ngram_runs_synchronously(caplog):
    spec = SpeculativeConfig(method='ngram', num_speculative_tokens=2)
    engine = build_engine(EMBEDDED_MODEL_DIR, PytorchEngineConfig(**accepting.BASE,
                                                            async_scheduling=True), spec,
                    progress=False)
    assert engine.async_scheduling is False
    assert 'ngram' in caplog.text


@pytest.mark.timeout(300)
def test_mp_dp2_ep2_async_gives_the_sync_tokens(monkeypatch, k=3):
    """The mp executor, dp=2 ep=2, async scheduling, MTP k=3, the embedded model (its drafts are
    mostly accepted, asserted first): one request (rank 1 idles, running dummy forwards while
    rank 0 runs ahead asynchronously), a batch on both ranks, and the batch streamed to a
    consumer that lags behind the front-end's collector thread; whole sequences and per-request
    draft counts equal the synchronous single process's (= plain greedy); collective check on."""
    from lmdeploy_lite import pipeline
    from tests.helpers import accepting
    from tests.helpers.accepting import (assert_matches_reference, assert_real_acceptance, counts,
                                         stream_lagging)
    monkeypatch.setenv('LMDEPLOY_LITE_CHECK_COLLECTIVES', '1')
    monkeypatch.setenv('LMDEPLOY_LITE_DIST_TIMEOUT', '20')
    prompts, one, gen = accepting.prompts(), accepting.prompts()[1:2], GREEDY
    start = time.monotonic()
    cfg = PytorchEngineConfig(dp=2, ep=2, async_scheduling=True, **accepting.BASE)
    with pipeline(accepting.model_dir(), cfg, accepting.spec(k), progress=False) as pipe:
        alone = pipe([list(p) for p in one], gen)
        batch = pipe([list(p) for p in prompts], gen)
        streamed, finals = stream_lagging(pipe, prompts, k, gen)
    assert time.monotonic() - start < 200
    assert_matches_reference(alone, k, one, gen)
    assert_matches_reference(batch, k, None, gen)
    assert_real_acceptance([c.spec_stats for c in finals], k)
    assert streamed == accepting.reference(k, gen=gen).token_ids
    assert [counts(c.spec_stats) for c in finals] == accepting.reference(k, gen=gen).counts


def _stop_word_inside_accepted_run(ref, i: int, tokenizer) -> tuple[str, int]:
    """(word, position): a token's text (2+ characters) that first appears in sequence i's
    output at that token, which a step emitted with tokens after it."""
    ids, ends = ref.token_ids[i], []
    for n in ref.chunks[i]:
        ends += [False] * (n - 1) + [True]
    for pos in range(len(ids)):
        word = tokenizer.decode(ids[pos:pos + 1]).strip()
        if not ends[pos] and len(word) >= 2 and word not in tokenizer.decode(ids[:pos]):
            return word, pos
    raise AssertionError(f'sequence {i}: no word to stop at inside an accepted run')


def test_stop_words_inside_accepted_runs():
    """A stop word (text) that the synchronous engine completes in the middle of a step's run of
    accepted drafts ends the output at that token, with and without async scheduling."""
    tokenizer = accepting._tokenizer()
    word, position = _stop_word_inside_accepted_run(_reference(3), 1, tokenizer)
    gen = GenerationConfig(max_new_tokens=GREEDY.max_new_tokens, ignore_eos=True,
                           stop_words=[word])
    runs = []
    for async_scheduling in (False, True):
        engine = build_engine(EMBEDDED_MODEL_DIR, PytorchEngineConfig(
            async_scheduling=async_scheduling, **{**accepting.BASE, **FLOAT32}),
            accepting.spec(3), tokenizer=tokenizer, progress=False)
        seqs = engine.generate(_prompts(), gen)
        assert_real_acceptance([s.spec_stats for s in seqs], 3)
        runs.append([(s.generated_ids, s.finish_reason, counts(s.spec_stats)) for s in seqs])
    assert runs[0] == runs[1]
    plain = _reference(0).token_ids
    assert all(plain[i][:len(ids)] == ids for i, (ids, _, _) in enumerate(runs[1]))
    assert runs[1][1][:2] == (plain[1][:position + 1], 'stop')


def test_default_is_off_on_cpu_and_the_field_is_checked():
    """None (the default) means: on with CUDA, off on CPU, where host and device share cores."""
    engine = build_engine(EMBEDDED_MODEL_DIR, PytorchEngineConfig(device='cpu', dtype='float32'),
                    progress=False)
    assert engine.async_scheduling is False
    with pytest.raises(ValueError, match="async_scheduling.*'yes'.*True, False or None"):
        PytorchEngineConfig(async_scheduling='yes')


# ---- what the caller receives (issue 16: Response.token_ids one short under async + MTP) -------
def test_pipeline_delivers_every_token_under_async_speculation(k=3):
    """Through `pipeline()` (an engine thread and a consumer thread), async scheduling with MTP,
    the embedded model: every Response holds the whole sequence plain greedy gives, as
    many ids as generate_token_len, the draft counts of the synchronous engine, and the streamed
    chunks add up to the same. The bug: a StepOutput read the live Sequence, so a consumer one
    step behind saw the next-to-last chunk as finished and dropped the last one. (k=1: the
    lagging-consumer tests below.)"""
    from lmdeploy_lite import pipeline
    want = _reference(0).token_ids
    config = PytorchEngineConfig(async_scheduling=True, **{**accepting.BASE, **FLOAT32})
    with pipeline(None, config, accepting.spec(k), progress=False) as pipe:
        responses = pipe(_prompts(), GREEDY)
        streamed, finals = [[] for _ in want], [None] * len(want)
        for chunk in pipe.stream_infer(_prompts(), GREEDY):
            streamed[chunk.index] += chunk.token_ids
            if chunk.finish_reason is not None:
                finals[chunk.index] = chunk
        assert pipe.engine.num_continued_steps > 0, 'async scheduling never overlapped a step'
    assert_real_acceptance([r.spec_stats for r in responses], k)
    assert [r.token_ids for r in responses] == want
    assert [r.generate_token_len for r in responses] == [GREEDY.max_new_tokens] * len(want)
    assert all(r.finish_reason == 'length' for r in responses)
    assert [counts(r.spec_stats) for r in responses] == _reference(k).counts
    assert streamed == want
    assert [counts(c.spec_stats) for c in finals] == _reference(k).counts


@pytest.mark.parametrize('k', [1, 3])
@pytest.mark.parametrize('async_scheduling', [False, True])
def test_step_outputs_are_snapshots_for_a_lagging_consumer(async_scheduling, k):
    """A consumer that reads every StepOutput only after the engine has finished (the most a
    consumer can lag) sees each one as it was: one final output, running totals that grow by
    the emitted tokens (several per step: accepted drafts), and the tokens adding up to the
    sequence."""
    from lmdeploy_lite.pytorch.engine.executor.thread import EngineLoop
    engine = _engine(k, async_scheduling)
    loop = EngineLoop(engine)
    prompts = _prompts()
    received = {i: [] for i in range(len(prompts))}
    try:
        for i, p in enumerate(prompts):
            loop.submit_group(p, GREEDY, received[i].append, tags=[i])
        deadline = time.monotonic() + 120
        while not all(r and not isinstance(r[-1], BaseException) and r[-1].finished
                      for r in received.values()):
            assert time.monotonic() < deadline, 'the engine loop did not finish in 120 s'
            assert loop.error is None, loop.error
            time.sleep(0.05)
    finally:
        loop.close()
    seqs = [received[i][-1].seq for i in range(len(prompts))]    # in this process: the live one
    assert_real_acceptance([seq.spec_stats for seq in seqs], k)
    for i, outs in received.items():
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        totals = list(itertools.accumulate(len(o.new_token_ids) for o in outs))
        assert [o.num_generated for o in outs] == totals
        assert sum((o.new_token_ids for o in outs), []) == seqs[i].generated_ids \
            == _reference(0).token_ids[i]
        assert max(len(o.new_token_ids) for o in outs) > 1
        assert outs[-1].finish_reason == 'length' and outs[0].finish_reason is None
        drafts = [o.spec_stats.num_drafts if o.spec_stats else 0 for o in outs]
        assert drafts == sorted(drafts) and drafts[0] < drafts[-1]      # counted as they were
        assert counts(outs[-1].spec_stats) == _reference(k).counts[i]


def test_remote_outputs_are_snapshots_for_a_lagging_consumer():
    """The front-end's collector thread keeps one RequestHandle per request; what it hands the
    consumer must not change when the next report arrives."""
    import threading

    from lmdeploy_lite.pytorch.engine.executor.client import RankClient, RequestHandle
    front = object.__new__(RankClient)               # just the collector's bookkeeping
    front._lock, front._load = threading.Lock(), [1]
    received = []
    front._live = {0: RequestHandle(0, 0, received.append)}
    from lmdeploy_lite.pytorch.engine.step_output import StepOutput

    def report(new_ids, finished, reason, num_generated, stats, logprobs):
        """A StepOutput as a rank's pickle brings it (no Sequence)."""
        out = StepOutput.__new__(StepOutput)
        out.__setstate__(dict(new_token_ids=new_ids, finished=finished, finish_reason=reason,
                              num_generated=num_generated, error=None, stats_snapshot=stats,
                              num_cached_tokens=16, hidden_states_path=None, logprobs=logprobs))
        return out
    front._deliver([(0, report([5], False, None, 1, None, None))])        # one per step
    front._deliver([(0, report([6, 7], False, None, 3, (1, 3, 1, (1, 0, 0), (1, 1, 1)),
                               [(-0.5, [6], [-0.5]), (-1.5, [2], [-0.25])]))])
    front._deliver([(0, report([8], True, 'length', 4, (2, 6, 1, (1, 0, 0), (2, 2, 2)), None))])
    assert [(o.new_token_ids, o.finished, o.finish_reason, o.num_generated) for o in received] \
        == [([5], False, None, 1), ([6, 7], False, None, 3), ([8], True, 'length', 4)]
    assert [o.num_cached_tokens for o in received] == [16, 16, 16]
    assert [o.logprobs for o in received] == [None, [(-0.5, [6], [-0.5]), (-1.5, [2], [-0.25])],
                                              None]
    assert received[0].spec_stats is None and received[1].spec_stats.num_drafts == 1
    assert front._live == {} and front._load == [0]
