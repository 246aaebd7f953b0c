"""Thinking (issue 36, item 1) through the official client against the real server, on the tiny
model with a Qwen3.5-style chat template: the template opens `<think>` in the prompt when
thinking and writes a closed empty block when not, and the model's reply carries no tags of its
own. What the server splits is checked against the raw reply (/v1/completions on the same
prompt ids) cut by the parser (tests/test_reasoning.py checks the parser on replies that close
their thought themselves); `pipeline(reasoning_parser='qwen3')` does the same in Python."""
import pytest

for _module in ('fastapi', 'uvicorn', 'prometheus_client'):
    pytest.importorskip(_module, reason="needs the 'serve' extra")
openai = pytest.importorskip('openai')
httpx = pytest.importorskip('httpx')

from lmdeploy_lite.reasoning import reply_parser, starts_in_thought  # noqa: E402
from tests.serve.live_server import MODEL  # noqa: E402

MESSAGES = [{'role': 'user', 'content': 'what is two plus two'}]
TOOLS = [{'type': 'function', 'function': {'name': 'add', 'description': 'adds',
                                           'parameters': {'type': 'object', 'properties': {}}}}]
GREEDY = dict(temperature=0, extra_body={'ignore_eos': True})


@pytest.fixture(scope='module')
def think_client(think_server):
    """The tiny model with THINKING_TEMPLATE (thinking_dir), no --reasoning-parser: auto, on
    because the template writes think blocks (tests/serve/conftest.py)."""
    assert think_server.proc.args[-4:] == ['--model-name', MODEL, '--session-len', '512']
    client = openai.OpenAI(base_url=think_server.url + '/v1', api_key='unused', timeout=60,
                           max_retries=0)
    client.root = think_server.url             # /tokenize and /detokenize are not under /v1
    return client


def expected(client, thinking: bool, max_tokens: int, tools=None) -> tuple[str | None, str | None]:
    """(reasoning_content, content) cut from the raw reply to the same prompt ids."""
    kwargs = {'chat_template_kwargs': {'enable_thinking': thinking}}
    body = {'model': MODEL, 'messages': MESSAGES, **kwargs, **({'tools': tools} if tools else {})}
    ids = httpx.post(client.root + '/tokenize', json=body, timeout=30).json()['tokens']
    prompt = httpx.post(client.root + '/detokenize', json={'model': MODEL, 'tokens': ids},
                        timeout=30).json()['prompt']
    raw = client.completions.create(model=MODEL, prompt=ids, max_tokens=max_tokens,
                                    **GREEDY).choices[0].text
    reasoning, content = reply_parser(lambda ids: prompt, [0]).feed(raw, final=True)
    assert starts_in_thought(prompt) == thinking
    return reasoning or None, content or None


@pytest.mark.timeout(120)
@pytest.mark.parametrize('thinking', [True, False])
@pytest.mark.parametrize('tools', [None, TOOLS])
def test_thought_and_answer_split_streamed_or_not(think_client, thinking, tools):
    want = expected(think_client, thinking, 12, tools)
    assert want[0 if thinking else 1], 'the reply went nowhere'
    extra = {'chat_template_kwargs': {'enable_thinking': thinking}, 'ignore_eos': True}
    args = dict(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0, n=2,
                extra_body=extra, **({'tools': tools} if tools else {}))
    whole = think_client.chat.completions.create(**args)
    for choice in whole.choices:
        message = choice.message
        assert (message.model_extra['reasoning_content'], message.content) == want
        assert choice.finish_reason == 'length' and not message.tool_calls
    parts = {0: ['', ''], 1: ['', '']}
    for chunk in think_client.chat.completions.create(stream=True, **args):
        for choice in chunk.choices:
            delta = choice.delta
            parts[choice.index][0] += (delta.model_extra or {}).get('reasoning_content') or ''
            parts[choice.index][1] += delta.content or ''
    assert [tuple(p or None for p in parts[i]) for i in (0, 1)] == [want, want]


@pytest.mark.timeout(60)
def test_a_reply_cut_inside_its_thought_is_reasoning_only(think_client):
    reply = think_client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3,
                                                 **GREEDY)
    choice = reply.choices[0]
    assert choice.finish_reason == 'length' and choice.message.content is None
    assert choice.message.model_extra['reasoning_content'] == expected(think_client, True, 3)[0]


@pytest.mark.timeout(60)
def test_chat_template_kwargs_must_be_template_variables(think_client):
    for bad, named in (({'tools': []}, r"\['tools'\] are set from the request"),
                       ([1, 2], 'must be a JSON object')):
        with pytest.raises(openai.BadRequestError, match=named) as error:
            think_client.chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=2,
                extra_body={'chat_template_kwargs': bad})
        assert error.value.body['param'] == 'chat_template_kwargs'


@pytest.mark.timeout(120)
def test_pipeline_splits_the_thought_when_asked(thinking_dir):
    from lmdeploy_lite import GenerationConfig, PytorchEngineConfig, pipeline
    gen = GenerationConfig(max_new_tokens=10, ignore_eos=True)
    with pipeline(thinking_dir, PytorchEngineConfig(device='cpu', session_len=128),
                  progress=False, reasoning_parser='qwen3') as pipe:
        raw = pipe([{'role': 'user', 'content': MESSAGES[0]['content']}], gen)
        off = pipe(MESSAGES, gen, chat_template_kwargs={'enable_thinking': False})
        streamed = list(pipe.stream_infer(MESSAGES, gen))
    assert raw.text == '' and raw.reasoning_content and raw.finish_reason == 'length'
    assert off.reasoning_content == '' and off.text
    assert ''.join(r.reasoning_content for r in streamed) == raw.reasoning_content
    assert ''.join(r.text for r in streamed) == ''
    with pytest.raises(ValueError, match="reasoning_parser='deepseek'"):
        pipeline(thinking_dir, reasoning_parser='deepseek')
