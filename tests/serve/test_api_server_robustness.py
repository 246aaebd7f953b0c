"""No request can take the server down, and nothing a request asks for is silently dropped (issue
16, the server part): through the real server, each bad request is answered with an OpenAI-style
JSON error naming what is wrong, and is followed by a valid request that must still get exactly
the answer it got before. Then the process side: a failed generation, a dead engine, SIGINT and
SIGTERM, and a fuzz test."""
import asyncio
import json
import os
import random
import signal
import threading
import time
from types import SimpleNamespace

import pytest

for _module in ('fastapi', 'uvicorn', 'prometheus_client'):
    pytest.importorskip(_module, reason="needs the 'serve' extra")
openai = pytest.importorskip('openai')
httpx = pytest.importorskip('httpx')

from lmdeploy_lite.api import Pipeline  # noqa: E402
from lmdeploy_lite.pytorch.engine.executor.client import EngineStats  # noqa: E402
from tests.serve.live_server import (MODEL, SESSION_LEN, chat, headers,  # noqa: E402
                                     left_alive, post, scrape, sse_events,
                                     stream_in_background)

LIMIT = 4 * 2**20                     # the default --max-request-bytes
REFERENCE = {'prompt': 'def main(', 'max_tokens': 6, 'temperature': 0, 'ignore_eos': True}


@pytest.fixture(scope='module')
def reference(server) -> dict:
    """The greedy answer to REFERENCE before any test of this file sent anything odd."""
    return post(server, '/v1/completions', REFERENCE).json()


def answer(response: httpx.Response) -> tuple[str, int, str]:
    assert response.status_code == 200, response.text
    body = response.json()
    return (body['choices'][0]['text'], body['usage']['completion_tokens'],
            body['choices'][0]['finish_reason'])


def assert_serves_as_before(server, reference: dict):
    assert httpx.get(server.url + '/health', timeout=10).status_code == 200
    assert answer(post(server, '/v1/completions', REFERENCE)) == (
        reference['choices'][0]['text'], REFERENCE['max_tokens'], 'length')


def assert_error(response: httpx.Response, status: int, param: str | None, *fragments: str):
    assert response.status_code == status, response.text
    error = response.json()['error']
    assert error['param'] == param, error
    for fragment in fragments:
        assert fragment in error['message'], (fragment, error)
    return error


# ---- 1. numbers: finite, and inside explicit ranges -------------------------------------------
@pytest.mark.timeout(60)
def test_the_issues_top_k_1e309_gets_400_and_the_engine_lives(server, reference):
    body = '{"prompt":"def f","max_tokens":4,"temperature":0,"top_k":1' + '0' * 309 + '}'
    assert_error(post(server, '/v1/completions', content=body), 400, 'top_k',
                 'top_k=100000000000...(310 digits): must be in [-1, 2147483647]')
    assert_serves_as_before(server, reference)


OUT_OF_RANGE = [   # raw JSON (Python's json reads Infinity and NaN), the param, the message
    ('"seed":18446744073709551616', 'seed',
     'seed=18446744073709551616: must be in [-9223372036854775808, 1844674'),
    ('"seed":-9223372036854775809', 'seed',          # OpenAI's int64 and a uint64 are taken
     'seed=-9223372036854775809: must be in [-9223372036854775808, 18446744073709551615]'),
    ('"temperature":Infinity', 'temperature', 'temperature=Infinity: must be a finite number'),
    ('"temperature":NaN', 'temperature', 'temperature=NaN: must be a finite number'),
    ('"temperature":1e999', 'temperature', 'temperature=Infinity: must be a finite number'),
    ('"top_p":-Infinity', 'top_p', 'top_p=-Infinity: must be a finite number'),
    ('"top_p":-0.5', 'top_p', 'top_p=-0.5: must be in [0, 1]'),
    ('"top_k":1000000000000000000000000000000', 'top_k', 'must be in [-1, 2147483647]'),
    ('"top_k":-2', 'top_k', 'top_k=-2: must be in [-1, 2147483647]'),
    ('"top_k":1.5', 'top_k', 'top_k=1.5: must be an integer'),
    ('"max_tokens":1000000000', 'max_tokens',
     'max_tokens=1000000000: the prompt has 3 tokens and session_len=128, so at most 125'),
    ('"max_tokens":126', 'max_tokens', 'max_tokens=126: the prompt has 3 tokens'),
    ('"max_tokens":2147483648', 'max_tokens', 'max_tokens=2147483648: must be in [1, 2147483647]'),
    ('"max_tokens":true', 'max_tokens', 'max_tokens=true: must be an integer'),
    ('"ignore_eos":"no"', 'ignore_eos', 'ignore_eos="no": must be true or false'),
    ('"stop":["a","b","c","d","e","f","g","h","i","j","k","l","m","n","o","p","q"]', 'stop',
     'should have at most 16 items'),
    ('"presence_penalty":2.5', 'presence_penalty', 'presence_penalty=2.5: must be in [-2.0, 2.0]'),
    ('"frequency_penalty":-Infinity', 'frequency_penalty',
     'frequency_penalty=-Infinity: must be a finite number'),
    ('"frequency_penalty":"0.5"', 'frequency_penalty', 'frequency_penalty="0.5": must be a number'),
    ('"repetition_penalty":0', 'repetition_penalty',
     'repetition_penalty=0: must be in [0.01, 10.0]'),
    ('"repetition_penalty":11', 'repetition_penalty',
     'repetition_penalty=11: must be in [0.01, 10.0]'),
]


