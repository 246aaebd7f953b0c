"""pipeline(): batch, streaming, async, prompts, errors; and the generate CLI."""
import asyncio
import os
import shutil
import sys

import pytest

from lmdeploy_lite import GenerationConfig, PytorchEngineConfig, SpeculativeConfig, pipeline

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENGINE = PytorchEngineConfig(dtype='float32', device='cpu', block_size=8, session_len=128,
                             max_batch_size=8)
GEN = GenerationConfig(max_new_tokens=12, ignore_eos=True)


@pytest.fixture(scope='module')
def model_dir(tiny_ckpt, tmp_path_factory):
    """A tiny random checkpoint plus a real BPE tokenizer with a chat template."""
    sys.path.insert(0, os.path.join(ROOT, 'tools'))
    from make_tiny_checkpoint import train_tokenizer
    path = str(tmp_path_factory.mktemp('api') / 'model')
    shutil.copytree(tiny_ckpt(True, layout='multimodal'), path)
    train_tokenizer(path, 512)
    return path


@pytest.fixture(scope='module')
def pipe(model_dir):
    with pipeline(model_dir, ENGINE, progress=False) as p:
        yield p


def test_batch_of_strings_and_token_ids(pipe):
    responses = pipe(['def main(', 'import os'], GEN)
    assert len(responses) == 2
    for r in responses:
        assert r.generate_token_len == len(r.token_ids) == 12 and r.finish_reason == 'length'
        assert r.text == pipe.tokenizer.decode(r.token_ids, skip_special_tokens=True)
    ids = pipe.tokenizer.encode('def main(', add_special_tokens=False)
    single = pipe(ids, GEN)
    assert single.token_ids == responses[0].token_ids and single.input_token_len == len(ids)


def test_stream_infer_adds_up_to_the_batch_result(pipe):
    full = pipe(['class Foo', 'x = 1'], GEN)
    texts, ids = ['', ''], [[], []]
    for chunk in pipe.stream_infer(['class Foo', 'x = 1'], GEN):
        texts[chunk.index] += chunk.text
        ids[chunk.index] += chunk.token_ids
    assert texts == [r.text for r in full] and ids == [r.token_ids for r in full]


def test_chat_messages_go_through_the_template(pipe):
    messages = [{'role': 'user', 'content': 'hello'}]
    r = pipe(messages, GEN)
    prompt = pipe.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                tokenize=True, return_dict=False)
    assert r.input_token_len == len(prompt)


def test_tools_and_tool_calls_go_through_the_template_that_renders_them(pipe):
    tools = [{'type': 'function', 'function': {'name': 'f', 'description': 'g'}}]
    messages = [{'role': 'user', 'content': 'hi'}]
    ids = pipe.encode(messages, tools=tools)
    assert ids == pipe.tokenizer.apply_chat_template(messages, tools=tools, tokenize=True,
                                                     add_generation_prompt=True, return_dict=False)
    assert '<tools>\n{"type": "function", "function": {"name": "f", "description": "g"}}\n' \
           '</tools>' in pipe.tokenizer.decode(ids)
    assert pipe(messages, GEN, tools=tools).input_token_len == len(ids)
    with pytest.raises(ValueError, match='^tools: given with a prompt that is not chat messages'):
        pipe.encode('hi', tools=tools)
    with pytest.raises(ValueError, match=r"^tools=\['f'\]: must be a list of dicts"):
        pipe.encode(messages, tools=['f'])
    called = messages + [{'role': 'assistant', 'content': None, 'tool_calls': [
        {'type': 'function', 'function': {'name': 'f', 'arguments': {'x': 1}}}]}]
    assert '<function=f>\n<parameter=x>\n1\n</parameter>' in pipe.tokenizer.decode(
        pipe.encode(called))
    template = pipe.tokenizer.chat_template
    pipe.tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    try:                                   # a template that would drop them without a word
        with pytest.raises(ValueError, match='^tools: the chat template of .* does not render'):
            pipe.encode(messages, tools=tools)
        with pytest.raises(ValueError, match="^prompt: .* does not render an assistant message"):
            pipe.encode(called)
    finally:
        pipe.tokenizer.chat_template = template


