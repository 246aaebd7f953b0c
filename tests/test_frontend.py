"""The front-end's host path: one message per engine step whatever the batch (uni and mp rank
loops), text decoded incrementally in bulk, and streamed output equal to non-streamed output
(text and token ids), stop words inside accepted speculative runs included."""
import asyncio
import queue
import threading

import pytest

from helpers.accepting import (BASE, assert_real_acceptance, many_prompts, model_dir, prompts,
                               spec)
from lmdeploy_lite import api
from lmdeploy_lite.api import EMBEDDED_MODEL_DIR, pipeline
from lmdeploy_lite.text_stream import TextStream, batch_decoder, detokenize
from lmdeploy_lite.messages import GenerationConfig, PytorchEngineConfig

K = 3
GEN = GenerationConfig(max_new_tokens=24, ignore_eos=True)


@pytest.fixture(scope='module')
def spec_pipe():
    """The embedded model with its tokenizer and MTP k=3 (float64: the drafts get accepted)."""
    p = pipeline(EMBEDDED_MODEL_DIR, PytorchEngineConfig(**BASE, max_batch_size=64),
                 spec(K), progress=False)
    yield p
    p.close()


def _count_steps(monkeypatch, engine) -> list[int]:
    """[steps that emitted outputs]: Engine.step wrapped."""
    steps = [0]
    step = engine.step

    def counted():
        outputs = step()
        steps[0] += bool(outputs)
        return outputs
    monkeypatch.setattr(engine, 'step', counted)
    return steps


def test_one_message_per_step_for_a_batch_of_64(spec_pipe, monkeypatch):
    posts = []

    class CountingChannel(api.Channel):
        def __init__(self, post):
            super().__init__(lambda items: (posts.append(len(items)), post(items)))
    monkeypatch.setattr(api, 'Channel', CountingChannel)
    steps = _count_steps(monkeypatch, spec_pipe.engine)
    gen = GenerationConfig(max_new_tokens=8, ignore_eos=True)
    streamed = list(spec_pipe.stream_infer([list(p) for p in many_prompts(64)], gen))
    tokens = sum(len(r.token_ids) for r in streamed)
    assert tokens == 64 * 8
    assert_real_acceptance([r.spec_stats for r in streamed if r.finish_reason], K)
    assert len(posts) == steps[0], f'{len(posts)} messages for {steps[0]} steps'
    assert sum(posts) == len(streamed)                  # each holds that step's outputs, all
    assert max(posts) == 64 and len(posts) <= 1 + 8     # (a prefill step, then <= 8 decodes)
    posts.clear()
    final = spec_pipe([list(p) for p in many_prompts(64)], gen)       # not streamed: the same
    assert len(posts) <= 1 + 8 and [r.token_ids for r in final] == _joined(streamed, 64)[1]


def test_mp_rank_loop_sends_one_message_per_step():
    """Every rank's loop (here in a thread over a one-rank engine): one outbox message per
    step carrying every request's report of that step: (request id, StepOutput), the one output
    type, which pickles without its Sequence."""
    from lmdeploy_lite.pytorch.engine.build import build_engine
    from lmdeploy_lite.pytorch.engine.executor.rank_worker import rank_loop
    engine = build_engine(model_dir(), PytorchEngineConfig(**BASE, max_batch_size=64), spec(K),
                    progress=False)
    inbox, outbox = queue.Queue(), queue.Queue()
    gen = GenerationConfig(max_new_tokens=8, ignore_eos=True)
    for rid, p in enumerate(many_prompts(64)):
        inbox.put(('add', ([rid], list(p), gen, [None])))
    thread = threading.Thread(target=rank_loop, args=(0, engine, inbox, outbox.put), daemon=True)
    thread.start()
    messages, finished = [], set()
    while len(finished) < 64:
        kind, rank, (reports, _) = outbox.get(timeout=120)     # (reports, prefix-cache news)
        assert kind == 'out' and rank == 0
        messages.append(reports)
        finished |= {rid for rid, out in reports if out.finished}
    inbox.put(('stop', None))
    thread.join(60)
    assert not thread.is_alive(), 'the rank loop did not stop'
    assert len(messages) == engine.num_steps <= 1 + 8
    assert sum(len(out.new_token_ids) for m in messages for _, out in m) == 64 * 8
    assert max(len(m) for m in messages) == 64
    import pickle
    rid, out = messages[-1][-1]
    back = pickle.loads(pickle.dumps(out))
    assert out.seq is not None and back.seq is None
    assert [getattr(back, f) for f in out.__slots__[1:]] == [getattr(out, f) for f in
                                                             out.__slots__[1:]]


