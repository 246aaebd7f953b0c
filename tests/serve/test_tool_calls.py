"""Tool calls on /v1/chat/completions (issue 22, part 4) and the parameters still refused by name
(part 5), through the official `openai` client.

The tiny model's random weights never write a tool call, so the output side runs the server's
app in this process on a stand-in pipeline: its prompts go through the real `Pipeline.encode`
(the tiny tokenizer's chat template, which lays tools out as Qwen3.5's does) and its "model"
writes a fixed text. The real server checks that tools and a tool-call history reach the
template, forces calls and JSON through a grammar (the output is then well formed whatever the
weights), and refuses what it cannot do."""
import asyncio
import json
from types import SimpleNamespace

import pytest

for _module in ('fastapi', 'uvicorn', 'prometheus_client'):
    pytest.importorskip(_module, reason="needs the 'serve' extra")
openai = pytest.importorskip('openai')
httpx = pytest.importorskip('httpx')

from lmdeploy_lite.api import Pipeline  # noqa: E402
from lmdeploy_lite.pytorch.engine.executor.client import EngineStats  # noqa: E402
from lmdeploy_lite.messages import Response  # noqa: E402
from lmdeploy_lite.tokenizer import load_tokenizer  # noqa: E402
from tests.serve.live_server import MODEL, chat  # noqa: E402

WEATHER = {'type': 'function', 'function': {
    'name': 'get_weather', 'description': 'The weather of a city',
    'parameters': {'type': 'object', 'properties': {'city': {'type': 'string'},
                                                     'days': {'type': 'integer'}}}}}
TINY_TOOL = {'type': 'function', 'function': {'name': 'f', 'description': 'g'}}
PARIS = ('<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n'
         '<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>')
ROME = PARIS.replace('Paris', 'Rome').replace('\n2\n', '\n1\n')
OUTPUTS = {     # what the stand-in model writes when the last user message is the key
    'two calls': 'Let me look.\n\n' + PARIS + '\n' + ROME,
    'malformed': 'Let me look.\n\n<tool_call>\n{"name": "get_weather"}\n</tool_call>',
    'plain': 'It is sunny.',
}
HISTORY = [
    {'role': 'user', 'content': 'plain'},
    {'role': 'assistant', 'content': None, 'tool_calls': [
        {'id': 'call_1', 'type': 'function',
         'function': {'name': 'get_weather', 'arguments': '{"city": "Paris", "days": 2}'}}]},
    {'role': 'tool', 'tool_call_id': 'call_1', 'content': 'sunny'},
]