def test_async_generate_and_cancel_frees_the_cache(pipe):
    async def run():
        chunks = [r async for r in pipe.generate('def f(', GEN)]
        gen = pipe.generate('def g(', GenerationConfig(max_new_tokens=100, ignore_eos=True))
        first = await gen.__anext__()
        await gen.aclose()                                       # client went away
        return chunks, first
    chunks, first = asyncio.run(run())
    assert chunks[-1].finish_reason == 'length'
    assert sum(len(c.token_ids) for c in chunks) == 12
    assert first.finish_reason is None
    bm = pipe.engine.scheduler.bm
    for _ in range(100):                                          # the abort lands between steps
        if bm.num_free_blocks == bm.num_usable_blocks:
            break
        import time
        time.sleep(0.05)
    assert bm.num_free_blocks == bm.num_usable_blocks


def test_stop_words_cut_the_text(pipe):
    r = pipe('def main(', GEN)
    # a 3-character stop word from the middle of the output, not starting with whitespace
    word = next((r.text[i:i + 3] for i in range(2, len(r.text) - 2)
                 if r.text[i:i + 3].strip() == r.text[i:i + 3]), '')
    if not word:
        pytest.skip('random text has no usable stop word')
    cut = pipe('def main(', GenerationConfig(max_new_tokens=12, ignore_eos=True,
                                             stop_words=[word]))
    assert cut.finish_reason == 'stop' and word not in cut.text
    assert r.text.startswith(cut.text)


def test_bad_input_raises_before_work_and_others_continue(pipe):
    with pytest.raises(ValueError, match='prompt: empty'):
        pipe(['def ok(', ''], GEN)
    with pytest.raises(ValueError, match='session_len=128'):
        pipe(['x ' * 400], GEN)
    with pytest.raises(ValueError, match='max_new_tokens=0'):
        GenerationConfig(max_new_tokens=0)
    assert pipe('def ok(', GEN).generate_token_len == 12


def test_every_response_says_how_many_prompt_tokens_came_from_the_prefix_cache(pipe):
    """Batch, streamed and async responses all carry num_cached_tokens: an int, and never the
    whole prompt (its last token is always computed, for the first token's logits)."""
    prompts = ['class Bar', 'y = 2']
    batch = pipe(prompts, GEN)
    streamed = list(pipe.stream_infer(prompts, GEN))

    async def run():
        return [r async for r in pipe.generate(prompts[0], GEN)]
    for r in batch + streamed + asyncio.run(run()):
        assert type(r.num_cached_tokens) is int
        assert 0 <= r.num_cached_tokens < r.input_token_len


def test_a_repeated_prompt_is_served_from_the_prefix_cache(pipe):
    """43 tokens, block_size 8: the second time, at least the first full blocks come from the
    cache (batch, streamed and async alike), and the output is the same."""
    prompt = pipe.encode('def main():\n    return cache_me + 1\n' * 8)[:43]
    assert len(prompt) == 43 and ENGINE.block_size == 8
    first = pipe(prompt, GEN)
    again = pipe(prompt, GEN)
    last_chunk = list(pipe.stream_infer(prompt, GEN))[-1]

    async def run():
        return [r async for r in pipe.generate(prompt, GEN)][-1]
    async_last = asyncio.run(run())
    assert again.token_ids == first.token_ids
    for r in (again, last_chunk, async_last):
        assert ENGINE.block_size <= r.num_cached_tokens < len(prompt)


def test_string_prompt_without_tokenizer_is_a_clear_error(tiny_ckpt):
    with pipeline(tiny_ckpt(False, layout='plain'), ENGINE, progress=False) as p:
        assert len(p([5, 6, 7], GEN).token_ids) == 12
        with pytest.raises(ValueError, match='has no tokenizer'):
            p('hello', GEN)


