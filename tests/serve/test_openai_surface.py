"""The OpenAI surface that real clients accept (issue 36, item 4) and the server's operations
(item 5): every field of OpenAI's request schemas is honoured, accepted with no effect or refused
by name; /v1/models/{id}, /tokenize, /detokenize; CORS; a taken port fails before the model
loads; the command line's fixed choices, aliases, defaults and --version.

The live server (the session's tiny-model `server`) for what a client sees; the app in this
process on a stand-in pipeline for what reaches the template and for CORS; the CLI in a
subprocess only for the port."""
import asyncio
import json
import socket
import subprocess
import sys
import time

import pytest

for _module in ('fastapi', 'uvicorn', 'prometheus_client'):
    pytest.importorskip(_module, reason="needs the 'serve' extra")
openai = pytest.importorskip('openai')
httpx = pytest.importorskip('httpx')

from lmdeploy_lite.cli.main import build_parser  # noqa: E402
from tests.serve.live_server import MODEL, ROOT, chat, headers, post, sse_events  # noqa: E402
from tests.serve.test_api_server_robustness import FakePipe  # noqa: E402

GREEDY = dict(max_tokens=5, temperature=0, extra_body={'ignore_eos': True})
# what LangChain's ChatOpenAI sends besides the usual sampling fields
LANGCHAIN = [{'role': 'system', 'content': 'be brief', 'name': 'rules'},
             {'role': 'user', 'content': 'hi', 'name': 'alice'},
             {'role': 'assistant', 'content': 'hello', 'name': 'bot'},
             {'role': 'user', 'content': [{'type': 'text', 'text': 'and you?'}], 'name': 'alice'}]
NO_EFFECT = dict(metadata={'run': 'eval-7'}, store=False, user='u-1', service_tier='auto',
                 safety_identifier='s-1', prompt_cache_key='k-1',
                 prediction={'type': 'content', 'content': 'hi'}, modalities=['text'])


# ---- through the live server and the official client --------------------------------------------
@pytest.mark.timeout(60)
def test_langchain_style_requests_get_200_and_the_answer_they_get_without_the_extras(client):
    plain = client.chat.completions.create(
        model=MODEL, messages=[{k: v for k, v in m.items() if k != 'name'} for m in LANGCHAIN],
        **GREEDY)
    dressed = client.chat.completions.create(model=MODEL, messages=LANGCHAIN, **NO_EFFECT,
                                             **GREEDY)
    assert dressed.choices[0].message.content == plain.choices[0].message.content
    assert dressed.usage.completion_tokens == 5        # the tiny template does not show names
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=LANGCHAIN, stream=True, **NO_EFFECT, **GREEDY,
        stream_options={'include_usage': True, 'include_obfuscation': False}))
    assert ''.join(c.choices[0].delta.content or '' for c in chunks if c.choices) == \
        plain.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 5
    completion = client.completions.create(model=MODEL, prompt='def main(', user='u-1',
                                           **GREEDY)
    assert completion.usage.completion_tokens == 5


@pytest.mark.timeout(60)
def test_openai_ranges_a_negative_seed_and_top_p_0_are_honoured(client):
    """OpenAI's seed is an int64: -1 draws as the uint64 2**64 - 1; top_p 0 keeps the most
    likely token alone: greedy."""
    def text(**fields) -> str:
        return client.completions.create(model=MODEL, prompt='def', max_tokens=4,
                                         extra_body={'ignore_eos': True},
                                         **fields).choices[0].text
    assert text(seed=-1, temperature=1) == text(seed=2**64 - 1, temperature=1)
    assert text(top_p=0, temperature=1) == text(temperature=0)