@pytest.mark.timeout(60)
def test_out_of_range_numbers_get_400_naming_field_value_and_range(server, reference):
    prompt_ids = [5, 6, 7]                    # 3 tokens: room for 125 in session_len=128
    for field, param, message in OUT_OF_RANGE:
        body = f'{{"prompt":{json.dumps(prompt_ids)},"max_tokens":4,{field}}}'
        if '"max_tokens"' in field:
            body = body.replace('"max_tokens":4,', '')
        assert_error(post(server, '/v1/completions', content=body), 400, param, message)
        assert_serves_as_before(server, reference)
    fits = post(server, '/v1/completions', {'prompt': prompt_ids, 'max_tokens': 125,
                                            'temperature': 0, 'ignore_eos': True})
    assert answer(fits)[1:] == (125, 'length')                  # exactly the room: accepted
    chat_body = {'messages': chat('hi'), 'max_completion_tokens': 10**6}
    assert_error(post(server, '/v1/chat/completions', chat_body), 400, 'max_completion_tokens',
                 'max_completion_tokens=1000000: the prompt has')


@pytest.mark.timeout(60)
def test_temperature_or_top_p_below_the_floor_is_greedy(server, reference):
    """1e-300 used to give token 0 with finish_reason 'stop': now it is greedy, exactly."""
    for sampling in ({'temperature': 1e-300}, {'temperature': 9e-6},
                     {'temperature': 1.0, 'top_p': 1e-300}, {'temperature': 0.7, 'top_p': 5e-9}):
        r = post(server, '/v1/completions', {**REFERENCE, **sampling, 'seed': 1})
        assert answer(r) == (reference['choices'][0]['text'], 6, 'length'), sampling
    assert_serves_as_before(server, reference)


# ---- 2. lone surrogates -----------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_lone_surrogates_get_400_naming_the_field(server, reference):
    cases = [
        ('/v1/completions', '{"prompt":"a \\ud800","max_tokens":2}', 'prompt'),
        ('/v1/completions', '{"prompt":["ok \\udfff"],"max_tokens":2}', 'prompt.0'),
        ('/v1/completions', '{"prompt":"a","stop":["x","\\ud83d"]}', 'stop.1'),
        ('/v1/chat/completions', '{"messages":[{"role":"user","content":"a \\ud800"}]}',
         'messages.0.content'),
        ('/v1/chat/completions',
         '{"messages":[{"role":"user","content":[{"type":"text","text":"\\udc00"}]}]}',
         'messages.0.content.0.text'),
        ('/v1/chat/completions', '{"messages":[{"role":"user","content":"a"}],"\\udc00":1}',
         '\\udc00'),
    ]
    for path, body, param in cases:
        assert_error(post(server, path, content=body), 400, param, 'lone UTF-16 surrogate')
        assert_serves_as_before(server, reference)
    encoded = '{"prompt":"a \ud800"}'.encode('utf-8', 'surrogatepass')      # CESU-8 bytes
    assert_error(post(server, '/v1/completions', content=encoded), 400, 'prompt', 'surrogate')
    not_utf8 = b'{"prompt":"a \xff"}'
    assert_error(post(server, '/v1/completions', content=not_utf8), 400, None, 'not UTF-8')
    assert_serves_as_before(server, reference)


