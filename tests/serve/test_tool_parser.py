"""The Qwen3.5 tool-call parser on fixed strings, whole and streamed in every split."""
import json
import random
import time

import pytest

from lmdeploy_lite.serve.openai.tool_parser import ToolCallParser, parse_tool_calls

TOOLS = [{'type': 'function', 'function': {
    'name': 'get_weather', 'description': 'The weather of a city',
    'parameters': {'type': 'object', 'properties': {
        'city': {'type': 'string'}, 'days': {'type': 'integer'}, 'celsius': {'type': 'boolean'},
        'filters': {'type': 'object'}, 'hours': {'type': 'array'},
        'ratio': {'type': ['number', 'null']}, 'note': {},
        'alias': {'type': ['string', 'null']}}}}}]


def block(name: str, **arguments: str) -> str:
    """A call as Qwen3.5's chat template writes it (and teaches the model to)."""
    parameters = ''.join(f'<parameter={k}>\n{v}\n</parameter>\n' for k, v in arguments.items())
    return f'<tool_call>\n<function={name}>\n{parameters}</function>\n</tool_call>'


PARIS = block('get_weather', city='Paris', days='3')
ROME = block('get_weather', city='Rome', celsius='true')
NESTED = block('get_weather', city='New\nYork\n', filters='{"wind": {"min": 1, "units": ["kn"]}}',
               hours='[6, 12]', ratio='0.5', note='{"free": "form"}', extra='7')
CASES = {   # text -> (content, [(name, arguments)])
    'one call': (PARIS, ('', [('get_weather', {'city': 'Paris', 'days': 3})])),
    'two calls': (PARIS + '\n' + ROME, ('', [
        ('get_weather', {'city': 'Paris', 'days': 3}),
        ('get_weather', {'city': 'Rome', 'celsius': True})])),
    'nested JSON and newlines': (NESTED, ('', [('get_weather', {
        'city': 'New\nYork\n', 'filters': {'wind': {'min': 1, 'units': ['kn']}}, 'hours': [6, 12],
        'ratio': 0.5, 'note': {'free': 'form'}, 'extra': '7'})])),
    'text around the calls': (
        'Let me look.\n\n' + PARIS + '\n' + ROME + '\n\nBoth asked.',
        ('Let me look.\n\nBoth asked.', [('get_weather', {'city': 'Paris', 'days': 3}),
                                         ('get_weather', {'city': 'Rome', 'celsius': True})])),
    'no call': ('def f(x):\n    return x < 1\n', ('def f(x):\n    return x < 1\n', [])),
    'a call to an undeclared function, arguments as text': (
        block('search', q='1', n='{"a": 1}'),
        ('', [('search', {'q': '1', 'n': '{"a": 1}'})])),
    'values that do not read as their type stay text': (
        block('get_weather', days='three', celsius='maybe', ratio='1e999', hours='{}'),
        ('', [('get_weather', {'days': 'three', 'celsius': 'maybe', 'ratio': '1e999',
                               'hours': '{}'})])),
    'Python spellings of booleans and null': (
        block('get_weather', celsius='False', ratio='None'),
        ('', [('get_weather', {'celsius': False, 'ratio': None})])),
    # as vLLM: null is no value for any type but a string, which keeps the text unless nullable
    'null whatever the type but a string': (
        block('get_weather', days='null', hours=' None ', note='null', city='null', alias='None'),
        ('', [('get_weather', {'days': None, 'hours': None, 'note': None, 'city': 'null',
                               'alias': None})])),
    # closing tags the model dropped (as vLLM reads them): a value ends where the next tag
    # begins; a closed value may hold those tags
    'a parameter or function not closed': (
        block('get_weather', city='Paris', days='3').replace('</parameter>\n', '', 1) + '\n'
        + block('f', a='x</function>').replace('\n</function>', ''),
        ('', [('get_weather', {'city': 'Paris', 'days': 3}), ('f', {'a': 'x</function>'})])),
}
MALFORMED = {
    'no function': '<tool_call>\n{"name": "get_weather"}\n</tool_call>',
    'parameter given twice': block('f', a='1').replace('<parameter=a>',
                                                       '<parameter=a>\n1\n</parameter>\n'
                                                       '<parameter=a>', 1),
    'text between parameters': block('f', a='1').replace('</parameter>\n', '</parameter>\nhm\n'),
    'two functions in one block': block('f').replace('</function>\n',
                                                     '</function>\n<function=g>\n</function>\n'),
    'a name with a space': '<tool_call>\n<function=get weather>\n</function>\n</tool_call>',
    'never closed': 'Sure.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nPar',
    'a lone close': 'done </tool_call> here',
    'a partial opening at the end': 'almost <tool_',
}