def test_speculative_pipeline_reports_acceptance(model_dir, pipe):
    plain = pipe('def main(', GEN)
    with pipeline(model_dir, ENGINE, SpeculativeConfig(num_speculative_tokens=2),
                  progress=False) as p:
        r = p('def main(', GEN)
    assert r.token_ids == plain.token_ids
    assert r.spec_stats is not None and r.spec_stats.num_drafts > 0


def test_generate_cli(model_dir, capsys):
    """The command's own code, in this process (the module as a program: the chat and server
    tests run `python -m lmdeploy_lite.cli.main`)."""
    from lmdeploy_lite.cli.main import main
    assert main(['generate', model_dir, '--prompt', 'def main(', '--max-new-tokens', '8',
                 '--device', 'cpu', '--speculative-num-draft-tokens', '2']) == 0
    err = capsys.readouterr().err
    assert 'tokens/s' in err and 'mean accepted length' in err


def test_cli_bad_model_dir_is_a_clear_error(tmp_path, capsys):
    from lmdeploy_lite.cli.main import main
    assert main(['generate', str(tmp_path / 'missing'), '--prompt', 'x']) == 2
    assert 'no such directory' in capsys.readouterr().err


# ---- issue 16: bad input, one failing request, a stopped or closed engine --------------------
@pytest.mark.parametrize('prompt,match', [
    (None, r'^prompt: NoneType'), ({'role': 'user', 'content': 'hi'}, r'^prompt: dict'),
    (b'def f', r'^prompt: bytes'), (7, r'^prompt: int'), ([1, 'a'], r"^prompt\[1\]='a'"),
    ([1, 2.5], r'^prompt\[1\]=2.5'), ('a \ud800', r'^prompt: not valid unicode'),
    ([{'role': 'bogus', 'content': 'hi'}], r"^prompt\[0\]\.role='bogus'"),
    ([{'role': 'user', 'content': 5}], r'^prompt\[0\]\.content=5'),
    ([{'role': 'user', 'content': 'hi'}, 'x'], r"^prompt\[1\]='x'"),
])
def test_bad_prompt_shapes_are_value_errors(pipe, prompt, match):
    with pytest.raises(ValueError, match=match):
        pipe(prompt, GEN)
    with pytest.raises(ValueError, match=match):
        list(pipe.stream_infer(prompt, GEN))

    async def run():
        return [r async for r in pipe.generate(prompt, GEN)]
    with pytest.raises(ValueError, match=match):
        asyncio.run(run())
    with pytest.raises(ValueError, match=match):           # in a batch
        pipe(['def ok(', prompt], GEN)


def test_bad_values_raise_before_work_and_the_answer_is_unchanged(pipe):
    before = pipe('def ok(', GEN)
    with pytest.raises(ValueError, match='^top_k='):
        GenerationConfig(top_k=10**309)             # used to kill the engine thread
    bad = GenerationConfig(max_new_tokens=4)
    object.__setattr__(bad, 'top_k', 10**309)       # past the dataclass's own check
    with pytest.raises(ValueError, match='^top_k='):
        pipe('def ok(', bad)
    with pytest.raises(ValueError, match='^gen_config=dict'):
        pipe('def ok(', {'max_new_tokens': 4})
    after = pipe('def ok(', GEN)
    assert after.token_ids == before.token_ids and after.finish_reason == 'length'


def test_sampling_below_the_floors_is_greedy_and_big_values_run(pipe):
    greedy = pipe('def ok(', GEN)
    for cfg in (dict(temperature=1e-300), dict(top_p=1e-300)):   # used to give token 0, 'stop'
        r = pipe('def ok(', GenerationConfig(max_new_tokens=12, ignore_eos=True, do_sample=True,
                                             **cfg))
        assert r.token_ids == greedy.token_ids and r.finish_reason == 'length'
    seeded = dict(max_new_tokens=12, ignore_eos=True, do_sample=True, random_seed=2**64 - 1)
    off = pipe('def ok(', GenerationConfig(top_k=0, **seeded))
    huge = pipe('def ok(', GenerationConfig(top_k=2**31 - 1, **seeded))
    assert huge.token_ids == off.token_ids and len(off.token_ids) == 12