# ---- 3. body size ------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_a_body_over_the_limit_gets_413_before_it_is_read(server, reference):
    big = b'{"prompt":"' + b'a' * LIMIT + b'"}'
    r = post(server, '/v1/completions', content=big)                    # with Content-Length
    error = assert_error(r, 413, None, f'larger than {LIMIT} bytes', '--max-request-bytes')
    assert error['code'] == 'request_too_large'
    assert_serves_as_before(server, reference)

    def chunks():                                                       # chunked, no length
        yield b'{"messages":[{"role":"user","content":"'
        for _ in range(LIMIT // 2**16 + 1):
            yield b'b' * 2**16
        yield b'"}]}'
    r = httpx.post(server.url + '/v1/chat/completions', content=chunks(), timeout=60,
                   headers={**headers(), 'Content-Type': 'application/json'})
    assert_error(r, 413, None, f'larger than {LIMIT} bytes')
    assert_serves_as_before(server, reference)


# ---- 4. tokenization off the event loop --------------------------------------------------------
@pytest.mark.timeout(90)
def test_a_large_prompt_does_not_stall_other_streams(server, reference):
    """While a 1.5 MB prompt (under the limit) is parsed, tokenized and found too long, a stream
    keeps receiving chunks and /health keeps answering."""
    stream_times, health_latencies, large = [], [], {}
    large_started, large_done = threading.Event(), threading.Event()

    def stream():
        payload = {'prompt': 'x = 1', 'max_tokens': 120, 'temperature': 0, 'ignore_eos': True,
                   'stream': True}
        with httpx.stream('POST', server.url + '/v1/completions', json=payload, timeout=60,
                          headers=headers()) as r:
            for line in r.iter_lines():
                if line.startswith('data: '):
                    stream_times.append(time.monotonic())
                    if len(stream_times) == 3:
                        large_started.set()

    def send_large():
        large_started.wait(30)
        start = time.monotonic()
        prompt = 'def f(x):\n    return x + 1\n' * 55_000                 # ~1.5 MB
        large['response'] = post(server, '/v1/completions', {'prompt': prompt, 'max_tokens': 2})
        large['span'] = (start, time.monotonic())
        large_done.set()

    threads = [threading.Thread(target=stream), threading.Thread(target=send_large)]
    for t in threads:
        t.start()
    assert large_started.wait(30), 'the stream never started'
    while not large_done.is_set():
        start = time.monotonic()
        assert httpx.get(server.url + '/health', timeout=10).status_code == 200
        health_latencies.append(time.monotonic() - start)
        time.sleep(0.05)
    for t in threads:
        t.join(60)
    assert_error(large['response'], 400, 'prompt', f'session_len={SESSION_LEN}')
    begin, end = large['span']
    during = [t for t in stream_times if begin <= t <= end]
    gaps = [b - a for a, b in zip([begin] + during, during + [end])]
    # on the event loop, the stream stalled for the whole span (3 s here) and so did /health
    # (the sharper check, below); in a thread, the engine's thread still loses CPU on 2 cores:
    # its longest gap measured 0.51-0.76 of the span (0.76 once in a full run), so the stream's
    # bound is 0.85, short of a stall of the whole span
    assert max(gaps) < max(0.5, 0.85 * (end - begin)), (gaps, end - begin)
    assert max(health_latencies) < max(0.5, 0.5 * (end - begin)), health_latencies
    assert_serves_as_before(server, reference)


# ---- 5. unsupported and unknown fields, roles --------------------------------------------------
UNSUPPORTED = [    # (endpoint, extra fields, param, message)
    ('chat', {'logprobs': True, 'top_logprobs': 21}, 'top_logprobs',
     'top_logprobs=21: must be in [0, 20]'),
    ('chat', {'top_logprobs': 3}, 'top_logprobs', 'top_logprobs=3: needs "logprobs": true'),
    ('chat', {'tool_choice': 'required'}, 'tool_choice',
     'tool_choice="required": forcing a call needs "tools"'),
    ('chat', {'functions': [{'name': 'f'}]}, 'functions', 'the legacy function-calling API'),
    ('chat', {'response_format': {'type': 'json'}}, 'response_format',
     'response_format={"type": "json"}: must be an object whose type is one of'),
    ('chat', {'logit_bias': {'5': 101}}, 'logit_bias.5', 'logit_bias.5=101: input should be '
                                                         'less than or equal to 100'),
    ('chat', {'min_tokens': 50, 'max_tokens': 8}, 'min_tokens',
     'min_tokens=50: must be an integer in 0..8'),
    ('chat', {'guided_json': {}}, 'guided_json', 'guided_json: unknown field'),
    ('chat', {'messages': [{'role': 'user', 'content': 'hi', 'nmae': 'bob'}]},
     'messages.0.nmae', 'messages.0.nmae: unknown field'),
    ('chat', {'messages': [{'role': 'tool', 'content': 'hi'}]}, 'messages.0.tool_call_id',
     "messages.0.tool_call_id=null: a 'tool' message needs tool_call_id"),
    ('chat', {'messages': [{'role': 'ipython', 'content': 'hi'}]}, 'messages.0.role',
     'messages.0.role="ipython": input should be \'system\', \'user\', \'assistant\', '
     '\'developer\' or \'tool\''),
    ('chat', {'messages': chat('hi') + [{'role': 'robot', 'content': 'x'}]}, 'messages.1.role',
     'messages.1.role="robot"'),
    ('chat', {'messages': [{'role': 'user', 'content': [{'type': 'image_url',
                                                          'image_url': {'url': 'x'}}]}]},
     'messages.0.content.0.type', "read text only: allowed 'text'"),
    ('chat', {'stream_options': {'include_usage': True, 'continuous': True}},
     'stream_options.continuous', 'unknown field'),
    ('completions', {'logprobs': 6}, 'logprobs', 'logprobs=6: must be in [0, 5]'),
    ('completions', {'echo': True, 'logprobs': 1}, 'echo', 'echo=true: not with logprobs'),
    ('completions', {'best_of': 2, 'stream': True}, 'best_of',
     'best_of=2: above n it cannot be streamed'),
    ('completions', {'suffix': 'x'}, 'suffix', 'suffix="x": not supported'),
    ('completions', {'n': 17}, 'n', 'n=17: must be in [1, 16]'),
]


@pytest.mark.timeout(60)
def test_unsupported_or_unknown_fields_and_roles_get_400_naming_them(server, reference):
    for endpoint, fields, param, message in UNSUPPORTED:
        base = ({'messages': chat('hi')} if endpoint == 'chat' else {'prompt': 'def'})
        assert_error(post(server, f'/v1/{endpoint.replace("chat", "chat/completions")}',
                          {**base, 'max_tokens': 2, **fields}), 400, param, message)
        assert_serves_as_before(server, reference)


@pytest.mark.timeout(60)
def test_the_openai_clients_usual_fields_at_their_defaults_change_nothing(server, client):
    messages = [{'role': 'system', 'content': 'be brief'},
                {'role': 'user', 'content': [{'type': 'text', 'text': 'say '},
                                             {'type': 'text', 'text': 'hi'}]}]
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5,
                                           temperature=0, extra_body={'ignore_eos': True})
    harmless = dict(n=1, presence_penalty=0, frequency_penalty=0.0, logprobs=False,
                    top_logprobs=None, response_format={'type': 'text'}, user='user-1', seed=7,
                    stop=['never seen'], tool_choice='none', logit_bias={}, top_p=1,
                    stream_options=None, extra_body={'ignore_eos': True, 'tools': None})
    decorated = client.chat.completions.create(
        model=MODEL, messages=[{'role': 'developer', 'content': 'be brief'}, messages[1]],
        max_completion_tokens=5, temperature=0, **harmless)
    assert (decorated.choices[0].message.content, decorated.usage.completion_tokens) == \
        (plain.choices[0].message.content, plain.usage.completion_tokens)
    assert plain.usage.completion_tokens == 5
    streamed = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5,
                                              temperature=0, stream=True,
                                              stream_options={'include_usage': True},
                                              **{k: v for k, v in harmless.items()
                                                 if k != 'stream_options'})
    chunks = list(streamed)
    assert ''.join(c.choices[0].delta.content or '' for c in chunks if c.choices) == \
        plain.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 5
    completion = client.completions.create(model=MODEL, prompt='def main(', max_tokens=6,
                                           temperature=0, n=1, echo=False, best_of=1,
                                           logprobs=None, suffix=None, presence_penalty=0,
                                           frequency_penalty=0, user='u',
                                           extra_body={'ignore_eos': True})
    assert completion.choices[0].text == post(server, '/v1/completions',
                                              REFERENCE).json()['choices'][0]['text']
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                       top_logprobs=2)
    assert e.value.status_code == 400 and 'needs "logprobs": true' in e.value.message