def feed_in_chunks(text: str, cuts: list[int], tools=TOOLS, max_calls=None):
    parser = ToolCallParser(tools, max_calls)
    content, calls, last = '', [], 0
    for cut in cuts + [len(text)]:
        piece, new = parser.feed(text[last:cut])
        content, calls, last = content + piece, calls + new, cut
    piece, new = parser.feed('', final=True)
    return content + piece, calls


def summary(content, calls):
    assert [c.index for c in calls] == list(range(len(calls)))
    assert all(c.id.startswith('call_') for c in calls) and len({c.id for c in calls}) == len(calls)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize('name', CASES)
def test_calls_and_content_whole_and_in_every_split(name):
    text, expected = CASES[name]
    assert summary(*parse_tool_calls(text, TOOLS)) == expected
    assert summary(*feed_in_chunks(text, list(range(len(text))))) == expected     # by character
    rng = random.Random(name)
    for _ in range(50):
        cuts = sorted(rng.sample(range(len(text) + 1), rng.randint(1, min(len(text), 8))))
        assert summary(*feed_in_chunks(text, cuts)) == expected, cuts


@pytest.mark.parametrize('name', MALFORMED)
def test_a_malformed_block_comes_back_as_text(name):
    text = MALFORMED[name]
    for wrapped in (text, 'before ' + text + ' after', text + '\n' + PARIS):
        content, calls = parse_tool_calls(wrapped, TOOLS)
        assert text in content
        assert summary(*feed_in_chunks(wrapped, list(range(len(wrapped))))) == \
            summary(content, calls)
    assert parse_tool_calls(text + '\n' + PARIS, TOOLS)[1][0].name == 'get_weather'


def test_streaming_holds_back_only_what_may_start_a_block():
    parser = ToolCallParser(TOOLS)
    assert parser.feed('Let me look.') == ('Let me look.', [])
    assert parser.feed('\n\n<tool') == ('', [])                 # may precede a block, or start one
    assert parser.feed('_call>\n<function=get_weather>\n') == ('', [])
    text, calls = parser.feed('</function>\n</tool_call>')
    assert text == '' and [(c.name, c.arguments) for c in calls] == [('get_weather', '{}')]
    assert parser.feed(' ') == ('', [])
    assert parser.feed('Done') == ('\n\nDone', [])              # joined as before the block
    assert parser.feed(' <tool_c', final=True) == (' <tool_c', [])


def test_parallel_tool_calls_false_keeps_the_first_call():
    content, calls = parse_tool_calls('a ' + PARIS + ROME + ' b', TOOLS, max_calls=1)
    assert summary(content, calls) == ('a b', [('get_weather', {'city': 'Paris', 'days': 3})])


def test_a_long_argument_streams_in_linear_time():
    """A 300 kB argument (a file an agent writes) in 3-character pieces: each piece used to copy
    and search all the held text (~15 s); kept aside, it takes ~0.1 s."""
    value = 'if a < b:\n    c = "</para"\n' * 12_000
    text = block('write', path='x.py', content=value)
    parser, calls, started = ToolCallParser(TOOLS), [], time.perf_counter()
    for i in range(0, len(text), 3):
        calls += parser.feed(text[i:i + 3])[1]
    assert time.perf_counter() - started < 2
    assert [json.loads(c.arguments) for c in calls] == [{'path': 'x.py', 'content': value}]
