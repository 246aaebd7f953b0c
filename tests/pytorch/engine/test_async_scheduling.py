"""Async scheduling (PytorchEngineConfig.async_scheduling): decode step N+1 is launched before
the host applies step N's results. It must change nothing: the same tokens (greedy, float64) and
the same drafted/accepted counts as the synchronous engine, under speculation, chunked prefill,
forced preemption, stops inside accepted runs, max_new_tokens, seeded sampling and aborts; and
the draft tokens never travel to the host between steps."""
import itertools
import time

import pytest
import torch

from lmdeploy_lite.messages import GenerationConfig, PytorchEngineConfig, SpeculativeConfig
from lmdeploy_lite.pytorch.engine.engine import Engine

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], list(range(20, 45)), [3] * 9]
GREEDY = GenerationConfig(max_new_tokens=24, ignore_eos=True)


def _engine(path, k: int, async_scheduling: bool, **cfg) -> Engine:
    base = dict(dtype='float64', device='cpu', block_size=8, session_len=96, max_batch_size=8)
    base.update(cfg)
    spec = SpeculativeConfig(num_speculative_tokens=k) if k else None
    return Engine(path, PytorchEngineConfig(async_scheduling=async_scheduling, **base), spec,
                  progress=False)


def _run(path, k, async_scheduling, prompts=PROMPTS, gen=GREEDY, **cfg):
    engine = _engine(path, k, async_scheduling, **cfg)
    seqs = engine.generate(prompts, gen)
    stats = engine.spec_stats
    counts = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens,
              list(stats.accepted_per_position))
    return [s.generated_ids for s in seqs], counts, engine


@pytest.mark.parametrize('k', [0, 1, 3])
@pytest.mark.parametrize('scenario', ['plain', 'chunked_preempted'])
def test_async_changes_no_token_and_no_count(k, scenario, tiny_ckpt, monkeypatch):
    path = tiny_ckpt(True)
    cfg = {} if scenario == 'plain' else dict(max_prefill_token_num=8, num_gpu_blocks=17)
    preemptions = []
    if scenario != 'plain':
        from lmdeploy_lite.pytorch.engine.scheduler import Scheduler
        original = Scheduler._preempt

        def counting(self, seq):
            preemptions.append(seq.seq_id)
            original(self, seq)
        monkeypatch.setattr(Scheduler, '_preempt', counting)
    sync_tokens, sync_counts, _ = _run(path, k, False, **cfg)
    async_tokens, async_counts, engine = _run(path, k, True, **cfg)
    assert async_tokens == sync_tokens
    assert async_counts == sync_counts
    assert engine.num_continued_steps > 0, 'async scheduling never overlapped a step'
    assert all(len(t) == GREEDY.max_new_tokens for t in async_tokens)     # exact
    if scenario != 'plain':
        assert preemptions, 'the cache was meant to be too small for every sequence'


@pytest.mark.parametrize('k', [1, 3])
def test_stop_inside_an_accepted_run_emits_nothing_after_it(k, tiny_ckpt):
    path = tiny_ckpt(True)
    reference, _, _ = _run(path, k, False)
    stop = reference[2][6]                       # a token that sequence 2 emits at position 6
    gen = GenerationConfig(max_new_tokens=24, ignore_eos=True, stop_token_ids=[stop])
    sync_tokens, sync_counts, _ = _run(path, k, False, gen=gen)
    async_tokens, async_counts, _ = _run(path, k, True, gen=gen)
    assert async_tokens == sync_tokens and async_counts == sync_counts
    for tokens in async_tokens:
        assert stop not in tokens[:-1]           # the stop token ends the output
    assert len(async_tokens[2]) <= 7


def test_seeded_sampling_gives_the_same_tokens_and_counts(tiny_ckpt):
    path = tiny_ckpt(True)
    gen = GenerationConfig(max_new_tokens=20, ignore_eos=True, do_sample=True, temperature=1.0,
                           top_k=20, random_seed=7)
    sync_tokens, sync_counts, _ = _run(path, 3, False, gen=gen)
    async_tokens, async_counts, _ = _run(path, 3, True, gen=gen)
    assert async_tokens == sync_tokens and async_counts == sync_counts


@pytest.mark.parametrize('k', [0, 3])
def test_abort_mid_generation(k, tiny_ckpt):
    """Aborting one request mid-run leaves the others' tokens unchanged; the aborted one's
    output is a prefix of what it would have produced."""
    path = tiny_ckpt(True)
    outputs = {}
    for async_scheduling in (False, True):
        engine = _engine(path, k, async_scheduling)
        seqs = [engine.add_request(p, GREEDY) for p in PROMPTS]
        for _ in range(5):
            engine.step()
        engine.abort(seqs[1])
        while engine.has_work:
            engine.step()
        assert seqs[1].finish_reason == 'abort'
        outputs[async_scheduling] = [s.generated_ids for s in seqs]
    full, _, _ = _run(path, k, False)
    for i in (0, 2, 3):
        assert outputs[True][i] == outputs[False][i] == full[i]
    assert full[1][:len(outputs[True][1])] == outputs[True][1]


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