# ---- 7. a failed generation; an unexpected exception (a stand-in pipeline, in process) ----------
class FakeClient:
    session_len = 64
    model_config = SimpleNamespace(vocab_size=100)
    error = None

    def validate_request(self, ids, gen_config):
        pass

    def stalled(self, limit_s):
        return None

    def stats(self):
        return EngineStats()

    def close(self):
        pass


class FakePipe:
    """'fail': the engine ends the request with finish_reason 'error'; 'raise': generation raises
    mid-way; 'crash': tokenization raises; anything else: 'hello' then 'length'."""
    tokenizer = None
    # the server reads a pipeline through these (over `_client`, as Pipeline's own do)
    error, session_len, vocab_size = Pipeline.error, Pipeline.session_len, Pipeline.vocab_size
    validate_request, stalled, stats = Pipeline.validate_request, Pipeline.stalled, Pipeline.stats
    capacity, reasoning = 64, False
    SECRET = '/srv/secret/lmdeploy_lite/model.py'

    def __init__(self):
        self._client = FakeClient()
        self.prompts = {}

    def encode(self, prompt):
        prompt = prompt if isinstance(prompt, str) else prompt[-1]['content']    # chat: the last
        if prompt == 'crash':
            raise RuntimeError(f'Traceback (most recent call last): {self.SECRET}')
        ids = [len(self.prompts) + 1]
        self.prompts[ids[0]] = prompt
        return ids

    async def generate_ids(self, prompts, gen_config, stream_text=True, request_id=None):
        async for r in self.generate(prompts[0], gen_config, stream_text):
            yield r

    async def generate(self, ids, gen_config, stream_text=True):
        from lmdeploy_lite.messages import Response
        prompt = self.prompts[ids[0]]
        yield Response(text='hel', token_ids=[1], input_token_len=1, generate_token_len=1)
        if prompt == 'raise':
            raise RuntimeError(f'a failure in {self.SECRET}')
        reason = 'error' if prompt == 'fail' else 'length'
        yield Response(text='lo', token_ids=[2], input_token_len=1, generate_token_len=2,
                       finish_reason=reason)


def _call_app(requests: list[tuple[str, dict]]) -> list[httpx.Response]:
    from lmdeploy_lite.serve.openai.api_server import create_app
    app = create_app(FakePipe(), 'fake')

    async def run():
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)    # as uvicorn
        async with httpx.AsyncClient(transport=transport, base_url='http://test',
                                     timeout=30) as http:
            return [await http.post(path, json=body) for path, body in requests]
    return asyncio.run(run())


