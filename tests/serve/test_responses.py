"""responses.py writes the OpenAI documents as JSON text from templates: each shape pinned field
for field (every field present, null included, as pydantic wrote them before), text of any kind
round-tripping; and the stream's writer side: a slow reader gets the steps it missed in one
chunk, never two chunks for one step, and no backlog of events (the tiny model, in process)."""
import asyncio
import json

import pytest

pytest.importorskip('fastapi', reason="needs the 'serve' extra")

from lmdeploy_lite.messages import Response, SpecDecodeStats  # noqa: E402
from lmdeploy_lite.serve.openai import responses as w  # noqa: E402
from lmdeploy_lite.serve.openai.tool_parser import ToolCall, ToolCallParser  # noqa: E402

TEXTS = ['plain', 'a "quote", a \\ and\na newline\t', 'héllo 世界 \u2028 \x00\x1f\x7f 😀', '']


def head(object: str, rid: str = 'cmpl-1') -> dict:
    return {'id': rid, 'object': object, 'model': 'm'}


def loads(text: str) -> dict:
    document = json.loads(text)
    assert isinstance(document.pop('created'), int)
    return document


@pytest.mark.parametrize('text', TEXTS)
def test_chunks_of_any_text_are_openai_documents(text):
    chunks = w.CompletionChunks('cmpl-1', 'm', [None])
    assert chunks.opening(0) is None
    assert loads(chunks.delta(0, text, 'length', None, '/tmp/h.pt')) == {
        **head('text_completion'), 'usage': None,
        'choices': [{'index': 0, 'text': text, 'logprobs': None, 'finish_reason': 'length',
                     'hidden_states_path': '/tmp/h.pt'}]}
    chat = w.ChatChunks('chatcmpl-1', 'm', [None, None], strings=None)
    assert loads(chat.opening(1))['choices'][0]['delta'] == {'role': 'assistant',
                                                             'content': '', 'tool_calls': None}
    assert loads(chat.delta(1, text, None, None)) == {
        **head('chat.completion.chunk', 'chatcmpl-1'), 'usage': None,
        'choices': [{'index': 1, 'delta': {'role': None, 'content': text, 'tool_calls': None},
                     'logprobs': None, 'finish_reason': None, 'hidden_states_path': None}]}
    # one template per request: the same bytes around every chunk's text
    assert chunks.delta(0, text, None, None).replace(json.dumps(text, ensure_ascii=False), '') \
        == chunks.delta(0, 'x', None, None).replace('"x"', '')


@pytest.mark.parametrize('finish, want', [('stop', 'tool_calls'), ('length', 'tool_calls'),
                                          ('abort', 'abort')])
def test_an_output_that_made_calls_finishes_with_tool_calls(finish, want):
    """Cut after its calls too (as vLLM), whole or streamed (the call in an earlier delta)."""
    call = '<tool_call>\n<function=f>\n</function>\n</tool_call>'
    tools = [{'function': {'name': 'f'}}]
    whole = w.reply_choice(0, True, call + '\nthen', finish, None, None, ToolCallParser(tools),
                           None, None)
    parser = ToolCallParser(tools)
    assert json.loads(w.reply_choice(0, False, call, None, None, None, parser, None, None))[
        'delta']['tool_calls'][0]['function']['name'] == 'f'
    last = w.reply_choice(0, False, '\nthen', finish, None, None, parser, None, None)
    assert json.loads(whole)['finish_reason'] == json.loads(last)['finish_reason'] == want


