"""`lmdeploy_lite serve api_server` end to end: the real server as a subprocess on 127.0.0.1, spoken
to with the official `openai` client and plain HTTP (httpx), CPU: a tiny random model (float32) for
the protocol, errors and load; the embedded model (float64), whose MTP drafts get accepted, for
speculative decoding's output and metrics."""
import asyncio
import json
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

for _module in ('fastapi', 'uvicorn', 'prometheus_client'):
    pytest.importorskip(_module, reason="needs the 'serve' extra")
openai = pytest.importorskip('openai')
httpx = pytest.importorskip('httpx')

from lmdeploy_lite.messages import PytorchEngineConfig, SpecDecodeStats  # noqa: E402
from tests.helpers import accepting  # noqa: E402
from tests.helpers.accepting import assert_real_acceptance, counts  # noqa: E402
from tests.serve.live_server import (K, KEY, MODEL, ROOT, SESSION_LEN, SPEC_K,  # noqa: E402
                                     chat, headers, is_loopback_hex,
                                     left_alive, listening, post, scrape,
                                     stream_in_background, stream_texts)

GREEDY = dict(temperature=0, extra_body={'ignore_eos': True})


# ---- protocol -----------------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_models_completion_chat_and_streaming_chat(client):
    assert [m.id for m in client.models.list().data] == [MODEL]

    done = client.completions.create(model=MODEL, prompt='def main(', max_tokens=8, **GREEDY)
    assert done.choices[0].finish_reason == 'length' and done.usage.completion_tokens == 8
    assert done.choices[0].text
    by_ids = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=3, **GREEDY)
    assert by_ids.usage.prompt_tokens == 3 and by_ids.usage.completion_tokens == 3

    full = client.chat.completions.create(model=MODEL, messages=chat('hello'), max_tokens=12,
                                          **GREEDY)
    assert full.choices[0].finish_reason == 'length' and full.usage.completion_tokens == 12
    chunks = list(client.chat.completions.create(model=MODEL, messages=chat('hello'),
                                                 max_tokens=12, stream=True,
                                                 stream_options={'include_usage': True},
                                                 **GREEDY))
    text = ''.join(c.choices[0].delta.content or '' for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == 'assistant'
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == 'length'
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


@pytest.mark.timeout(60)
def test_stream_ends_with_done(server):
    lines = []
    with httpx.stream('POST', server.url + '/v1/completions', timeout=60,
                      headers=headers(),
                      json={'prompt': 'x = 1', 'max_tokens': 4, 'stream': True,
                            'temperature': 0, 'ignore_eos': True}) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line.startswith('data: ')]
    assert lines[-1] == 'data: [DONE]'
    assert json.loads(lines[-2][6:])['choices'][0]['finish_reason'] == 'length'


PREFIX_CACHE_METRICS = ('lmdeploy_lite_prefix_cache_queried_tokens_total',
                        'lmdeploy_lite_prefix_cache_hit_tokens_total',
                        'lmdeploy_lite_prefix_cache_cached_blocks')


@pytest.mark.timeout(120)
def test_usage_has_cached_prompt_tokens_and_the_prefix_metrics_count_them(server, client):
    """usage.prompt_tokens_details.cached_tokens, as OpenAI names it, on both endpoints,
    streamed (include_usage) and not, read by the official client; the prefix-cache counters
    grow by exactly the requests' prompt tokens and cached tokens."""
    before = scrape(server.url)

    def streamed_usage(create, **kw):
        return list(create(stream=True, stream_options={'include_usage': True}, **kw))[-1].usage
    completion = dict(model=MODEL, prompt='def cached(', max_tokens=3, **GREEDY)
    chat_completion = dict(model=MODEL, messages=chat('cached?'), max_tokens=3, **GREEDY)
    usages = [client.completions.create(**completion).usage,
              streamed_usage(client.completions.create, **completion),
              client.chat.completions.create(**chat_completion).usage,
              streamed_usage(client.chat.completions.create, **chat_completion)]
    figures = [(u.prompt_tokens, u.prompt_tokens_details.cached_tokens) for u in usages]
    raw = post(server, '/v1/completions', {'prompt': 'def cached(', 'max_tokens': 1}).json()
    assert set(raw['usage']['prompt_tokens_details']) == {'cached_tokens'}
    figures.append((raw['usage']['prompt_tokens'],
                    raw['usage']['prompt_tokens_details']['cached_tokens']))
    for num_prompt, cached in figures:
        assert type(cached) is int and 0 <= cached < num_prompt, figures
    after = scrape(server.url)
    queried, hit, blocks = PREFIX_CACHE_METRICS
    assert all(name in after for name in PREFIX_CACHE_METRICS), sorted(after)
    assert after[queried] - before[queried] == sum(n for n, _ in figures)
    assert after[hit] - before[hit] == sum(c for _, c in figures)
    assert after[hit] <= after[queried]
    assert 0 <= after[blocks] <= after['lmdeploy_lite_kv_blocks_total']