def test_closed_doors_non_json_bodies_head_probes_and_too_many_sequences():
    """A browser's cross-site form post (text/plain, form-urlencoded) gets 415 and is never
    read; HEAD answers wherever GET does; 20,000 prompts x n=16 (320,000 sequences) is a 400
    naming both numbers before any prompt is tokenized; a JSON body with a charset passes.
    Bound to 127.0.0.1, a request for another Host is 421 (DNS rebinding), unless allowed."""
    from lmdeploy_lite.serve.openai.api_server import create_app
    pipe = FakePipe()
    app = create_app(pipe, 'fake', bound_host='127.0.0.1', allowed_hosts=('models.internal',))

    async def run():
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url='http://127.0.0.1:23333',
                                     timeout=30) as http:
            rebound = [await http.get('/v1/models', headers={'host': host}) for host in
                       ('evil.example', 'evil.example:23333', 'localhost:23333', '[::1]:80',
                        'models.internal')]
            form = await http.post('/v1/completions', content=b'prompt=hi', headers={
                'content-type': 'application/x-www-form-urlencoded'})
            text = await http.post('/v1/chat/completions', headers={'content-type': 'text/plain'},
                                   content=json.dumps({'messages': chat('x')}))
            heads = [await http.head(path) for path in ('/health', '/metrics', '/v1/models')]
            many = await http.post('/v1/completions', json={'prompt': ['a'] * 20_000, 'n': 16})
            fine = await http.post('/v1/completions', content=json.dumps({'prompt': 'fine'}),
                                   headers={'content-type': 'application/json; charset=utf-8'})
            return rebound, form, text, heads, many, fine
    rebound, form, text, heads, many, fine = asyncio.run(run())
    assert [r.status_code for r in rebound] == [421, 421, 200, 200, 200]
    assert "Host: 'evil.example'" in rebound[0].json()['error']['message']
    for r in (form, text):
        assert r.status_code == 415, r.text
        assert r.json()['error']['code'] == 'unsupported_media_type'
        assert 'application/json' in r.json()['error']['message']
    assert [r.status_code for r in heads] == [200, 200, 200]
    assert many.status_code == 400
    message = many.json()['error']['message']
    assert '20000 prompt(s) x n=16 = 320000 sequences' in message and '256' in message
    assert pipe.prompts == {1: 'fine'}, 'only the accepted request was tokenized'
    assert fine.status_code == 200 and answer(fine) == ('hello', 2, 'length')


class GatedPipe(FakePipe):
    """FakePipe whose generations wait for `gate` before their last token."""

    def __init__(self):
        super().__init__()
        self.gate = asyncio.Event()

    async def generate(self, ids, gen_config, stream_text=True):
        from lmdeploy_lite.messages import Response
        yield Response(text='hel', token_ids=[1], input_token_len=1, generate_token_len=1)
        await self.gate.wait()
        yield Response(text='lo', token_ids=[2], input_token_len=1, generate_token_len=2,
                       finish_reason='length')


def test_past_max_concurrent_requests_a_request_gets_429_and_the_others_finish():
    """Limit 8: eight requests held (half streamed), the ninth gets 429 with Retry-After at
    once; the eight finish correctly, and then the count is back and the next request passes.
    A request asking for more tokens than --max-tokens-per-request is a 400 before its prompt
    is tokenized."""
    from lmdeploy_lite.serve.openai.api_server import create_app
    from lmdeploy_lite.serve.openai.checks import ServerLimits
    pipe = GatedPipe()
    app = create_app(pipe, 'fake', limits=ServerLimits(max_concurrent=8, max_tokens=1000))

    async def run():
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url='http://test',
                                     timeout=30) as http:
            held = [asyncio.create_task(http.post('/v1/completions', json={
                'prompt': f'p{i}', 'stream': i % 2 == 1})) for i in range(8)]
            while len(pipe.prompts) < 8:              # all admitted and generating
                await asyncio.sleep(0.01)
            refused = await http.post('/v1/completions', json={'prompt': 'ninth'})
            pipe.gate.set()
            done = await asyncio.gather(*held)
            after = await http.post('/v1/completions', json={'prompt': 'after'})
            greedy = await http.post('/v1/completions', json={'prompt': ['a', 'b'], 'n': 16,
                                                              'max_tokens': 60})
            return refused, done, after, greedy
    refused, done, after, greedy = asyncio.run(run())
    assert refused.status_code == 429 and refused.headers['retry-after'] == '1'
    assert '--max-concurrent-requests 8' in refused.json()['error']['message']
    for i, r in enumerate(done):
        if i % 2:
            assert r.status_code == 200 and r.text.rstrip().endswith('[DONE]')
            assert ''.join(json.loads(e)['choices'][0]['text'] for e in
                           sse_events(r.text.splitlines())[:-1]) == 'hello'
        else:
            assert answer(r) == ('hello', 2, 'length')
    assert answer(after) == ('hello', 2, 'length')
    assert_error(greedy, 400, 'max_tokens', '32 sequence(s) x max_tokens=60 = 1920 tokens',
                 'at most 1000', '--max-tokens-per-request')
    assert 'ninth' not in pipe.prompts.values() and 'a' not in pipe.prompts.values()


def test_a_failed_generation_ends_that_request_with_an_error_and_others_go_on():
    ok, failed, ok_again, failed_stream, chat_failed_stream = _call_app([
        ('/v1/completions', {'prompt': 'fine'}),
        ('/v1/completions', {'prompt': 'fail'}),
        ('/v1/completions', {'prompt': 'fine'}),
        ('/v1/completions', {'prompt': 'fail', 'stream': True}),
        ('/v1/chat/completions', {'messages': chat('x'), 'stream': True, 'max_tokens': 2}),
    ])
    assert answer(ok) == answer(ok_again) == ('hello', 2, 'length')
    assert failed.status_code == 500
    assert failed.json()['error'] == {
        'message': 'generation failed for this request; the server log has the details',
        'type': 'internal_error', 'param': None, 'code': 'generation_failed'}
    events = sse_events(failed_stream.text.splitlines())
    assert events[-1] == '[DONE]'
    assert json.loads(events[-3])['choices'][0]['finish_reason'] == 'error'
    assert json.loads(events[-2])['error']['code'] == 'generation_failed'
    assert [json.loads(e)['choices'][0]['finish_reason'] for e in
            sse_events(chat_failed_stream.text.splitlines())[:-1]] == [None, None, 'length']