def test_decode_loop_never_reads_drafts_on_the_host(tiny_ckpt):
    path = tiny_ckpt(True)
    engine = _engine(path, 3, True)
    engine.agent.drafts = engine.agent.drafts.as_subclass(_HostReadGuard)
    seqs = engine.generate(PROMPTS, GREEDY)
    assert engine.num_continued_steps > 0
    assert isinstance(engine.agent.drafts, _HostReadGuard)
    assert [s.generated_ids for s in seqs] == _run(path, 3, False)[0]


def test_ngram_runs_synchronously(tiny_ckpt, caplog):
    path = tiny_ckpt(True)
    spec = SpeculativeConfig(method='ngram', num_speculative_tokens=2)
    engine = Engine(path, PytorchEngineConfig(dtype='float64', device='cpu', block_size=8,
                                              session_len=96, async_scheduling=True), spec,
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
    prompts, one, gen = accepting.prompts(), accepting.prompts()[1:2], accepting.GREEDY
    start = time.monotonic()
    cfg = PytorchEngineConfig(dp=2, ep=2, async_scheduling=True, **accepting.BASE)
    with pipeline(accepting.model_dir(), cfg, accepting.spec(k), progress=False) as pipe:
        alone = pipe([list(p) for p in one], gen)
        batch = pipe([list(p) for p in prompts], gen)
        streamed, finals = stream_lagging(pipe, prompts, k, gen)
    assert time.monotonic() - start < 200
    assert_matches_reference(alone, k, one)
    assert_matches_reference(batch, k)
    assert_real_acceptance([c.spec_stats for c in finals], k)
    assert streamed == accepting.reference(k).token_ids
    assert [counts(c.spec_stats) for c in finals] == accepting.reference(k).counts


def test_stop_words_inside_accepted_runs_on_the_embedded_model():
    """A stop word (text) ends the output at the same token with and without async scheduling;
    the embedded model's MTP head accepts runs of drafts, so stops land inside them."""
    from transformers import AutoTokenizer

    from lmdeploy_lite.api import EMBEDDED_MODEL_DIR
    tokenizer = AutoTokenizer.from_pretrained(EMBEDDED_MODEL_DIR)
    prompts = [tokenizer.encode(p) for p in ('def fibonacci(n):\n', 'import os\nimport sys\n',
                                             'class Config:\n    def __init__(self')]
    base = dict(dtype='float32', device='cpu', block_size=16, session_len=256)

    def run(async_scheduling, gen):
        engine = Engine(EMBEDDED_MODEL_DIR, PytorchEngineConfig(
            async_scheduling=async_scheduling, **base), SpeculativeConfig(num_speculative_tokens=3),
            tokenizer=tokenizer, progress=False)
        seqs = engine.generate(prompts, gen)
        return [s.generated_ids for s in seqs], [s.finish_reason for s in seqs]

    free, _ = run(False, GenerationConfig(max_new_tokens=48, ignore_eos=True))
    import re
    words = re.findall(r'[A-Za-z_]{3,}', tokenizer.decode(free[0]))
    assert words, f'the model wrote no word to stop at: {tokenizer.decode(free[0])!r}'
    gen = GenerationConfig(max_new_tokens=48, ignore_eos=True, stop_words=[words[len(words) // 2]])
    sync_tokens, sync_reasons = run(False, gen)
    async_tokens, async_reasons = run(True, gen)
    assert async_tokens == sync_tokens and async_reasons == sync_reasons
    assert sync_reasons[0] == 'stop' and len(sync_tokens[0]) < len(free[0])


def test_default_is_off_on_cpu_and_the_field_is_checked(tiny_ckpt):
    """None (the default) means: on with CUDA, off on CPU, where host and device share cores."""
    engine = Engine(tiny_ckpt(True), PytorchEngineConfig(device='cpu', dtype='float32'),
                    progress=False)
    assert engine.async_scheduling is False
    with pytest.raises(ValueError, match="async_scheduling.*'yes'.*True, False or None"):
        PytorchEngineConfig(async_scheduling='yes')


# ---- what the caller receives (issue 16: Response.token_ids one short under async + MTP) -------
def _embedded_prompts(tokenizer) -> list[list[int]]:
    texts = ('def fibonacci(n):\n', 'import os\nimport sys\n', 'class Config:\n    def __init__(',
             'for i in range(10):\n', 'return self.')
    return [tokenizer.encode(t) for t in texts]


def test_pipeline_delivers_every_token_under_async_speculation(k=3):
    """Through `pipeline()` (an engine thread and a consumer thread), async scheduling with MTP,
    float64, the embedded model (whose MTP head accepts runs of drafts): every Response holds
    the whole sequence the synchronous engine generates, as many ids as generate_token_len, and
    the streamed chunks add up to the same. The bug: a StepOutput read the live Sequence, so a
    consumer one step behind saw the next-to-last chunk as finished and dropped the last one."""
    from transformers import AutoTokenizer

    from lmdeploy_lite import pipeline
    from lmdeploy_lite.api import EMBEDDED_MODEL_DIR
    tokenizer = AutoTokenizer.from_pretrained(EMBEDDED_MODEL_DIR)
    prompts = _embedded_prompts(tokenizer)
    base = dict(dtype='float64', device='cpu', block_size=16, session_len=128)
    spec = SpeculativeConfig(num_speculative_tokens=k)
    reference = Engine(EMBEDDED_MODEL_DIR, PytorchEngineConfig(async_scheduling=False, **base),
                       spec, progress=False)
    want = [s.generated_ids for s in reference.generate(prompts, GREEDY)]
    assert reference.spec_stats.num_accepted_tokens > reference.spec_stats.num_drafts // 2, \
        'the embedded MTP head should accept drafts; this test needs real acceptance'
    with pipeline(None, PytorchEngineConfig(async_scheduling=True, **base), spec,
                  progress=False) as pipe:
        responses = pipe(prompts, GREEDY)
        streamed = [[] for _ in prompts]
        for chunk in pipe.stream_infer(prompts, GREEDY):
            streamed[chunk.index] += chunk.token_ids
        assert pipe.engine.num_continued_steps > 0, 'async scheduling never overlapped a step'
    assert [r.token_ids for r in responses] == want
    assert [r.generate_token_len for r in responses] == [GREEDY.max_new_tokens] * len(prompts)
    assert all(r.finish_reason == 'length' for r in responses)
    assert streamed == want
    assert sum(r.spec_stats.num_accepted_tokens for r in responses) == \
        reference.spec_stats.num_accepted_tokens


@pytest.mark.parametrize('k', [1, 3])
@pytest.mark.parametrize('async_scheduling', [False, True])
def test_step_outputs_are_snapshots_for_a_lagging_consumer(async_scheduling, k, tiny_ckpt):
    """A consumer that reads every StepOutput only after the engine has finished (the most a
    consumer can lag) sees each one as it was: one final output, running totals that grow by
    the emitted tokens, and the tokens adding up to the sequence."""
    from lmdeploy_lite.pytorch.engine.engine_loop import EngineLoop
    engine = _engine(tiny_ckpt(True), k, async_scheduling)
    loop = EngineLoop(engine)
    received = {i: [] for i in range(len(PROMPTS))}
    try:
        handles = [loop.submit(p, GREEDY, received[i].append) for i, p in enumerate(PROMPTS)]
        deadline = time.monotonic() + 120
        while not all(r and not isinstance(r[-1], BaseException) and r[-1].finished
                      for r in received.values()):
            assert time.monotonic() < deadline, 'the engine loop did not finish in 120 s'
            assert loop.error is None, loop.error
            time.sleep(0.05)
    finally:
        loop.close()
    for i, outs in received.items():
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        totals = list(itertools.accumulate(len(o.new_token_ids) for o in outs))
        assert [o.num_generated for o in outs] == totals
        assert sum((o.new_token_ids for o in outs), []) == handles[i].seq.generated_ids
        assert len(handles[i].seq.generated_ids) == GREEDY.max_new_tokens
        assert outs[-1].finish_reason == 'length' and outs[0].finish_reason is None
        drafts = [o.spec_stats.num_drafts if o.spec_stats else 0 for o in outs]
        assert drafts == sorted(drafts) and drafts[0] < drafts[-1]      # counted as they were


def test_remote_outputs_are_snapshots_for_a_lagging_consumer():
    """The mp/ray front-end's collector thread mutates one RemoteSeq per request; what it hands
    the consumer must not change when the next report arrives."""
    import threading

    from lmdeploy_lite.pytorch.engine.executor.mp import RemoteEngineLoop, RemoteHandle, RemoteSeq
    front = object.__new__(RemoteEngineLoop)         # just the collector's bookkeeping
    front._lock, front._load = threading.Lock(), [1]
    received = []
    front._live = {0: RemoteHandle(RemoteSeq(0, 0), received.append)}
    stats = (0, 0, 0, [])
    front._deliver(0, [5], False, None, 1, stats)
    front._deliver(0, [6, 7], False, None, 3, (1, 3, 1, [1, 0, 0]))
    front._deliver(0, [8], True, 'length', 4, (2, 6, 1, [1, 0, 0]))
    assert [(o.new_token_ids, o.finished, o.finish_reason, o.num_generated) for o in received] \
        == [([5], False, None, 1), ([6, 7], False, None, 3), ([8], True, 'length', 4)]
    assert received[0].spec_stats is None and received[1].spec_stats.num_drafts == 1
    assert front._live == {} and front._load == [0]