# ---- speculative decoding with accepted drafts: the embedded model's server, MTP k=3, float64 --
def _spec_stats(usage) -> SpecDecodeStats:
    spec = usage.spec_decode                                 # the server's `usage` extension
    return SpecDecodeStats(spec['num_drafts'], spec['num_draft_tokens'],
                           spec['num_accepted_tokens'], spec['accepted_per_position'])


@pytest.fixture(scope='module')
def plain_greedy() -> list:
    """Plain greedy (no speculation) Responses for accepting.TEXTS, in this process, float64, the
    server's session_len: texts detokenized as the server does."""
    from lmdeploy_lite import pipeline
    config = PytorchEngineConfig(**{**accepting.BASE, 'session_len': SESSION_LEN})
    with pipeline(None, config, progress=False) as pipe:
        return pipe(list(accepting.TEXTS), accepting.GREEDY)


def _stream_completion(client, prompt: str, max_tokens: int):
    """(text, the final usage) of a streamed completion."""
    chunks = list(client.completions.create(model='embedded', prompt=prompt, max_tokens=max_tokens,
                                            stream=True, stream_options={'include_usage': True},
                                            **GREEDY))
    assert chunks[-1].choices == []
    return ''.join(c.choices[0].text for c in chunks if c.choices), chunks[-1].usage


@pytest.mark.timeout(180)
def test_speculative_output_streamed_or_not_is_plain_greedy(spec_client, plain_greedy):
    """Completions of code prompts (drafts mostly accepted, asserted first), each streamed and
    not, all at once: whole texts and token counts equal plain greedy's, and each request's draft
    counts, positions included, the single process's."""
    max_tokens = accepting.GREEDY.max_new_tokens
    with ThreadPoolExecutor(2 * len(accepting.TEXTS)) as pool:
        done = [pool.submit(spec_client.completions.create, model='embedded', prompt=text,
                            max_tokens=max_tokens, **GREEDY) for text in accepting.TEXTS]
        streamed = [pool.submit(_stream_completion, spec_client, text, max_tokens)
                    for text in accepting.TEXTS]
        done, streamed = [f.result() for f in done], [f.result() for f in streamed]
    stats = [_spec_stats(d.usage) for d in done] + [_spec_stats(u) for _, u in streamed]
    assert_real_acceptance(stats, SPEC_K)
    want = [r.text for r in plain_greedy]
    assert [d.choices[0].text for d in done] == [text for text, _ in streamed] == want
    assert [d.usage.completion_tokens for d in done] == [u.completion_tokens for _, u in streamed] \
        == [len(r.token_ids) for r in plain_greedy] == [max_tokens] * len(want)
    assert [d.usage.prompt_tokens for d in done] == [len(p) for p in accepting.prompts()]
    want_counts = accepting.reference(SPEC_K).counts
    assert [counts(s) for s in stats] == want_counts + want_counts


PENALTIES = [dict(repetition_penalty=1.3), dict(presence_penalty=0.8),
             dict(frequency_penalty=0.6),
             dict(repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.3)]