def test_an_unexpected_exception_is_a_short_json_500_and_others_go_on():
    crashed, raised, raised_stream, ok = _call_app([
        ('/v1/completions', {'prompt': 'crash'}),
        ('/v1/completions', {'prompt': 'raise'}),
        ('/v1/chat/completions', {'messages': [{'role': 'user', 'content': 'raise'}],
                                  'stream': True}),
        ('/v1/completions', {'prompt': 'fine'}),
    ])
    for r in (crashed, raised, raised_stream):
        assert FakePipe.SECRET not in r.text and 'Traceback' not in r.text, r.text
    assert crashed.status_code == 500 and crashed.json()['error']['type'] == 'internal_error'
    assert crashed.json()['error']['message'] == ('internal server error; the server log has '
                                                  'the details')
    assert raised.status_code == 500
    assert raised.json()['error']['code'] == 'generation_failed'
    events = sse_events(raised_stream.text.splitlines())
    assert json.loads(events[-3])['choices'][0]['finish_reason'] == 'error'
    assert json.loads(events[-2])['error']['code'] == 'generation_failed'
    assert events[-1] == '[DONE]'
    assert answer(ok) == ('hello', 2, 'length')


class CachingFakePipe(FakePipe):
    """FakePipe with 10-token prompts, 8 tokens of each served from the prefix cache, and 5
    blocks in the cache as its ranks last reported."""

    def stats(self):
        return EngineStats(num_cached_blocks=5)

    def encode(self, prompt):
        return super().encode(prompt) * 10

    async def generate(self, ids, gen_config, stream_text=True):
        async for r in super().generate(ids, gen_config, stream_text):
            r.input_token_len, r.num_cached_tokens = len(ids), 8
            yield r


def test_cached_prompt_tokens_reach_usage_and_the_prefix_cache_counters():
    """Response.num_cached_tokens -> usage.prompt_tokens_details.cached_tokens, streamed and not,
    on both endpoints; the counters add up the requests' figures (no engine in this process:
    counted from the responses, as with the mp executor; the cached-blocks gauge from the
    pipeline's figure)."""
    from lmdeploy_lite.serve.openai.api_server import create_app
    app = create_app(CachingFakePipe(), 'fake')
    include_usage = {'stream': True, 'stream_options': {'include_usage': True}}
    requests = [('/v1/completions', {'prompt': 'a'}),
                ('/v1/completions', {'prompt': 'b', **include_usage}),
                ('/v1/chat/completions', {'messages': chat('c')}),
                ('/v1/chat/completions', {'messages': chat('d'), **include_usage})]

    async def run():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url='http://test',
                                     timeout=30) as http:
            answers = [await http.post(path, json=body) for path, body in requests]
            return answers, (await http.get('/metrics')).text
    answers, metrics = asyncio.run(run())
    for (_, body), r in zip(requests, answers):
        assert r.status_code == 200, r.text
        usage = (json.loads(sse_events(r.text.splitlines())[-2])['usage'] if body.get('stream')
                 else r.json()['usage'])
        assert usage['prompt_tokens'] == 10
        assert usage['prompt_tokens_details'] == {'cached_tokens': 8}
    assert 'lmdeploy_lite_prefix_cache_queried_tokens_total 40.0' in metrics.splitlines()
    assert 'lmdeploy_lite_prefix_cache_hit_tokens_total 32.0' in metrics.splitlines()
    assert 'lmdeploy_lite_prefix_cache_cached_blocks 5.0' in metrics.splitlines()