def _joined(chunks, n: int) -> tuple[list[str], list[list[int]], list]:
    texts, ids, finals = [''] * n, [[] for _ in range(n)], [None] * n
    for c in chunks:
        texts[c.index] += c.text
        ids[c.index] += c.token_ids
        if c.finish_reason is not None:
            assert finals[c.index] is None, f'request {c.index} finished twice'
            finals[c.index] = c
    return texts, ids, finals


def _stop_words_inside_runs(tokenizer, ids: list[int], steps: list[int]) -> list[str]:
    """Words whose first appearance in decode(ids) ends with a token strictly inside one step's
    emission of accepted drafts (neither its first nor its last token)."""
    words, start = [], 0
    for n in steps:
        for pos in range(start + 1, start + n - 1):
            before, now = tokenizer.decode(ids[:pos]), tokenizer.decode(ids[:pos + 1])
            word = now[len(before):]
            if word.strip() and now.find(word) == len(before):
                words.append(word)
        start += n
    return words


async def _generate_all(pipe, prompt_ids, gen, stream_text: bool):
    async def one(ids):
        text, tokens, last = '', [], None
        async for r in pipe.generate(list(ids), gen, stream_text=stream_text):
            text, tokens, last = text + r.text, tokens + r.token_ids, r
        return text, tokens, last.finish_reason
    return await asyncio.gather(*(one(ids) for ids in prompt_ids))