@pytest.mark.timeout(120)
def test_penalties_through_the_speculative_server_are_plain_greedy_with_them(spec_server,
                                                                             spec_client):
    """Completions of code prompts, each with one of the penalties (all at once; drafts
    accepted, asserted first) give the single process's plain greedy output with the same
    penalties; a chat takes them too; out of range is a 400 naming the field, and the next
    request is served."""
    from lmdeploy_lite import GenerationConfig
    prompts = [list(p) for p in accepting.prompts()]
    rows = list(zip(prompts, PENALTIES, strict=True))
    max_tokens = accepting.GREEDY.max_new_tokens
    with ThreadPoolExecutor(len(rows)) as pool:
        done = [pool.submit(spec_client.completions.create, model='embedded', prompt=p,
                            max_tokens=max_tokens, temperature=0,
                            presence_penalty=c.get('presence_penalty'),
                            frequency_penalty=c.get('frequency_penalty'),
                            extra_body={'ignore_eos': True,
                                        'repetition_penalty': c.get('repetition_penalty')})
                for p, c in rows]
        done = [f.result() for f in done]
    stats = [_spec_stats(d.usage) for d in done]
    assert all(s.num_accepted_tokens > 0 for s in stats), [counts(s) for s in stats]
    configs = [GenerationConfig(max_new_tokens=max_tokens, ignore_eos=True, **c) for _, c in rows]
    want = accepting.reference(0, [p for p, _ in rows], configs).token_ids
    tokenizer = accepting._tokenizer()
    assert [d.choices[0].text for d in done] == [tokenizer.decode(ids, skip_special_tokens=True) for ids in want]
    assert all(a != b for a, b in zip(want, accepting.reference(0).token_ids))   # they act
    reply = spec_client.chat.completions.create(
        model='embedded', messages=chat('def f('), max_tokens=4, temperature=0.7, seed=3,
        presence_penalty=-0.5, frequency_penalty=1.0, extra_body={'repetition_penalty': 0.9})
    assert reply.usage.completion_tokens >= 1
    for field, value, allowed in (('repetition_penalty', 20, '[0.01, 10.0]'),
                                  ('presence_penalty', -2.5, '[-2.0, 2.0]')):
        r = post(spec_server, '/v1/chat/completions',
                 {'messages': chat('hi'), 'max_tokens': 2, field: value})
        assert r.status_code == 400 and r.json()['error']['param'] == field, r.text
        assert f'{field}={value}: must be in {allowed}' in r.json()['error']['message']
        ok = post(spec_server, '/v1/chat/completions',
                  {'messages': chat('hi'), 'max_tokens': 2, field: 1.0})
        assert ok.status_code == 200 and ok.json()['usage']['completion_tokens'] >= 1


@pytest.mark.timeout(120)
def test_spec_metrics_grow_by_exactly_the_requests_figures(spec_server, spec_client):
    """Completions and chats, streamed and not, of different lengths, all at once, with drafts
    mostly accepted (asserted first): every speculative counter grows by exactly the requests'
    own figures."""
    def completion(prompt, max_tokens):
        return spec_client.completions.create(model='embedded', prompt=prompt,
                                              max_tokens=max_tokens, **GREEDY).usage

    def chat_completion(prompt, max_tokens):
        return spec_client.chat.completions.create(model='embedded', messages=chat(prompt),
                                                   max_tokens=max_tokens, **GREEDY).usage

    def streamed_chat(prompt, max_tokens):
        stream = spec_client.chat.completions.create(
            model='embedded', messages=chat(prompt), max_tokens=max_tokens, stream=True,
            stream_options={'include_usage': True}, **GREEDY)
        return [c for c in stream][-1].usage

    def streamed_completion(prompt, max_tokens):
        return _stream_completion(spec_client, prompt, max_tokens)[1]
    texts = accepting.TEXTS
    before = scrape(spec_server.url, key=None)
    with ThreadPoolExecutor(5) as pool:
        usages = [f.result() for f in [
            pool.submit(completion, texts[0], 21), pool.submit(completion, texts[2], 14),
            pool.submit(streamed_completion, texts[1], 17),
            pool.submit(chat_completion, texts[3], 19), pool.submit(streamed_chat, texts[0], 16)]]
    after = scrape(spec_server.url, key=None)

    def grew(name):
        return after[name] - before.get(name, 0)
    specs = [_spec_stats(u) for u in usages]
    assert_real_acceptance(specs, SPEC_K)
    assert grew('lmdeploy_lite_spec_decode_num_drafts_total') == sum(s.num_drafts for s in specs)
    assert grew('lmdeploy_lite_spec_decode_num_draft_tokens_total') == \
        sum(s.num_draft_tokens for s in specs) == SPEC_K * sum(s.num_drafts for s in specs)
    accepted = sum(s.num_accepted_tokens for s in specs)
    assert grew('lmdeploy_lite_spec_decode_num_accepted_tokens_total') == accepted
    for position in range(SPEC_K):
        name = ('lmdeploy_lite_spec_decode_num_accepted_tokens_per_pos_total'
                f'{{position="{position}"}}')
        assert grew(name) == sum(s.accepted_per_position[position] for s in specs)
    for usage, s in zip(usages, specs):
        assert usage.spec_decode['mean_accepted_length'] == pytest.approx(s.mean_accepted_length)
    assert after['lmdeploy_lite_spec_decode_num_accepted_tokens_total'] <= \
        after['lmdeploy_lite_spec_decode_num_draft_tokens_total']
    assert 1 <= after['lmdeploy_lite_spec_decode_mean_accepted_length'] <= SPEC_K + 1
    assert grew('lmdeploy_lite_prompt_tokens_total') == sum(u.prompt_tokens for u in usages)
    assert grew('lmdeploy_lite_generation_tokens_total') == 21 + 14 + 17 + 19 + 16
    assert [u.completion_tokens for u in usages] == [21, 14, 17, 19, 16]
    assert grew('lmdeploy_lite_requests_total{outcome="length"}') == 5
    assert grew('lmdeploy_lite_time_to_first_token_seconds_count') == 5
    assert grew('lmdeploy_lite_time_per_output_token_seconds_count') == 5
    assert after['lmdeploy_lite_kv_blocks_used'] == 0
    assert after['lmdeploy_lite_num_requests_running'] == 0