def test_a_bare_stop_word_is_one_word(pipe):
    r = pipe('def main(', GEN)
    # a 3-character word from the middle whose first character also appears before it (split
    # into characters, it used to stop there)
    word = next((r.text[i:i + 3] for i in range(2, len(r.text) - 2)
                 if r.text[i:i + 3].strip() == r.text[i:i + 3] and r.text[i] in r.text[:i]
                 and r.text.find(r.text[i:i + 3]) == i), '')
    if not word:
        pytest.skip('random text has no usable stop word')
    as_str = pipe('def main(', GenerationConfig(max_new_tokens=12, ignore_eos=True,
                                                stop_words=word))
    as_list = pipe('def main(', GenerationConfig(max_new_tokens=12, ignore_eos=True,
                                                 stop_words=[word]))
    assert as_str.token_ids == as_list.token_ids and as_str.text == as_list.text
    assert as_str.finish_reason == 'stop' and r.text.startswith(as_str.text + word)


def _inject(pipe, ids: list[int], gen_config: GenerationConfig, monkeypatch) -> list:
    """Hand a request to the engine thread, as if the caller's checks had passed."""
    got = []
    with monkeypatch.context() as m:
        m.setattr(pipe._client, 'validate_request', lambda *args: None)
        pipe._client.submit_group(ids, gen_config, got.append, tags=[None])
    return got


def test_a_request_failing_in_the_engine_thread_ends_alone(pipe, monkeypatch):
    alone = pipe(['def main(', 'import os'], GEN)
    bad = GenerationConfig(max_new_tokens=12, ignore_eos=True)
    object.__setattr__(bad, 'top_k', 10**309)       # 'int too large to convert to float'
    got = _inject(pipe, pipe.encode('x = 1'), bad, monkeypatch)
    both = pipe(['def main(', 'import os'], GEN)
    assert [r.token_ids for r in both] == [r.token_ids for r in alone]
    for _ in range(100):
        if got:
            break
        import time
        time.sleep(0.05)
    assert len(got) == 1 and got[0].finished and got[0].finish_reason == 'error'
    assert got[0].error.startswith('top_k=')

    real_add = pipe.engine.add_group                 # any failure of one request's set-up
    poison = pipe.encode('import os')

    def add_group(token_ids, gen_config, request_ids=None):
        if token_ids == poison:
            raise RuntimeError('boom')
        return real_add(token_ids, gen_config, request_ids)
    monkeypatch.setattr(pipe.engine, 'add_group', add_group)
    good, failed = pipe(['def main(', 'import os'], GEN)
    assert good.token_ids == alone[0].token_ids and good.finish_reason == 'length'
    assert failed.finish_reason == 'error' and failed.error == 'RuntimeError: boom'
    assert failed.token_ids == [] and failed.generate_token_len == 0
    chunks = list(pipe.stream_infer('import os', GEN))
    assert [c.finish_reason for c in chunks] == ['error']

    async def run():
        return [r async for r in pipe.generate('import os', GEN)]
    assert [r.finish_reason for r in asyncio.run(run())] == ['error']
    monkeypatch.undo()
    again = pipe(['def main(', 'import os'], GEN)
    assert [r.token_ids for r in again] == [r.token_ids for r in alone]


@pytest.fixture
def plain_pipe(tiny_ckpt):
    """A pipeline of its own (these tests stop or close its engine); token-id prompts."""
    with pipeline(tiny_ckpt(False, layout='plain'), ENGINE, progress=False) as p:
        yield p


