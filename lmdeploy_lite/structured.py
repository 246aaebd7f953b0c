"""Structured output: what a request's `response_format` may be, and the grammar it becomes.

`GenerationConfig.response_format` takes OpenAI's shapes: `{"type": "text"}` (no constraint),
`{"type": "json_object"}` (any JSON object), `{"type": "json_schema", "json_schema": {"name",
"schema", "strict"}}`, and xgrammar's `{"type": "structural_tag", "format": {...}}` (as vLLM
accepts it), which the server also builds for `tool_choice` "required" or a named function
(`tool_call_format`: Qwen3.5's `<tool_call><function=...>` blocks), and lmdeploy's
`{"type": "regex_schema", "regex_schema": pattern}` (the whole reply matches). Every constraint
is compiled by xgrammar (the optional extra `[structured]`) as a structural tag; when the prompt
leaves the reply inside a think block, the thought comes first, free text up to `</think>`
(`thought_first`).
JSON is written without free whitespace runs, so a weak model cannot loop on blanks.
The engine's side (matchers, the token masks under speculation) is pytorch/grammar.py.
"""
from __future__ import annotations

import functools
import json
import re

from lmdeploy_lite.reasoning import CLOSE, OPEN, TOOL_CALL

TYPES = ('text', 'json_object', 'json_schema', 'structural_tag', 'regex_schema')
MAX_WHITESPACE = 1          # a JSON value's whitespace run, at most
INSTALL_HINT = "structured output needs xgrammar: pip install 'lmdeploy_lite[structured]'"


def _xgrammar():
    try:
        import xgrammar
    except ImportError as e:
        raise ValueError(f'response_format: {INSTALL_HINT}') from e
    return xgrammar


def check_response_format(value) -> dict | None:
    """A validated response_format (None: unconstrained), or ValueError naming the field."""
    if value is None:
        return None
    kind = value.get('type') if isinstance(value, dict) else None
    if kind not in TYPES:
        raise ValueError(f'response_format: must be an object whose type is one of {TYPES}')
    if kind == 'text':
        return None
    if kind == 'json_schema':
        spec = value.get('json_schema')
        if not isinstance(spec, dict) or not isinstance(spec.get('schema', {}), (dict, bool)):
            raise ValueError('response_format.json_schema: must be an object with a JSON schema '
                             '(an object) under "schema"')
    elif kind == 'structural_tag' and not isinstance(value.get('format'), dict):
        raise ValueError('response_format.format: a structural_tag needs its format object')
    elif kind == 'regex_schema' and not isinstance(value.get('regex_schema'), str):
        raise ValueError('response_format.regex_schema: must be a regular expression (a str)')
    _compiles(json.dumps(value, sort_keys=True))
    return value


@functools.lru_cache(maxsize=256)
def _compiles(key: str):
    """Raise ValueError naming the field if xgrammar cannot read the format (no tokenizer needed:
    the engine compiles it for its vocabulary)."""
    xgr, value = _xgrammar(), json.loads(key)
    field = ('response_format.json_schema.schema' if value['type'] == 'json_schema'
             else 'response_format')
    try:
        xgr.Grammar.from_structural_tag(json.dumps(structural_tag(value)))
    except Exception as e:        # xgrammar's errors have several types; all mean "not this"
        reason = re.sub(r'^\[[^]]*\]\s*\S+:\d+:\s*', '', str(e).strip())   # its log prefix
        raise ValueError(f'{field}: xgrammar cannot compile it: {reason[:300]}') from None


def structural_tag(response_format: dict, in_thought: bool = False) -> dict:
    """The xgrammar structural tag a (validated) response_format means; `in_thought`: the reply
    starts inside a think block."""
    kind = response_format['type']
    if kind == 'structural_tag':
        fmt = response_format['format']
    elif kind == 'regex_schema':
        fmt = {'type': 'regex', 'pattern': response_format['regex_schema']}
    else:
        schema = ({'type': 'object'} if kind == 'json_object'
                  else response_format['json_schema'].get('schema', True))
        fmt = {'type': 'json_schema', 'json_schema': schema, 'max_whitespace_cnt': MAX_WHITESPACE}
    if in_thought:
        fmt = thought_first(fmt)
    return {'type': 'structural_tag', 'format': fmt}


def thought_first(fmt: dict) -> dict:
    """`fmt` after a thought already opened by the prompt: free text up to `</think>` and the
    blank line Qwen3.5 writes after it. The thought holds no think tags and no `<tool_call>`,
    which the reasoning parser would read as the thought's end (reasoning.py)."""
    thought = {'type': 'tag', 'begin': '', 'end': CLOSE,
               'content': {'type': 'any_text', 'excludes': [OPEN, CLOSE, TOOL_CALL]}}
    return {'type': 'sequence',
            'elements': [thought, {'type': 'const_string', 'value': '\n\n'}, fmt]}


def tool_call_format(tools: list[dict], tool_choice, parallel_tool_calls: bool = True) -> dict:
    """The response_format that forces Qwen3.5 tool calls: `tool_choice` "required" (one call at
    least, to any of `tools`) or {"type": "function", "function": {"name": ...}} (that one)."""
    tag = _xgrammar().get_model_structural_tag(
        'qwen_3_5', tools=tools, tool_choice=tool_choice, reasoning='disabled',
        parallel_tool_calls=parallel_tool_calls, max_whitespace_cnt=MAX_WHITESPACE)
    return json.loads(tag.model_dump_json())