class ScriptedPipe:
    """Renders prompts with the real Pipeline.encode, answers with OUTPUTS in 5-character
    chunks; `prompts` keeps each rendered prompt as text."""
    encode = Pipeline.encode
    _check_template_renders = Pipeline._check_template_renders
    # the server reads a pipeline through these (over `_client`, as Pipeline's own do)
    error, session_len, vocab_size = Pipeline.error, Pipeline.session_len, Pipeline.vocab_size
    validate_request, stats = Pipeline.validate_request, Pipeline.stats
    reasoning = False

    def __init__(self, model_dir: str):
        self.model_path, self.tokenizer = model_dir, load_tokenizer(model_dir)
        self._client = SimpleNamespace(session_len=4096, model_config=SimpleNamespace(
            vocab_size=512), error=None, validate_request=lambda ids, config: None,
            close=lambda: None, stats=EngineStats)
        self.prompts = []

    async def generate_ids(self, prompts, gen_config, stream_text=True, request_id=None):
        """Every choice of every prompt the same script, their chunks interleaved."""
        scripts = []
        for i in range(len(prompts) * gen_config.n):
            scripts.append([r async for r in self.generate(prompts[i // gen_config.n],
                                                           gen_config, stream_text)])
            for r in scripts[-1]:
                r.index = i
        for step in range(max(map(len, scripts))):
            for script in scripts:
                if step < len(script):
                    yield script[step]

    async def generate(self, ids, gen_config, stream_text=True):
        prompt = self.tokenizer.decode(ids)
        self.prompts.append(prompt)
        key = next(k for k in OUTPUTS if f'<|im_start|>user\n{k}<|im_end|>' in prompt)
        pieces = [OUTPUTS[key][i:i + 5] for i in range(0, len(OUTPUTS[key]), 5)]
        for n, piece in enumerate(pieces, 1):
            yield Response(text=piece, token_ids=[7], input_token_len=len(ids),
                           generate_token_len=n, finish_reason='stop' if n == len(pieces) else None)


@pytest.fixture(scope='module')
def scripted(model_dir):
    """call(**request) -> (the non-streamed completion, the streamed chunks, the prompt)."""
    from lmdeploy_lite.serve.openai.api_server import create_app
    pipe = ScriptedPipe(model_dir)
    ask = asker(create_app(pipe, MODEL))

    def call(**request):
        whole, chunks = ask(**request)
        assert pipe.prompts[-1] == pipe.prompts[-2]
        return whole, chunks, pipe.prompts[-1]
    return call


def asker(app):
    """ask(**request) -> (the non-streamed completion, the streamed chunks) from `app`, through
    the official client in this process."""
    async def both(request: dict):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url='http://test') as http:
            client = openai.AsyncOpenAI(base_url='http://test/v1', api_key='-', http_client=http,
                                        max_retries=0)
            whole = await client.chat.completions.create(model=MODEL, **request)
            chunks = [c async for c in await client.chat.completions.create(
                model=MODEL, stream=True, **request)]
        return whole, chunks
    return lambda **request: asyncio.run(both(request))


def joined(chunks) -> tuple[str, list[tuple], str]:
    """(content, [(index, id, name, arguments)], finish_reason) of streamed chunks, as a client
    adds them up."""
    content, calls, finish = '', {}, None
    for chunk in chunks:
        delta = chunk.choices[0].delta
        content += delta.content or ''
        for call in delta.tool_calls or ():
            old = calls.setdefault(call.index, [call.index, '', '', ''])
            old[1] += call.id or ''
            old[2] += call.function.name or ''
            old[3] += call.function.arguments or ''
        finish = chunk.choices[0].finish_reason or finish
    return content, [tuple(c) for c in calls.values()], finish


def calls_of(message) -> list[tuple]:
    return [(i, c.id, c.function.name, c.function.arguments)
            for i, c in enumerate(message.tool_calls or ())]


def test_tool_calls_come_back_streamed_and_not(scripted):
    whole, chunks, prompt = scripted(messages=chat('two calls'), tools=[WEATHER])
    assert '<tools>\n' + json.dumps(WEATHER) + '\n</tools>' in prompt      # tojson, as Qwen3.5
    message, choice = whole.choices[0].message, whole.choices[0]
    assert choice.finish_reason == 'tool_calls' and message.content == 'Let me look.'
    assert [(c.type, c.function.name, json.loads(c.function.arguments))
            for c in message.tool_calls] == [
        ('function', 'get_weather', {'city': 'Paris', 'days': 2}),
        ('function', 'get_weather', {'city': 'Rome', 'days': 1})]
    content, calls, finish = joined(chunks)
    assert (content, finish) == ('Let me look.', 'tool_calls')
    assert [c[2:] for c in calls] == [c[2:] for c in calls_of(message)]
    assert [c[0] for c in calls] == [0, 1] and all(c[1].startswith('call_') for c in calls)
    one = scripted(messages=chat('two calls'), tools=[WEATHER], parallel_tool_calls=False)
    assert [c[2:] for c in calls_of(one[0].choices[0].message)] == [c[2:] for c in calls[:1]]
    assert [c[2:] for c in joined(one[1])[1]] == [c[2:] for c in calls[:1]]


