"""Async scheduling (PytorchEngineConfig.async_scheduling): decode step N+1 is launched before
the host applies step N's results. It must change nothing: the same tokens (greedy, float64) and
the same drafted/accepted counts as the synchronous engine, under speculation, chunked prefill,
forced preemption, stops inside accepted runs, max_new_tokens, seeded sampling and aborts; and
the draft tokens never travel to the host between steps."""
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
@pytest.mark.parametrize('prompts', [PROMPTS[2:3], PROMPTS], ids=['idle_rank', 'both_busy'])
def test_mp_dp2_ep2_async_gives_the_sync_tokens(prompts, tiny_ckpt, monkeypatch):
    """The mp executor, dp=2 ep=2, MTP k=3: one request (rank 1 idles, running dummy forwards
    while rank 0 runs ahead asynchronously) and requests on both ranks; collective check on."""
    import time

    from lmdeploy_lite import pipeline
    monkeypatch.setenv('LMDEPLOY_LITE_CHECK_COLLECTIVES', '1')
    monkeypatch.setenv('LMDEPLOY_LITE_DIST_TIMEOUT', '20')
    path = tiny_ckpt(True, layout='plain')
    want, want_counts, _ = _run(path, 3, False, prompts=prompts)
    start = time.monotonic()
    cfg = PytorchEngineConfig(dtype='float64', device='cpu', block_size=8, session_len=96,
                              dp=2, ep=2, async_scheduling=True)
    with pipeline(path, cfg, SpeculativeConfig(num_speculative_tokens=3), progress=False) as pipe:
        responses = pipe(prompts, GREEDY)
    assert [r.token_ids for r in responses] == want
    assert sum(r.spec_stats.num_accepted_tokens for r in responses) == want_counts[2]
    assert time.monotonic() - start < 200


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