# ---- bad requests -------------------------------------------------------------------------------
BAD_REQUESTS = {
    'invalid JSON': (dict(content='{"messages": [{"role": "user"'), None, 'not valid JSON'),
    'missing messages': (dict(payload={'model': MODEL}), 'messages', "'messages' is required"),
    'unknown model': (dict(payload={'model': 'gpt-9', 'messages': chat('hi')}), 'model',
                      'model="gpt-9": unknown; this server serves \'tiny\''),
    'max_tokens 0': (dict(payload={'messages': chat('hi'), 'max_tokens': 0}), 'max_tokens',
                     'max_tokens=0: must be in [1, 2147483647]'),
    'max_tokens -3': (dict(payload={'messages': chat('hi'), 'max_tokens': -3}), 'max_tokens',
                      'max_tokens=-3'),
    'temperature < 0': (dict(payload={'messages': chat('hi'), 'temperature': -0.5}),
                        'temperature', 'temperature=-0.5: must be in [0, inf)'),
    'top_p < 0': (dict(payload={'messages': chat('hi'), 'top_p': -0.1}), 'top_p',
                  'top_p=-0.1: must be in [0, 1]'),
    'top_p > 1': (dict(payload={'messages': chat('hi'), 'top_p': 1.5}), 'top_p',
                  'top_p=1.5: must be in [0, 1]'),
    'prompt too long': (dict(payload={'messages': chat('x ' * 300)}), 'messages',
                        f'session_len={SESSION_LEN}'),
    'n > 16': (dict(payload={'messages': chat('hi'), 'n': 17}), 'n',
               'n=17: must be in [1, 16]'),
    'empty messages': (dict(payload={'messages': []}), 'messages', 'at least 1 item'),
    'body not an object': (dict(payload=[1, 2]), None, 'must be a JSON object'),
}


@pytest.mark.timeout(120)
def test_bad_requests_get_400_and_the_server_keeps_serving(server, client):
    before = scrape(server.url)
    for case, (request, param, reason) in BAD_REQUESTS.items():
        r = post(server, '/v1/chat/completions', **request)
        assert r.status_code == 400, (case, r.text)
        error = r.json()['error']
        assert error['type'] == 'invalid_request_error', case
        assert reason in error['message'] and error['param'] == param, (case, error)
        ok = post(server, '/v1/chat/completions',
                  {'messages': chat('still there?'), 'max_tokens': 2, 'temperature': 0})
        assert ok.status_code == 200 and ok.json()['usage']['completion_tokens'] >= 1, case
    long_completion = post(server, '/v1/completions', {'prompt': list(range(3, 200))})
    assert long_completion.status_code == 400
    assert long_completion.json()['error']['param'] == 'prompt'
    with pytest.raises(openai.BadRequestError) as e:         # the official client's view
        client.chat.completions.create(model=MODEL, messages=chat('hi'), max_tokens=0)
    assert e.value.status_code == 400 and 'max_tokens=0' in e.value.message
    after = scrape(server.url)
    assert after['lmdeploy_lite_requests_total{outcome="invalid"}'] - \
        before['lmdeploy_lite_requests_total{outcome="invalid"}'] == len(BAD_REQUESTS) + 2