@pytest.mark.parametrize('request_fields, output', [
    ({'tools': [WEATHER], 'tool_choice': 'none'}, 'two calls'),   # as vLLM: tools shown, no parse
    ({}, 'two calls'),
    ({'tools': [WEATHER]}, 'malformed'),
    ({'tools': [WEATHER], 'tool_choice': 'auto'}, 'plain'),
])
def test_text_stays_text_without_parsing_or_with_no_well_formed_call(scripted, request_fields,
                                                                     output):
    whole, chunks, prompt = scripted(messages=chat(output), **request_fields)
    assert ('<tools>' in prompt) == ('tools' in request_fields)
    assert (whole.choices[0].message.content, whole.choices[0].finish_reason) == \
        (OUTPUTS[output], 'stop')
    assert whole.choices[0].message.tool_calls is None
    assert joined(chunks) == (OUTPUTS[output], [], 'stop')


def test_a_tool_call_history_reaches_the_template(scripted):
    _, _, prompt = scripted(messages=HISTORY, tools=[WEATHER])
    assert prompt.endswith(
        '<|im_start|>user\nplain<|im_end|>\n<|im_start|>assistant\n<tool_call>\n'
        '<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n'
        '</parameter>\n</function>\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n'
        'sunny\n</tool_response><|im_end|>\n<|im_start|>assistant\n')


# ---- the real server ------------------------------------------------------------------------------
def template_length(model_dir: str, messages: list[dict], tools=None) -> int:
    """The prompt's length as the tokenizer renders it (tool call arguments as dicts)."""
    messages = json.loads(json.dumps(messages))
    for m in messages:
        for call in m.get('tool_calls') or ():
            call['function']['arguments'] = json.loads(call['function']['arguments'])
    return len(load_tokenizer(model_dir).apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False))


@pytest.mark.timeout(60)
def test_the_real_server_renders_tools_and_tool_history(client, model_dir):
    call = {'id': 'c', 'type': 'function', 'function': {'name': 'f', 'arguments': '{"x": 1}'}}
    history = [{'role': 'user', 'content': 'hi'},
               {'role': 'assistant', 'content': None, 'tool_calls': [call]},
               {'role': 'tool', 'tool_call_id': 'c', 'content': '2'}]
    for messages, tools in ((chat('hi'), [TINY_TOOL]), (history, None)):    # each fits 128 tokens
        done = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1,
                                              temperature=0, **({'tools': tools} if tools else {}))
        assert done.usage.prompt_tokens == template_length(model_dir, messages, tools)
    plain = client.chat.completions.create(model=MODEL, messages=chat('hi'), max_tokens=1)
    assert plain.usage.prompt_tokens < template_length(model_dir, chat('hi'), [TINY_TOOL])


def test_a_template_without_tools_gets_400_naming_tools(spec_client):
    with pytest.raises(openai.BadRequestError) as e:    # the embedded model's template
        spec_client.chat.completions.create(model='embedded', messages=chat('hi'), max_tokens=1,
                                            tools=[TINY_TOOL])
    assert e.value.body['param'] == 'tools' and 'does not render tools' in e.value.message
    assert spec_client.chat.completions.create(model='embedded', messages=chat('hi'),
                                               max_tokens=1).usage.completion_tokens == 1