def test_streamed_output_equals_non_streamed_with_stop_words_inside_accepted_runs(spec_pipe):
    tokenizer = spec_pipe.tokenizer
    batch = [list(p) for p in prompts()]
    free = list(spec_pipe.stream_infer(batch, GEN))
    texts, ids, finals = _joined(free, len(batch))
    assert_real_acceptance([f.spec_stats for f in finals], K)
    steps = [[len(c.token_ids) for c in free if c.index == i and c.token_ids]
             for i in range(len(batch))]
    stop_words = []               # one per prompt whose output has a fresh word inside a run
    for i in range(len(batch)):
        words = _stop_words_inside_runs(tokenizer, ids[i], steps[i])
        stop_words += words[len(words) // 2:][:1]
    assert len(stop_words) >= 2, f'too few stop words inside accepted runs: {stop_words}'
    gen = GenerationConfig(max_new_tokens=24, ignore_eos=True, stop_words=stop_words)

    streamed = _joined(spec_pipe.stream_infer(batch, gen), len(batch))
    whole = spec_pipe(batch, gen)
    served = asyncio.run(_generate_all(spec_pipe, batch, gen, stream_text=True))
    served_at_end = asyncio.run(_generate_all(spec_pipe, batch, gen, stream_text=False))
    inside = 0
    for i, r in enumerate(whole):
        s_text, s_ids, s_final = streamed[0][i], streamed[1][i], streamed[2][i]
        assert (s_text, s_ids, s_final.finish_reason) == (r.text, r.token_ids, r.finish_reason)
        assert served[i] == served_at_end[i] == (r.text, r.token_ids, r.finish_reason)
        assert r.token_ids == ids[i][:len(r.token_ids)]
        if not any(w in texts[i] for w in stop_words):
            assert r.finish_reason == 'length' and r.text == texts[i]
            continue
        full = tokenizer.decode(r.token_ids)
        cut = min(full.find(w) for w in stop_words if w in full)
        assert r.finish_reason == 'stop' and r.text == full[:cut]
        assert not any(w in r.text for w in stop_words)
        ends = [sum(steps[i][:j + 1]) for j in range(len(steps[i]))]
        inside += len(r.token_ids) not in ends and len(s_final.token_ids) >= 2
    assert inside >= 2, 'the stops should fall inside accepted runs'


def test_text_stream_matches_whole_decode_token_by_token():
    """Multi-byte characters split over tokens and stop words split over tokens: the streamed
    deltas join to the whole decode cut at the stop word, and no delta holds half a character
    or the start of a stop word that then completes."""
    tokenizer = api.load_tokenizer(EMBEDDED_MODEL_DIR)
    decode = batch_decoder(tokenizer)
    text = 'naïve café — 数据并行 🙂🙃 def f(x):\n    return x  # END of it'
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    for words in ((), ('# END',), ('并行',), ('🙃',)):
        gen = GenerationConfig(stop_words=list(words) or None)
        stream, deltas = TextStream(gen, stream=True), []
        for j, token in enumerate(ids):
            deltas += detokenize(decode, [(stream, [token], j == len(ids) - 1)])
        cut = min([text.find(w) for w in words] + [len(text)])
        assert ''.join(deltas) == text[:cut]
        assert not any('\ufffd' in d for d in deltas)    # (deltas only grow the text: none
                                                         # went past the cut either)


def test_a_consumer_that_fell_behind_gets_the_missed_steps_in_one_response():
    """The server's event loop can fall behind the engine, or a stream's client behind it: what
    a request's consumer has not taken is one Backlog (text, ids and logprobs joined in order)
    however many steps it missed, its consumer is told once, and an error that comes after it
    is raised after it."""
    from types import SimpleNamespace

    from lmdeploy_lite.api import _AsyncRequest, _News

    def out(ids, finished=False):
        return SimpleNamespace(new_token_ids=ids, finished=finished,
                               logprobs=[(-t, [t], [-t]) for t in ids])

    async def run():
        news = _News()
        request = _AsyncRequest(GenerationConfig(), True, 3, news)
        for step in range(200):                       # the consumer misses 200 steps
            request.put((out([step]), 'ab'[step % 2]))
        assert list(news.ready) == [3] and await news.get() == 3   # told once
        backlog, error = request.take()
        assert (backlog.text, backlog.token_ids, error) == ('ab' * 100, list(range(200)), None)
        assert backlog.logprobs == out(list(range(200))).logprobs
        assert request.take() == (None, None) and not news.ready
        failure = RuntimeError('engine stopped')
        request.put((out([1]), 'a'))
        request.put((out([2], True), 'b'))
        request.put(failure)
        backlog, error = request.take()
        assert (backlog.text, backlog.token_ids, backlog.last.finished, error) == \
            ('ab', [1, 2], True, failure)
        assert list(news.ready) == [3]
    asyncio.run(run())


def test_an_engine_in_its_own_process_streams_what_the_thread_engine_does(spec_pipe):
    """`engine_process=True` (the server's default): a one-rank engine in the mp
    executor's rank process gives the same text, ids, finish reasons and accepted counts as the
    engine in a thread, through the async path the server uses; logprobs travel home too."""
    batch = [list(p) for p in prompts()]
    want = asyncio.run(_generate_all(spec_pipe, batch, GEN, stream_text=True))
    with_logprobs = GenerationConfig(max_new_tokens=24, ignore_eos=True, logprobs=3)
    with pipeline(EMBEDDED_MODEL_DIR, PytorchEngineConfig(**BASE, max_batch_size=64), spec(K),
                  progress=False, engine_process=True) as pipe:
        assert pipe.engine is None                     # no engine in this process
        got = asyncio.run(_generate_all(pipe, batch, GEN, stream_text=True))
        finals = pipe(batch, GEN)
        remote = pipe(batch, with_logprobs)
    assert_real_acceptance([f.spec_stats for f in finals], K)
    assert got == want
    assert [(r.text, r.token_ids, r.finish_reason) for r in finals] == want
    local = spec_pipe(batch, with_logprobs)
    assert [len(r.logprobs) for r in remote] == [len(r.token_ids) for r in remote] == [24] * 4
    assert [r.token_ids for r in remote] == [r.token_ids for r in local]
    # float32: within 1e-4, not bit for bit (a prefix-cache hit in one engine and not in the
    # other prefills in other chunks, which rounds differently)
    for r, l in zip(remote, local):                   # same lengths: asserted above
        for a, b in zip(r.logprobs, l.logprobs):
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
            assert list(a.top_logprobs) == list(b.top_logprobs)
            assert max(abs(a.top_logprobs[t] - b.top_logprobs[t]) for t in a.top_logprobs) < 1e-4