@pytest.mark.timeout(60)
def test_api_keys(server):
    for key in (None, 'wrong'):
        r = post(server, '/v1/chat/completions', {'messages': chat('hi'), 'max_tokens': 1},
                 key=key)
        assert r.status_code == 401 and r.json()['error']['code'] == 'invalid_api_key'
        for path in ('/v1/models', '/metrics', '/docs', '/redoc', '/openapi.json'):
            r = httpx.get(server.url + path, headers=headers(key))
            assert r.status_code == 401 and r.json()['error']['code'] == 'invalid_api_key', path
    assert httpx.get(server.url + '/health').status_code == 200           # open, for probes
    for path in ('/v1/models', '/metrics', '/docs', '/redoc', '/openapi.json'):
        assert httpx.get(server.url + path, headers=headers()).status_code == 200, path
    schema = httpx.get(server.url + '/openapi.json', headers=headers()).json()
    body = schema['paths']['/v1/chat/completions']['post']['requestBody']
    assert body['content']['application/json']['schema']['$ref'].endswith('ChatCompletionRequest')
    assert 'messages' in schema['components']['schemas']['ChatCompletionRequest']['properties']
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + '/v1', api_key='nope', max_retries=0).models.list()


# ---- load ----------------------------------------------------------------------------------------
@pytest.mark.timeout(240)
def test_64_concurrent_streams_get_the_text_they_get_alone(server, client):
    prompts = [f'def f{i}(' for i in range(16)]
    alone = {p: client.chat.completions.create(model=MODEL, messages=chat(p), max_tokens=6,
                                               **GREEDY).choices[0].message.content
             for p in prompts}
    before = scrape(server.url)

    results = asyncio.run(stream_texts(server.url, [prompts[i % 16] for i in range(64)], 6))
    assert [finish for _, finish in results] == ['length'] * 64
    assert [text for text, _ in results] == [alone[prompts[i % 16]] for i in range(64)]
    after = scrape(server.url)
    assert after['lmdeploy_lite_requests_total{outcome="length"}'] - \
        before['lmdeploy_lite_requests_total{outcome="length"}'] == 64       # none lost
    assert after['lmdeploy_lite_num_requests_in_flight'] == 0
    assert after['lmdeploy_lite_kv_blocks_used'] == 0


@pytest.mark.timeout(180)
def test_clients_that_disconnect_mid_stream_free_their_blocks(server):
    before = scrape(server.url)

    async def leave_early(http, i: int) -> int:
        payload = {'messages': chat(f'story {i}'), 'max_tokens': 100, 'stream': True,
                   'temperature': 0, 'ignore_eos': True}
        received = 0
        async with http.stream('POST', '/v1/chat/completions', json=payload) as r:
            async for line in r.aiter_lines():
                received += line.startswith('data: ')
                if received == 3:                  # the opening chunk and two of text
                    break
        return received                            # leaving the block closes the connection

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=60,
                                     headers={'Authorization': f'Bearer {KEY}'}) as http:
            return await asyncio.wait_for(asyncio.gather(*(leave_early(http, i)
                                                           for i in range(16))), 120)
    assert asyncio.run(run()) == [3] * 16
    deadline = time.monotonic() + 60
    while True:
        m = scrape(server.url)
        aborted = (m['lmdeploy_lite_requests_total{outcome="abort"}']
                   - before['lmdeploy_lite_requests_total{outcome="abort"}'])
        if aborted == 16 and m['lmdeploy_lite_kv_blocks_used'] == 0 and \
                m['lmdeploy_lite_num_requests_running'] == 0 and \
                m['lmdeploy_lite_num_requests_waiting'] == 0:
            break
        assert time.monotonic() < deadline, f'after 60 s: {aborted} aborted, {m}'
        time.sleep(0.2)
    assert m['lmdeploy_lite_requests_total{outcome="length"}'] == \
        before['lmdeploy_lite_requests_total{outcome="length"}']         # none ran to the end
    assert m['lmdeploy_lite_num_requests_in_flight'] == 0
    ok = post(server, '/v1/completions', {'prompt': 'x', 'max_tokens': 2})
    assert ok.status_code == 200