REFUSED = [      # (fields, the parameter named, a piece of the message)
    ({'response_format': {'type': 'json_schema', 'json_schema': {'name': 'x', 'schema': {
        'type': 'nonsense'}}}}, 'response_format', 'json_schema.schema: xgrammar cannot compile'),
    ({'response_format': {'type': 'xml'}}, 'response_format', 'must be an object whose type'),
    ({'tool_choice': 'required'}, 'tool_choice', 'forcing a call needs "tools"'),
    ({'tool_choice': {'type': 'function', 'function': {'name': 'g'}}, 'tools': [TINY_TOOL]},
     'tool_choice', 'names no function of "tools" (f)'),
    ({'tool_choice': 'required', 'tools': [TINY_TOOL], 'response_format': {'type': 'json_object'}},
     'tool_choice', 'cannot both hold the output'),
    ({'tool_choice': {'type': 'custom', 'custom': {'name': 'f'}}, 'tools': [TINY_TOOL]},
     'tool_choice', 'must be "none", "auto", "required", {"type": "function"'),
    ({'tool_choice': {'type': 'allowed_tools', 'allowed_tools': {'mode': 'auto', 'tools': [
        {'type': 'function', 'function': {'name': 'q'}}]}}, 'tools': [TINY_TOOL]},
     'tool_choice', 'names no function of "tools" (f): q'),
    ({'tool_choice': {'type': 'allowed_tools', 'allowed_tools': {'mode': 'any', 'tools': [
        {'type': 'function', 'function': {'name': 'f'}}]}},
      'tools': [TINY_TOOL]}, 'tool_choice.allowed_tools.mode', "should be 'auto' or 'required'"),
    ({'functions': [TINY_TOOL['function']]}, 'functions', 'send tools instead'),
    ({'function_call': 'auto'}, 'function_call', 'send tool_choice instead'),
    ({'messages': HISTORY[:1] + [{'role': 'tool', 'content': 'x'}]}, 'messages.1.tool_call_id',
     'needs tool_call_id'),
    ({'messages': HISTORY[:1] + [{**HISTORY[1], 'tool_calls': [{
        'id': 'c', 'type': 'function', 'function': {'name': 'f', 'arguments': '[1]'}}]}]},
     'messages.1.tool_calls.0.function.arguments', 'must be a JSON object'),
]


@pytest.mark.timeout(60)
def test_refused_parameters_get_400_naming_them(client):
    for fields, param, fragment in REFUSED:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(**{'model': MODEL, 'messages': chat('hi'),
                                              'max_tokens': 1, **fields})
        assert e.value.body['param'] == param and fragment in e.value.message, e.value.body
        assert client.chat.completions.create(model=MODEL, messages=chat('hi'),
                                              max_tokens=1).usage.completion_tokens == 1
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt='def', max_tokens=1, suffix='x')
    assert e.value.body['param'] == 'suffix' and 'not supported' in e.value.message
    assert client.completions.create(model=MODEL, prompt='def',
                                     max_tokens=1).usage.completion_tokens == 1


def test_each_of_n_choices_parses_its_own_tool_calls(scripted):
    """n=2 (issue 22, part 2): each choice has its own parser, its chunks interleaved with the
    other's."""
    whole, chunks, _ = scripted(messages=chat('two calls'), tools=[WEATHER], n=2)
    assert [c.index for c in whole.choices] == [0, 1]
    for choice in whole.choices:
        assert (choice.message.content, choice.finish_reason) == ('Let me look.', 'tool_calls')
        assert calls_of(choice.message)[1][2:] == ('get_weather', '{"city": "Rome", "days": 1}')
    for index in (0, 1):
        content, calls, finish = joined([c for c in chunks
                                         if c.choices and c.choices[0].index == index])
        assert (content, finish) == ('Let me look.', 'tool_calls')
        assert [c[2:] for c in calls] == [c[2:] for c in calls_of(whole.choices[index].message)]


@pytest.mark.timeout(60)
def test_logit_bias_min_p_and_min_tokens_are_honoured(spec_client):
    """Through the client: a +100 bias makes a token the greedy choice at every position (the
    speculative server verifies with the bias); min_tokens holds off a biased eos; min_p is
    taken."""
    forced = spec_client.completions.create(model='embedded', prompt='def f(', max_tokens=4,
                                            temperature=0, extra_body={'logit_bias': {'7': 100},
                                                                       'ignore_eos': True})
    assert forced.choices[0].finish_reason == 'length'
    tokens = httpx.post(str(spec_client.base_url).replace('/v1/', '') + '/tokenize', json={
        'prompt': forced.choices[0].text}, timeout=30).json()['tokens']
    assert set(tokens) == {7}
    held = spec_client.completions.create(
        model='embedded', prompt='def f(', max_tokens=10, temperature=0.7, seed=3,
        extra_body={'logit_bias': {'2': 100}, 'min_tokens': 5, 'min_p': 0.1})
    assert held.choices[0].finish_reason == 'stop' and held.usage.completion_tokens == 6