# ---- 8. the engine dies: streams end with an error, the server exits non-zero ------------------
@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_dead_rank_ends_every_stream_with_an_error_and_the_server_exits_1(dead_rank_server):
    """Rank 1 is stopped (SIGSTOP) while four streams run: /health turns 503 within seconds
    naming it; then it is killed: every stream ends with an error and the server exits 1. The
    server (tests/serve/conftest.py): the tiny model, --dp 2 --ep 2 --health-stall-timeout 1.5."""
    srv = dead_rank_server
    assert srv.proc.args[-6:] == ['--dp', '2', '--ep', '2', '--health-stall-timeout', '1.5']
    try:
        workers = srv.rank_workers()
        assert len(workers) == 2, srv.children()
        streams = [[] for _ in range(4)]
        started = threading.Barrier(len(streams) + 1, timeout=60)

        def read(lines, i):
            payload = {'messages': chat(f'story {i}'), 'max_tokens': 100, 'stream': True,
                       'temperature': 0, 'ignore_eos': True}
            with httpx.stream('POST', srv.url + '/v1/chat/completions', json=payload,
                              timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith('data: '):
                        lines.append(line[6:])
                        if len(lines) == 3:
                            started.wait()
        readers = [threading.Thread(target=read, args=(lines, i), daemon=True)
                   for i, lines in enumerate(streams)]
        for t in readers:
            t.start()
        started.wait()                                  # every stream has text
        assert httpx.get(srv.url + '/health', timeout=5).status_code == 200
        os.kill(workers[1], signal.SIGSTOP)
        stopped, health = time.monotonic(), None
        while time.monotonic() - stopped < 20:
            health = httpx.get(srv.url + '/health', timeout=5)
            if health.status_code != 200:
                break
            time.sleep(0.1)
        assert health.status_code == 503, 'a stopped rank left /health at 200 for 20 s'
        assert time.monotonic() - stopped < 1.5 + 3
        assert health.json()['status'] == 'stalled'
        assert health.json()['error'].startswith(f'rank 1 (pid {workers[1]}, stopped by a signal) '
                                                 f'has made no progress for'), health.json()
        os.kill(workers[1], signal.SIGKILL)
        killed = time.monotonic()
        rc = srv.proc.wait(60)
        assert rc == 1, srv.output()
        assert time.monotonic() - killed < 30
        for t in readers:
            t.join(10)
        for lines in streams:
            assert lines[-1] == '[DONE]', lines
            assert json.loads(lines[-3])['choices'][0]['finish_reason'] == 'error', lines
            error = json.loads(lines[-2])['error']
            assert error['code'] == 'engine_stopped' and 'Traceback' not in lines[-2], error
        assert not left_alive(workers), 'orphaned worker processes'
        assert 'the engine stopped after an error' in srv.output()
    finally:
        srv.stop()


# ---- 6 and 9. keys from the environment or a file; SIGINT and SIGTERM alike -------------------
# Both signals reach the same handler (api_server._Server.capture_signals), so each is sent to one
# server: SIGINT here (one process, keys from the environment), SIGTERM to the dp=2 server of
# test_api_server.py::test_dp2_metrics_and_sigterm_shutdown_leaves_no_process (keys from a file).
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_sigint_ends_streams_with_abort_and_exit_0(sigint_server):
    """Keys from LMDEPLOY_LITE_API_KEYS, which do not show on the command line. The server
    (tests/serve/conftest.py): the tiny model, LMDEPLOY_LITE_API_KEYS='env-key-1, env-key-2', a
    stream long enough to be running when the signal arrives (the server's shutdown sets
    ServerContext.shutdown at once): 120 tokens took ~1 s on CPU and could end with 'length'."""
    key, srv = 'env-key-2', sigint_server
    assert srv.proc.args[-2:] == ['--session-len', '2048']
    try:
        with open(f'/proc/{srv.proc.pid}/cmdline', 'rb') as f:
            assert key.encode() not in f.read()
        for path in ('/v1/models', '/metrics', '/openapi.json'):
            assert httpx.get(srv.url + path, timeout=10).status_code == 401
            assert httpx.get(srv.url + path, headers=headers(key), timeout=10).status_code == 200
        lines, reader = stream_in_background(srv, '/v1/completions', {
            'prompt': 'go on', 'max_tokens': 2000, 'temperature': 0, 'ignore_eos': True},
            key=key)
        srv.proc.send_signal(signal.SIGINT)
        assert srv.proc.wait(30) == 0, srv.output()
        reader.join(10)
        assert lines[-1] == '[DONE]'
        assert json.loads(lines[-2])['choices'][0]['finish_reason'] == 'abort'
    finally:
        srv.stop()


def test_api_keys_from_a_file_and_the_environment_and_what_goes_wrong(tmp_path, capsys):
    from lmdeploy_lite.cli import main as cli
    from lmdeploy_lite.serve.openai.auth import load_api_keys
    keys_file = tmp_path / 'keys'
    keys_file.write_text('# comment\n a \n\nb\n')
    environ = {'LMDEPLOY_LITE_API_KEYS': 'c, a,,d', 'OTHER': '1'}
    assert load_api_keys(['e'], str(keys_file), environ) == ['e', 'a', 'b', 'c', 'd']
    assert environ == {'OTHER': '1'}                  # worker processes do not inherit the keys
    empty = tmp_path / 'empty'
    empty.write_text('# no key here\n\n')
    for path, reason in ((tmp_path / 'missing', 'cannot be read'), (empty, 'holds no key')):
        assert cli.main(['serve', 'api_server', '--api-keys-file', str(path)]) == 2
        assert f"api_keys_file='{path}': {reason}" in capsys.readouterr().err


# ---- 10. fuzz ------------------------------------------------------------------------------------
FIELDS = ['model', 'prompt', 'messages', 'max_tokens', 'max_completion_tokens', 'temperature',
          'top_p', 'top_k', 'stop', 'seed', 'stream', 'stream_options', 'n', 'ignore_eos',
          'skip_special_tokens', 'user', 'logprobs', 'top_logprobs', 'tools', 'tool_choice',
          'response_format', 'presence_penalty', 'frequency_penalty', 'repetition_penalty',
          'logit_bias', 'echo', 'best_of', 'suffix', 'parallel_tool_calls', 'role', 'content',
          'include_usage', 'type', 'text', 'unknown_field', '', '\u00e9\u00e8', 'x' * 300]
STRINGS = ['', 'hi', 'def f(', '\x00\x01\x1f', '\u2028\u2029', 'e\u0301', '\U0001f600' * 5,
           '\ud800', 'a\udfffb', '\ufeff', '\\', '"', '<|im_start|>', '<|im_end|>', 'NaN',
           'Infinity', 'user', 'system', 'assistant', 'developer', 'tool', 'text', 'tiny']


def _random_value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(12 if depth < 4 else 8)
    if kind == 0:
        return None
    if kind == 1:
        return rng.random() < 0.5
    if kind == 2:
        return rng.randint(-2, 4)
    if kind == 3:
        return rng.choice([1, -1]) * 10 ** rng.randint(3, 400)
    if kind == 4:
        return rng.choice([0.0, -0.0, 1e-300, 5e-324, 0.5, 1.0, 2.5, -1.5, 1e308, 1e-5,
                           float('inf'), float('-inf'), float('nan')])
    if kind == 5:
        return rng.choice(STRINGS)
    if kind == 6:
        return ''.join(chr(rng.choice([rng.randint(0x20, 0x7e), rng.randint(0x80, 0xffff),
                                       rng.randint(0x10000, 0x10ffff)]))
                       for _ in range(rng.choice([1, 10, 200, 3000])))
    if kind == 7:
        return rng.choice([[], {}, [5, 6, 7], {'type': 'text'}, {'include_usage': True}])
    if kind in (8, 9):
        return [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    if kind == 10:
        return {rng.choice(FIELDS): _random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))}
    nested = []
    for _ in range(rng.choice([10, 100, 500])):
        nested = [nested]
    return nested