# ---- data parallel: front-end metrics and shutdown -------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_dp2_metrics_and_sigterm_shutdown_leaves_no_process(dp2_server):
    """Also the API keys from --api-keys-file, which never show on the command line (the keys
    from the environment and SIGINT: test_api_server_robustness.py, on one process). The server
    (tests/serve/conftest.py): --dp 2, MTP k=K, keys from its workdir's file (file-key-1 and
    file-key-2), and a session long enough that the streamed request below is still running when
    SIGTERM lands, even on a loaded machine (with 128 tokens it could finish first: 'length')."""
    key, srv = 'file-key-2', dp2_server
    assert srv.proc.args[-8:] == ['--dp', '2', '--speculative-num-draft-tokens', str(K),
                                  '--session-len', '2048', '--api-keys-file',
                                  str(srv.workdir / 'keys')]
    assert (srv.workdir / 'keys').read_text() == '# the server keys\nfile-key-1\n\nfile-key-2\n'
    try:
        with open(f'/proc/{srv.proc.pid}/cmdline', 'rb') as f:
            assert key.encode() not in f.read()
        for path in ('/v1/models', '/metrics', '/openapi.json'):
            assert httpx.get(srv.url + path, timeout=10).status_code == 401
            assert httpx.get(srv.url + path, headers=headers(key), timeout=10).status_code == 200
        workers = srv.children()
        assert len(workers) >= 2
        # the ranks meet through a file and loopback links: nothing listens on the network
        sockets = listening([srv.proc.pid, *workers])
        assert any(port == srv.port for _, port in sockets)
        assert all(is_loopback_hex(a) for a, _ in sockets), sockets
        r = post(srv, '/v1/completions', {'prompt': 'def main(', 'max_tokens': 6,
                                          'temperature': 0, 'ignore_eos': True}, key=key).json()
        spec = r['usage']['spec_decode']
        assert r['usage']['num_preemptions'] == 0             # the extension, through the ranks
        m = scrape(srv.url, key)
        assert m['lmdeploy_lite_spec_decode_num_drafts_total'] == spec['num_drafts'] > 0
        assert m['lmdeploy_lite_spec_decode_num_draft_tokens_total'] == spec['num_draft_tokens']
        assert m['lmdeploy_lite_spec_decode_num_accepted_tokens_total'] == \
            spec['num_accepted_tokens']
        assert m['lmdeploy_lite_num_requests_in_flight'] == 0
        assert m['lmdeploy_lite_kv_blocks_total'] > 0          # as the ranks reported
        assert m['lmdeploy_lite_prefix_cache_cached_blocks'] >= 0     # as the ranks reported
        cached = r['usage']['prompt_tokens_details']['cached_tokens']   # through the ranks
        assert type(cached) is int and 0 <= cached < r['usage']['prompt_tokens']
        assert m['lmdeploy_lite_prefix_cache_queried_tokens_total'] == r['usage']['prompt_tokens']
        assert m['lmdeploy_lite_prefix_cache_hit_tokens_total'] == cached

        lines, reader = stream_in_background(srv, '/v1/chat/completions', {
            'messages': chat('go on'), 'max_tokens': 2000, 'temperature': 0,
            'ignore_eos': True}, key=key)
        srv.proc.send_signal(signal.SIGTERM)
        srv.proc.wait(60)
        reader.join(30)
        assert srv.proc.returncode == 0, srv.output()                  # as asked: a success
        assert lines[-1] == '[DONE]'                     # the stream ended cleanly ...
        finish = [json.loads(x)['choices'][0]['finish_reason'] for x in lines[:-1]]
        assert finish[-1] == 'abort'                     # ... as an aborted request
        alive = left_alive(workers)          # the fork server follows within a second
        assert not alive, f'orphaned worker processes {alive}'
    finally:
        srv.stop()


# ---- packaging ------------------------------------------------------------------------------
def test_serve_without_the_extra_is_a_clear_error(capsys):
    from lmdeploy_lite.cli import main as cli
    saved = sys.modules.get('fastapi')
    sys.modules['fastapi'] = None                         # as if not installed
    try:
        assert cli.main(['serve', 'api_server', '/nowhere']) == 2
    finally:
        if saved is None:
            del sys.modules['fastapi']
        else:
            sys.modules['fastapi'] = saved
    err = capsys.readouterr().err
    assert 'missing: fastapi' in err and "pip install 'lmdeploy_lite[serve]'" in err


def test_importing_the_package_needs_no_server_dependencies():
    code = ('import sys, lmdeploy_lite, lmdeploy_lite.api, lmdeploy_lite.cli.main; '
            'bad = [m for m in ("fastapi", "uvicorn", "prometheus_client") '
            'if m in sys.modules]; assert not bad, bad')
    out = subprocess.run([sys.executable, '-c', code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