FORECAST = {'type': 'function', 'function': {       # every argument bounded: a call always ends
    'name': 'g', 'parameters': {'type': 'object', 'properties': {
        'unit': {'enum': ['c', 'f']}, 'days': {'type': 'integer', 'minimum': 1, 'maximum': 7}},
        'required': ['unit', 'days']}}}


@pytest.fixture(scope='module')
def real(model_dir):
    """call(**request) -> (the non-streamed completion, the streamed chunks): the server's app in
    this process on a real pipeline (the tiny model, MTP k=2, a session long enough for tools)."""
    pytest.importorskip('xgrammar')
    from lmdeploy_lite.api import pipeline
    from lmdeploy_lite.messages import PytorchEngineConfig, SpeculativeConfig
    from lmdeploy_lite.serve.openai.api_server import create_app
    pipe = pipeline(model_dir, PytorchEngineConfig(device='cpu', dtype='float32', session_len=512,
                                                   distributed_executor_backend='uni'),
                    speculative_config=SpeculativeConfig(num_speculative_tokens=2))
    yield asker(create_app(pipe, MODEL))
    pipe.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize('choice', ['required', {'type': 'function', 'function': {'name': 'g'}},
                                    {'type': 'allowed_tools', 'allowed_tools': {'mode': 'required',
                                     'tools': [{'type': 'function', 'function': {'name': 'g'}}]}}])
def test_a_forced_call_comes_back_well_formed(real, choice):
    jsonschema = pytest.importorskip('jsonschema')
    whole, chunks = real(messages=chat('hi'), max_tokens=120, temperature=0,
                         tools=[TINY_TOOL, FORECAST], tool_choice=choice,
                         parallel_tool_calls=False)
    calls = calls_of(whole.choices[0].message)
    assert whole.choices[0].finish_reason == 'tool_calls' and len(calls) == 1, whole
    assert [c[2:] for c in joined(chunks)[1]] == [c[2:] for c in calls]
    name, arguments = calls[0][2], json.loads(calls[0][3])
    assert name == 'g' or choice == 'required' and name == 'f', calls
    if name == 'g':
        jsonschema.validate(arguments, FORECAST['function']['parameters'])


def test_allowed_tools_let_calls_name_only_the_tools_they_list():
    """tool_choice "allowed_tools": the template shows every tool (`tools`), the grammar's calls
    may name only the listed ones; mode "auto" leaves text free, "required" needs a call."""
    pytest.importorskip('xgrammar')
    from lmdeploy_lite.serve.openai.protocol import ChatCompletionRequest
    for mode in ('auto', 'required'):
        req = ChatCompletionRequest.model_validate({
            'messages': chat('hi'), 'tools': [TINY_TOOL, FORECAST], 'tool_choice': {
                'type': 'allowed_tools', 'allowed_tools': {'mode': mode, 'tools': [
                    {'type': 'function', 'function': {'name': 'g'}}]}}})
        grammar = req.output_format['format']
        assert [tag['begin'] for tag in grammar['tags']] == ['<tool_call>\n<function=g>\n']
        assert grammar['at_least_one'] == (mode == 'required') and len(req.tools) == 2


@pytest.mark.timeout(120)
def test_response_format_json_schema_holds_through_the_server(real):
    jsonschema = pytest.importorskip('jsonschema')
    schema = FORECAST['function']['parameters']
    fmt = {'type': 'json_schema', 'json_schema': {'name': 'forecast', 'schema': schema}}
    whole, chunks = real(messages=chat('hi'), max_tokens=64, n=2, temperature=1, seed=3,
                         response_format=fmt)
    for choice in whole.choices:
        assert choice.finish_reason == 'stop', choice
        jsonschema.validate(json.loads(choice.message.content), schema)
    jsonschema.validate(json.loads(joined([c for c in chunks if c.choices[0].index == 0])[0]),
                        schema)