def test_tool_call_deltas_and_a_whole_chat_response_with_usage():
    call = ToolCall(0, 'call_1', 'get_weather', '{"city": "Paris"}')
    chunk = w.Document('chat.completion.chunk', 'c', 'm').write(
        [w.chat_choice(0, 'delta', None, None, w.tool_calls([call], delta=True), 'null',
                       'tool_calls')])
    function = {'name': 'get_weather', 'arguments': '{"city": "Paris"}'}
    assert loads(chunk)['choices'][0]['delta'] == {'role': None, 'content': None, 'tool_calls': [
        {'index': 0, 'id': 'call_1', 'type': 'function', 'function': function}]}
    last = Response(text='', token_ids=[], input_token_len=3, generate_token_len=4,
                    finish_reason='stop', num_cached_tokens=2,
                    spec_stats=SpecDecodeStats(2, 4, 3, [2, 1]))
    document = w.chat_response('c', 'm', [[1, 2, 3]], ['hi "there"'], [last], None, [None],
                               strings=None)
    assert loads(document) == {**head('chat.completion', 'c'), 'choices': [
        {'index': 0, 'message': {'role': 'assistant', 'content': 'hi "there"',
                                 'tool_calls': None},
         'logprobs': None, 'finish_reason': 'stop', 'hidden_states_path': None}],
        'usage': {'prompt_tokens': 3, 'completion_tokens': 4, 'total_tokens': 7,
                  'prompt_tokens_details': {'cached_tokens': 2}, 'num_preemptions': 0,
                  'spec_decode': {'num_drafts': 2, 'num_draft_tokens': 4,
                                  'num_accepted_tokens': 3, 'accepted_per_position': [2, 1],
                                  'mean_accepted_length': 2.5}}}
    assert w.event('[DONE]') == b'data: [DONE]\n\n'


def test_a_slow_reader_gets_what_it_missed_in_one_chunk_and_holds_no_backlog(model_dir,
                                                                               monkeypatch):
    """Read as fast as the chunks come, every chunk carries at least one token (none for a
    step with nothing new) and no engine step gives a stream two chunks; read slowly, the
    tokens of the steps missed come in one chunk, and however long the reader lagged only that
    chunk, usage and [DONE] are left."""
    from lmdeploy_lite import GenerationConfig, PytorchEngineConfig, api, pipeline
    from lmdeploy_lite.serve.openai.checks import ServerContext
    from lmdeploy_lite.serve.openai.logprobs import CompletionLogprobs, TokenStrings
    from lmdeploy_lite.serve.openai.metrics import ServerMetrics
    from lmdeploy_lite.serve.openai.streaming import stream
    config = GenerationConfig(max_new_tokens=12, ignore_eos=True, temperature=0.0, logprobs=0)
    steps, dispatch = [], api._AsyncFanout._dispatch      # each engine step's results

    def counting(fanout, items):
        steps.append(sum(bool(item.new_token_ids) for _, item in items))
        dispatch(fanout, items)
    monkeypatch.setattr(api._AsyncFanout, '_dispatch', counting)
    with pipeline(model_dir, PytorchEngineConfig(device='cpu', dtype='float32',
                                                 session_len=128), progress=False) as pipe:
        ctx = ServerContext(pipe, 'm', ServerMetrics(pipe), TokenStrings(pipe.tokenizer))
        ids = pipe.encode('def main(')

        async def read(lag_s: float) -> tuple[list[dict], list[bytes]]:
            legacy = [CompletionLogprobs(ctx.token_strings, True)]
            response = stream(ctx, [ids], config, w.CompletionChunks('r', 'm', legacy), True,
                              'r')
            events = response.body_iterator
            first = await anext(events)
            await asyncio.sleep(lag_s)              # the engine runs on meanwhile
            rest = [e async for e in events]        # an item may hold several events
            sent = [e for item in [first] + rest for e in item.split(b'\n\n') if e]
            assert sent[-1] == b'data: [DONE]'
            return [json.loads(e[6:]) for e in sent[:-1]], rest
        fast, _ = asyncio.run(read(0))
        fast_steps = sum(steps)
        # 12 tiny-model steps take tens of milliseconds: a 1 s lag outlasts them many times
        slow, rest = asyncio.run(read(1.0))
    for chunks in fast, slow:
        choices = [c['choices'][0] for c in chunks if c['choices']]
        assert all(len(c['logprobs']['tokens']) >= 1 for c in choices)   # >= 1 token a chunk
        assert sum(len(c['logprobs']['tokens']) for c in choices) == 12
        assert chunks[-1]['usage']['completion_tokens'] == 12
    assert ''.join(c['choices'][0]['text'] for c in slow if c['choices']) == \
        ''.join(c['choices'][0]['text'] for c in fast if c['choices'])
    assert len([c for c in fast if c['choices']]) <= fast_steps == 12   # <= one chunk a step
    # no backlog of events: the missed steps' chunk, usage and [DONE] are left, in one write
    assert len(rest) == 1 and len(slow) == 3
    missed = len(slow[1]['choices'][0]['logprobs']['tokens'])        # the steps it missed
    assert missed > 1 and missed + len(slow[0]['choices'][0]['logprobs']['tokens']) == 12