@pytest.mark.timeout(60)
def test_echo_writes_each_prompt_before_its_choices_streamed_or_not(server, client):
    """A prompt string as sent, token ids decoded (/detokenize's text); streamed, in a first
    chunk of each choice."""
    prompts, ids = ['def f(', 'class A'], [5, 6, 7]
    ask = dict(model=MODEL, max_tokens=3, temperature=0, n=2, extra_body={'ignore_eos': True})
    plain = client.completions.create(prompt=prompts, **ask).choices
    echoed = client.completions.create(prompt=prompts, echo=True, **ask).choices
    assert [c.text for c in echoed] == [prompts[c.index // 2] + c.text for c in plain]
    chunks = list(client.completions.create(prompt=ids, echo=True, stream=True, **ask))
    text = post(server, '/detokenize', {'tokens': ids}).json()['prompt']
    assert [(c.choices[0].index, c.choices[0].text) for c in chunks[:2]] == [(0, text), (1, text)]


@pytest.mark.timeout(60)
def test_best_of_returns_the_candidates_with_the_best_mean_logprob(spec_client):
    """best_of=3 runs the choices n=3 runs (choice i samples with seed + i) and returns the n=2
    whose tokens have the highest mean log-probability, best first; usage counts all three."""
    ask = dict(model='embedded', prompt='def f(', max_tokens=4, temperature=1, seed=5,
               extra_body={'ignore_eos': True})
    candidates = spec_client.completions.create(n=3, logprobs=0, **ask)
    ranked = sorted(candidates.choices, key=lambda c: -sum(c.logprobs.token_logprobs))
    best = spec_client.completions.create(n=2, best_of=3, **ask)
    assert [c.text for c in best.choices] == [c.text for c in ranked[:2]]
    assert [c.index for c in best.choices] == [0, 1] and best.choices[0].logprobs is None
    assert best.usage.completion_tokens == candidates.usage.completion_tokens == 12


def streamed(server, path: str, body: dict) -> list[dict]:
    with httpx.stream('POST', server.url + path, json=body, headers=headers(),
                      timeout=60) as r:
        return [json.loads(data) for data in sse_events(r.iter_lines()) if data != '[DONE]']


@pytest.mark.timeout(60)
def test_every_document_validates_as_the_openai_types(server):
    """The official client builds its objects unvalidated; its types' own validation (what a
    typed client checks) passes every document: n choices with logprobs, streamed with the
    usage chunk (no choices), the models. A streamed completion chunk before the last has
    finish_reason null, which the Completion type (a whole response) does not allow."""
    from openai.types import Completion, Model
    from openai.types.chat import ChatCompletion, ChatCompletionChunk
    usage = {'stream': True, 'stream_options': {'include_usage': True}}
    body = {'messages': chat('hi'), 'max_tokens': 3, 'n': 2, 'logprobs': True, 'top_logprobs': 2}
    ChatCompletion.model_validate(post(server, '/v1/chat/completions', body).json())
    chunks = streamed(server, '/v1/chat/completions', {**body, **usage})
    assert [ChatCompletionChunk.model_validate(chunk) for chunk in chunks][-1].choices == []
    body = {'prompt': ['def', 'class'], 'max_tokens': 3, 'n': 2, 'logprobs': 2}
    Completion.model_validate(post(server, '/v1/completions', body).json())
    chunks = streamed(server, '/v1/completions', {**body, **usage})
    assert {c['index'] for chunk in chunks for c in chunk['choices']} == {0, 1, 2, 3}
    for chunk in chunks:
        if all(choice['finish_reason'] for choice in chunk['choices']):
            Completion.model_validate(chunk)
    assert chunks[-1]['usage']['completion_tokens'] == 12
    for path in ('/v1/models', f'/v1/models/{MODEL}'):
        card = httpx.get(server.url + path, headers=headers(), timeout=10).json()
        for each in card.get('data', [card]):
            Model.model_validate(each)


REFUSED = [    # (endpoint, fields, param, a piece of the message)
    ('chat', {'temprature': 0.5}, 'temprature', 'unknown field'),
    ('chat', {'max_token': 2}, 'max_token', 'unknown field'),
    ('completions', {'metadata': {'a': 'b'}}, 'metadata', 'unknown field'),  # a chat field
    ('chat', {'stream_options': {'include_usage': True}}, 'stream_options',
     'only allowed with "stream": true'),
    ('completions', {'stream_options': {'include_usage': True}, 'stream': False},
     'stream_options', 'only allowed with "stream": true'),
    ('chat', {'reasoning_effort': 'low'}, 'reasoning_effort', 'not supported'),
    ('chat', {'modalities': ['text', 'audio']}, 'modalities', 'generates text only'),
    ('chat', {'audio': {'voice': 'alloy', 'format': 'wav'}}, 'audio', 'generates text only'),
    ('chat', {'web_search_options': {}}, 'web_search_options', 'no web search'),
    ('chat', {'verbosity': 'low'}, 'verbosity', 'not supported'),
    ('chat', {'moderation': {'model': 'omni-moderation-latest'}}, 'moderation', 'not supported'),
    ('chat', {'service_tier': 'cheapest'}, 'service_tier', "'auto'"),
    ('chat', {'metadata': {'n': 1}}, 'metadata.n', 'must be a string'),
    ('chat', {'messages': [{'role': 'user', 'content': 'x', 'nmae': 'a'}]}, 'messages.0.nmae',
     'unknown field'),
    ('chat', {'messages': [{'role': 'assistant', 'content': 'x', 'audio': {'id': 'a1'}}]},
     'messages.0.audio', 'generates text only'),
    ('chat', {'messages': [{'role': 'user', 'content': 'x', 'refusal': 'no'}]},
     'messages.0.refusal', 'only assistant messages'),
    ('chat', {'messages': [{'role': 'tool', 'content': 'x', 'tool_call_id': 'c', 'name': 'f'}]},
     'messages.0.name', "a 'tool' message has no name"),
    ('chat', {'messages': chat('x') + [{'role': 'function', 'name': 'f', 'content': '1'}]},
     'messages.1.role', "send the result as a 'tool' message; allowed: 'system'"),
    ('chat', {'messages': [{'role': 'user', 'content': [{'type': 'input_audio', 'input_audio': {
        'data': 'UklG', 'format': 'wav'}}]}]}, 'messages.0.content.0.type', 'read text only'),
]


@pytest.mark.timeout(60)
def test_typos_stream_options_without_stream_and_unsupported_fields_get_400_naming_them(server):
    for endpoint, fields, param, fragment in REFUSED:
        base = {'messages': chat('hi')} if endpoint == 'chat' else {'prompt': 'def'}
        r = post(server, '/v1/chat/completions' if endpoint == 'chat' else '/v1/completions',
                 {**base, 'max_tokens': 1, **fields})
        assert r.status_code == 400, (fields, r.text)
        error = r.json()['error']
        assert error['param'] == param and fragment in error['message'], (fields, error)


@pytest.mark.timeout(60)
def test_loading_was_shown_and_models_retrieve_works_and_an_unknown_id_gets_404(server,
                                                                             client):
    with open(server.log.name) as log:        # at the default log level (WARNING)
        lines = log.read()
    assert 'lmdeploy_lite: loading ' in lines and 'lmdeploy_lite: loaded in ' in lines
    card = client.models.retrieve(MODEL)
    assert (card.id, card.object) == (MODEL, 'model')
    for unknown in ('gpt-4o', 'Qwen/Qwen3.5-0.8B'):
        with pytest.raises(openai.NotFoundError) as e:
            client.models.retrieve(unknown)
        assert e.value.body['code'] == 'model_not_found' and MODEL in e.value.message


@pytest.mark.timeout(60)
def test_tokenize_gives_the_ids_the_endpoints_run_and_detokenize_inverts_it(server, client):
    text = 'def main(): return 42'
    ids = post(server, '/tokenize', {'prompt': text, 'model': MODEL}).json()
    assert ids['count'] == len(ids['tokens']) and ids['max_model_len'] == 128
    assert ids['count'] == client.completions.create(
        model=MODEL, prompt=text, max_tokens=1).usage.prompt_tokens
    assert post(server, '/detokenize', {'tokens': ids['tokens']}).json() == {'prompt': text}
    with_strs = post(server, '/tokenize', {'prompt': text, 'return_token_strs': True}).json()
    assert len(with_strs['token_strs']) == ids['count']

    conversation = post(server, '/tokenize', {'messages': LANGCHAIN}).json()
    assert conversation['count'] == client.chat.completions.create(
        model=MODEL, messages=LANGCHAIN, max_tokens=1).usage.prompt_tokens
    open_turn = post(server, '/tokenize', {'messages': LANGCHAIN,
                                           'add_generation_prompt': False}).json()
    assert open_turn['tokens'] == conversation['tokens'][:open_turn['count']]
    assert open_turn['count'] < conversation['count']
    rendered = post(server, '/detokenize', {'tokens': conversation['tokens']}).json()['prompt']
    assert rendered.endswith('and you?<|im_end|>\n<|im_start|>assistant\n')

    for path, body, param in (('/tokenize', {'prompt': 'x', 'messages': chat('x')}, None),
                              ('/tokenize', {}, None),
                              ('/tokenize', {'prompt': 'x', 'model': 'other'}, 'model'),
                              ('/tokenize', {'prompt': 'x', 'add_special_token': True},
                               'add_special_token'),
                              ('/detokenize', {'tokens': [1, 10**6]}, 'tokens.1'),
                              ('/detokenize', {'tokens': [-1]}, 'tokens.0'),
                              ('/detokenize', {'tokens': 'abc'}, 'tokens')):
        r = post(server, path, body)
        assert r.status_code == 400 and r.json()['error']['param'] == param, (body, r.text)


# ---- the app in this process --------------------------------------------------------------------
class RecordingPipe(FakePipe):
    """FakePipe that keeps the chat messages the server hands to `encode`."""

    def __init__(self):
        super().__init__()
        self.messages = []

    def encode(self, prompt):
        if isinstance(prompt, list):
            self.messages.append(prompt)
        return super().encode(prompt)


def _call(app, calls: list[tuple]) -> list[httpx.Response]:
    """calls: (method, path, headers, json body or None)."""
    async def run():
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url='http://127.0.0.1:23333',
                                     timeout=30) as http:
            return [await http.request(method, path, headers=headers, json=body)
                    for method, path, headers, body in calls]
    return asyncio.run(run())


def test_names_and_refusals_reach_the_chat_template_as_messages_fields():
    from lmdeploy_lite.serve.openai.api_server import create_app
    pipe = RecordingPipe()
    history = [{'role': 'developer', 'content': 'be brief', 'name': 'rules'},
               {'role': 'assistant', 'content': None, 'refusal': 'I cannot.'},
               {'role': 'assistant', 'content': [{'type': 'refusal', 'refusal': 'No'},
                                                 {'type': 'text', 'text': '!'}]},
               {'role': 'user', 'content': 'hi', 'name': 'alice'}]
    r, = _call(create_app(pipe, 'fake'), [('POST', '/v1/chat/completions', {},
                                           {'messages': history, 'metadata': {'a': 'b'}})])
    assert r.status_code == 200, r.text
    assert pipe.messages == [[{'role': 'system', 'content': 'be brief', 'name': 'rules'},
                              {'role': 'assistant', 'content': 'I cannot.'},
                              {'role': 'assistant', 'content': 'No!'},
                              {'role': 'user', 'content': 'hi', 'name': 'alice'}]]


def test_cors_headers_only_for_allowed_origins_and_preflights_need_no_key():
    from lmdeploy_lite.serve.openai.api_server import create_app
    site = 'https://app.example'
    preflight = ('OPTIONS', '/v1/chat/completions', {
        'Origin': site, 'Access-Control-Request-Method': 'POST',
        'Access-Control-Request-Headers': 'authorization,content-type'}, None)
    calls = [preflight,
             ('GET', '/v1/models', {'Origin': site, 'Authorization': 'Bearer k'}, None),
             ('GET', '/v1/models', {'Origin': site}, None),                      # 401
             ('GET', '/v1/models', {'Origin': 'https://evil.example',
                                    'Authorization': 'Bearer k'}, None)]
    allowed = _call(create_app(FakePipe(), 'fake', api_keys=['k'], bound_host='127.0.0.1',
                               allow_origins=(site,)), calls)
    assert [r.status_code for r in allowed] == [200, 200, 401, 200]
    assert [r.headers.get('access-control-allow-origin') for r in allowed] == [site] * 3 + [None]
    assert 'authorization' in allowed[0].headers['access-control-allow-headers']
    closed = _call(create_app(FakePipe(), 'fake', api_keys=['k']), calls[1:2])
    assert 'access-control-allow-origin' not in closed[0].headers


def test_a_model_without_a_tokenizer_gets_400_from_tokenize():
    from lmdeploy_lite.serve.openai.api_server import create_app
    r, = _call(create_app(FakePipe(), 'fake'), [('POST', '/tokenize', {}, {'prompt': 'x'})])
    assert r.status_code == 400 and r.json()['error']['code'] == 'no_tokenizer'


# ---- the command line ---------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_a_taken_port_fails_before_the_model_loads_naming_host_and_port(tmp_path):
    """The model directory does not exist: had the server loaded it first, that would be the
    error."""
    with socket.socket() as taken:
        taken.bind(('127.0.0.1', 0))
        taken.listen()
        port = taken.getsockname()[1]
        start = time.monotonic()
        done = subprocess.run([sys.executable, '-m', 'lmdeploy_lite.cli.main', 'serve',
                               'api_server', str(tmp_path / 'no-such-model'), '--device', 'cpu',
                               '--port', str(port)], cwd=ROOT, capture_output=True, text=True,
                              timeout=30)
        elapsed = time.monotonic() - start
    assert done.returncode == 3, done.stderr
    assert f'cannot listen on 127.0.0.1:{port}: Address already in use' in done.stderr
    assert 'serving' not in done.stdout and 'no-such-model' not in done.stderr
    assert elapsed < 5, elapsed      # ~0.3 s: the interpreter and the CLI's light imports


def test_fixed_log_levels_vllm_aliases_defaults_in_help_and_version(capsys):
    parser = build_parser()
    with pytest.raises(SystemExit) as e:
        parser.parse_args(['serve', 'api_server', '--log-level', 'verbose'])
    assert e.value.code == 2 and "invalid choice: 'VERBOSE'" in capsys.readouterr().err
    args = parser.parse_args(['serve', 'api_server', '--log-level', 'info', '--port', '8000',
                              '--host', '0.0.0.0', '--served-model-name', 'm',
                              '--max-model-len', '64', '--tensor-parallel-size', '2',
                              '--data-parallel-size', '2', '--allowed-origins', '*'])
    assert (args.log_level, args.server_port, args.server_name, args.model_name,
            args.session_len, args.tp, args.dp, args.allow_origins) == \
        ('INFO', 8000, '0.0.0.0', 'm', 64, 2, 2, ['*'])
    with pytest.raises(SystemExit):
        parser.parse_args(['serve', 'api_server', '--help'])
    help_text = ' '.join(capsys.readouterr().out.split())
    for shown in ('--server-port SERVER_PORT, --port SERVER_PORT', '(default: 23333)',
                  '(default: WARNING)', '--allow-origins'):
        assert shown in help_text, shown
    with pytest.raises(SystemExit) as e:
        parser.parse_args(['--version'])
    assert e.value.code == 0 and capsys.readouterr().out.startswith('lmdeploy_lite 0.')