def test_a_failed_step_stops_the_engine_and_every_waiter_is_told(plain_pipe, monkeypatch):
    """A failure of the step itself belongs to no request: every waiter, queued ones too, gets
    RuntimeError at once (the async generate used to wait forever on a queued request)."""
    import threading
    p = plain_pipe
    assert len(p([5, 6, 7], GEN).token_ids) == 12
    entered, release = threading.Event(), threading.Event()

    def step(*args, **kwargs):
        entered.set()
        release.wait(10)
        raise RuntimeError('forward failed')
    monkeypatch.setattr(p.engine.agent, 'step', step)

    async def run():
        first = asyncio.ensure_future(_collect(p.generate([5, 6, 7], GEN)))
        while not entered.is_set():
            await asyncio.sleep(0.01)
        queued = asyncio.ensure_future(_collect(p.generate([8, 9], GEN)))   # in the inbox
        await asyncio.sleep(0.1)
        release.set()
        return await asyncio.wait_for(asyncio.gather(first, queued, return_exceptions=True), 10)
    results = asyncio.run(run())
    assert all(isinstance(r, RuntimeError) for r in results), results
    assert 'forward failed' in str(p.error)
    with pytest.raises(RuntimeError, match='forward failed'):
        p([5, 6, 7], GEN)
    with pytest.raises(RuntimeError, match='forward failed'):
        asyncio.run(_collect(p.generate([5, 6, 7], GEN)))


async def _collect(responses):
    return [r async for r in responses]


def test_a_closed_pipeline_raises_at_once(plain_pipe):
    p = plain_pipe
    before = p([5, 6, 7], GEN)
    assert len(before.token_ids) == 12
    p.close()
    p.close()                                          # idempotent
    with pytest.raises(RuntimeError, match='the pipeline is closed'):
        p([5, 6, 7], GEN)
    with pytest.raises(RuntimeError, match='the pipeline is closed'):
        list(p.stream_infer([5, 6, 7], GEN))
    with pytest.raises(RuntimeError, match='the pipeline is closed'):
        asyncio.run(asyncio.wait_for(_collect(p.generate([5, 6, 7], GEN)), 10))
    with pytest.raises(RuntimeError, match='the engine is closed'):
        p._client.submit_group([5, 6, 7], GEN, lambda item: None, tags=[None])


def test_a_request_failing_in_a_step_ends_alone(plain_pipe, monkeypatch):
    p = plain_pipe
    alone = p([[5, 6, 7], [8, 9]], GEN)
    checker = p.engine.scheduler.stop_checker
    scan = checker.scan
    poison = [8, 9]

    def failing_scan(seq, tokens):                 # one sequence's host work fails mid-request
        if seq.token_ids[:seq.num_prompt] == poison and seq.num_generated == 2:
            raise RuntimeError('stop check failed')
        return scan(seq, tokens)
    monkeypatch.setattr(checker, 'scan', failing_scan)
    good, failed = p([[5, 6, 7], [8, 9]], GEN)
    assert good.token_ids == alone[0].token_ids and good.finish_reason == 'length'
    assert failed.finish_reason == 'error' and failed.error == 'RuntimeError: stop check failed'
    assert failed.token_ids == alone[1].token_ids[:2] and failed.generate_token_len == 2
    monkeypatch.undo()
    assert [r.token_ids for r in p([[5, 6, 7], [8, 9]], GEN)] == [r.token_ids for r in alone]
    bm = p.engine.scheduler.bm
    assert bm.num_free_blocks == bm.num_usable_blocks


def test_pipeline_leaves_a_core_to_the_caller_once_unless_told(monkeypatch):
    """On CPU, torch's threads drop by one once per process (the caller's thread gets a core);
    not with OMP_NUM_THREADS or on CUDA; `num_threads` sets them."""
    import torch
    from lmdeploy_lite import api
    threads = [4]
    monkeypatch.setattr(torch, 'get_num_threads', lambda: threads[0])
    monkeypatch.setattr(torch, 'set_num_threads', lambda n: threads.__setitem__(0, n))
    monkeypatch.setattr(api, '_CORE_LEFT', [])
    monkeypatch.delenv('OMP_NUM_THREADS', raising=False)
    api.use_cpu_threads('cuda')
    assert threads == [4]
    for _ in range(2):
        api.use_cpu_threads('cpu')
        assert threads == [3]
    api.use_cpu_threads('cpu', num_threads=2)
    assert threads == [2]
    monkeypatch.setattr(api, '_CORE_LEFT', [])
    monkeypatch.setenv('OMP_NUM_THREADS', '4')
    threads[0] = 4
    api.use_cpu_threads('cpu')
    assert threads == [4]