def _random_body(rng: random.Random, chat_endpoint: bool) -> bytes:
    if rng.random() < 0.08:                                  # not JSON, or barely
        return rng.choice([b'', b'{', b'{"prompt": "a"', b'nul', b'\xff\xfe\x00', b'[]',
                           b'{"prompt": "a",}', b'{"max_tokens": 1' + b'0' * 5000 + b'}',
                           b'[' * 100_000, b'"just a string"', b'{"a": NaN} x',
                           b'{"prompt":' + b'[' * 5000 + b']' * 5000 + b'}'])
    body = ({'messages': [{'role': rng.choice(['user', 'system', 'developer']),
                           'content': rng.choice(['hi', 'def f(', ''])}]} if chat_endpoint
            else {'prompt': rng.choice(['x = 1', [5, 6, 7], ['def'], [[8, 9]]])})
    body.update(max_tokens=rng.randint(1, 3), temperature=0)
    for _ in range(rng.choice([0, 0, 1, 1, 2, 3, 6])):
        target = body
        if chat_endpoint and rng.random() < 0.3:
            target = body['messages'][0] if isinstance(body.get('messages'), list) and \
                body['messages'] and isinstance(body['messages'][0], dict) else body
        key = rng.choice(FIELDS)
        if key in ('max_tokens', 'max_completion_tokens') and rng.random() < 0.7:
            target[key] = rng.choice([0, -1, 10**9, 2.5, 'x', None, 1])   # none asks for many
        elif rng.random() < 0.1 and key in target:
            del target[key]
        else:
            target[key] = _random_value(rng)
    body.setdefault('max_tokens', 2)                    # no request may run for long
    if body.get('max_tokens') is None:
        body['max_tokens'] = 2
    try:
        text = json.dumps(body, ensure_ascii=rng.random() < 0.7)
    except (ValueError, RecursionError):
        return b'{"prompt": "unencodable"}'
    return text.encode('utf-8', 'surrogatepass')


@pytest.mark.timeout(150)
def test_fuzz_500_random_bodies_get_no_5xx_and_json_answers(server, reference):
    rng = random.Random(16)
    bodies = [(path, _random_body(rng, path.startswith('/v1/chat')))
              for path in rng.choices(['/v1/completions', '/v1/chat/completions'], k=500)]
    statuses = []

    async def send(http, sem, path, body):
        async with sem:
            r = await http.post(path, content=body)
        assert r.status_code < 500, (path, body[:300], r.status_code, r.text[:300])
        if r.headers.get('content-type', '').startswith('text/event-stream'):
            events = sse_events(r.text.splitlines())
            assert events[-1] == '[DONE]', (body[:300], r.text[-300:])
            for event in events[:-1]:
                json.loads(event)
        else:
            reply = r.json()
            assert ('choices' in reply) if r.status_code == 200 else ('error' in reply), reply
        statuses.append(r.status_code)

    async def run():
        sem = asyncio.Semaphore(8)
        async with httpx.AsyncClient(base_url=server.url, timeout=60,
                                     headers={**headers(), 'Content-Type': 'application/json'},
                                     limits=httpx.Limits(max_connections=8)) as http:
            await asyncio.wait_for(asyncio.gather(*(send(http, sem, path, body)
                                                    for path, body in bodies)), 120)
    asyncio.run(run())
    assert len(statuses) == 500
    assert statuses.count(200) >= 50 and statuses.count(400) >= 200, \
        {s: statuses.count(s) for s in set(statuses)}
    assert_serves_as_before(server, reference)
    deadline = time.monotonic() + 30
    while scrape(server.url)['lmdeploy_lite_num_requests_in_flight'] != 0:
        assert time.monotonic() < deadline, 'requests left in flight'
        time.sleep(0.2)
    assert scrape(server.url)['lmdeploy_lite_kv_blocks_used'] == 0
