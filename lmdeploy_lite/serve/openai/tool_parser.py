"""Qwen3.5's tool calls in generated text -> OpenAI `tool_calls`. The block is the one Qwen3.5's
chat template teaches the model (and writes back for the calls in the history):

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A parameter's value is the text between its tags less one newline at each end, read by the type
its tool's JSON schema declares: `string` as it is; the other types (and a schema without a type)
as JSON less the blanks around it, `True`/`False`/`None` too (the template writes non-JSON values
with Python's spelling); text that does not read as the declared type stays a string, as do
parameters the schema does not declare (as vLLM's qwen3_coder parser): the template's inverse,
which writes strings as they are. `null` (or `None`) is no value whatever the type but a string
(as vLLM, which reads it so for a string too); a string that may be null (`["string", "null"]`)
reads it as null.

Qwen3.5 drops closing tags at times (long contexts, long values): as vLLM's parser does, a block
whose `</function>` is missing, or whose parameters miss their `</parameter>`, is read the same,
a value then ending where the next parameter or the function's end begins (read that way only
when the block does not read with every tag closed, so a closed value may hold those tags).
A block without that shape (no function, text between the parameters, a parameter given twice,
a block left open when the output ends) stays in the text. Parsed blocks
leave with the whitespace around them: the text before and after is joined by the whitespace
that preceded the first of them, none left at the start or the end (the template puts "\\n\\n"
before the first call and "\\n" between calls). `ToolCallParser` is incremental and hands out
only what is final, so any split of the output into chunks gives the same as the whole at once.
"""
from __future__ import annotations

import json
import math
import re
import uuid
from dataclasses import dataclass

from lmdeploy_lite.reasoning import held_back

OPEN, CLOSE = '<tool_call>', '</tool_call>'
FUNCTION = re.compile(r'\s*<function=([^\s<>=]+)>(.*)</function>\s*', re.DOTALL)
UNCLOSED_FUNCTION = re.compile(r'\s*<function=([^\s<>=]+)>(.*)', re.DOTALL)
PARAMETER = re.compile(r'\s*<parameter=([^\s<>=]+)>(.*?)</parameter>', re.DOTALL)
UNCLOSED_PARAMETER = re.compile(r'\s*<parameter=([^\s<>=]+)>(.*?)'
                                r'(?:</parameter>|(?=<parameter=|</function>)|\Z)', re.DOTALL)
INTEGER = re.compile(r'-?\d+')
# how Qwen3.5's template writes Python values that are not JSON (`value | string`)
PYTHON_BOOLEANS = {'True': True, 'False': False}
NULLS = ('null', 'None')


@dataclass(frozen=True)
class ToolCall:
    index: int                 # the call's place among this output's calls, from 0
    id: str
    name: str
    arguments: str             # a JSON object


def parameter_schemas(tools: list[dict] | None) -> dict[str, dict]:
    """{function name: {parameter name: its JSON schema}} of OpenAI tool definitions."""
    schemas = {}
    for tool in tools or ():
        function = tool.get('function') or {}
        properties = (function.get('parameters') or {}).get('properties')
        schemas[function.get('name')] = properties if isinstance(properties, dict) else {}
    return schemas


def read_value(text: str, schema: dict | None):
    """A parameter's text as the value its schema declares (None: undeclared, kept as text)."""
    if not isinstance(schema, dict):
        return text
    kinds = schema.get('type')
    kinds = [kinds] if isinstance(kinds, str) else kinds if isinstance(kinds, list) else []
    if 'string' in kinds:
        return None if 'null' in kinds and text.strip() in NULLS else text
    text = text.strip()           # layout, for any other type (a grammar may leave blanks there)
    if text in NULLS:
        return None               # no value, whatever the type (as vLLM)
    if text in PYTHON_BOOLEANS and 'boolean' in kinds:
        return PYTHON_BOOLEANS[text]
    try:
        value = json.loads(text)
        if not _is_finite(value):
            return text
    except (ValueError, RecursionError):
        return text
    if not kinds:
        return value
    for kind in kinds:
        if (kind == 'null' and value is None or kind == 'boolean' and isinstance(value, bool)
                or kind == 'integer' and INTEGER.fullmatch(text)
                or kind == 'number' and type(value) in (int, float)
                or kind == 'object' and isinstance(value, dict)
                or kind == 'array' and isinstance(value, list)):
            return value
    return text


def _is_finite(value) -> bool:
    """False for JSON Python reads as inf or nan (1e999, NaN): json.dumps would write bad JSON."""
    if isinstance(value, float):
        return math.isfinite(value)
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    return all(_is_finite(v) for v in items)


def parse_block(inner: str, schemas: dict[str, dict]) -> tuple[str, dict] | None:
    """(function name, arguments) of the text between <tool_call> and </tool_call>, or None
    when it is not one function call (with every tag closed, or else some closing tags left
    out)."""
    match = FUNCTION.fullmatch(inner) or UNCLOSED_FUNCTION.fullmatch(inner)
    if match is None or OPEN in inner:
        return None
    name, body = match.groups()
    for parameter in (PARAMETER, UNCLOSED_PARAMETER):
        if (arguments := read_arguments(body, parameter, schemas.get(name, {}))) is not None:
            return name, arguments
    return None


def read_arguments(body: str, parameter: re.Pattern, properties: dict) -> dict | None:
    """The arguments of a function's body (between its tag and </function>), read with the
    `parameter` pattern; None when the body is not a run of distinct parameters."""
    arguments, pos = {}, 0
    while (match := parameter.match(body, pos)) is not None:
        key, text = match.groups()
        if key in arguments or '<parameter=' in text:
            return None
        arguments[key] = read_value(text.removeprefix('\n').removesuffix('\n'), properties.get(key))
        pos = match.end()
    return None if body[pos:].strip() else arguments


class ToolCallParser:
    """Feed a choice's text as it is generated; each call returns the text and the calls that
    are final. Only a possible block start, an open block, or whitespace that may precede a
    block is held back. `max_calls`: calls after that many are dropped (parallel_tool_calls
    false, as vLLM)."""

    def __init__(self, tools: list[dict] | None, max_calls: int | None = None):
        self.schemas, self.max_calls, self.num_calls = parameter_schemas(tools), max_calls, 0
        self.text = ''                 # the output from the first character not handed out
        self.search = 0                # where the next block start may be in self.text
        self.after_call = False        # no text since the last parsed block
        self.space = ''                # the whitespace before that run of blocks
        self.emitted = False           # any text handed out
        self.open_block = False        # self.text starts with a block not closed yet
        self.pieces = []               # text fed since, that leaves that block open
        self.tail = ''                 # the last len(CLOSE) - 1 characters held

    def feed(self, text: str, final: bool = False) -> tuple[str, list[ToolCall]]:
        """`final`: the output ends here; whatever is held back comes out as text."""
        if not final and self._still_open(text):
            return '', []
        self.text = ''.join((self.text, *self.pieces, text))
        self.pieces = []
        out, calls, pos, waiting = [], [], 0, -1      # waiting: the start of a block not closed
        while (start := self.text.find(OPEN, self.search)) >= 0:
            end = self.text.find(CLOSE, start + len(OPEN))
            if end < 0:
                if self.text.find(OPEN, start + 1) >= 0:   # it would hold another block start
                    self.search = start + 1
                    continue
                waiting = start
                break
            parsed = parse_block(self.text[start + len(OPEN):end], self.schemas)
            self.search = start + 1 if parsed is None else end + len(CLOSE)
            if parsed is None:
                continue
            before = self.text[pos:start]
            text = before.rstrip()
            space = before[len(text):] if text or not self.after_call else self.space
            out.append(self._plain(text))
            pos, self.after_call, self.space = self.search, True, space
            if self.max_calls is None or self.num_calls < self.max_calls:
                name, arguments = parsed
                calls.append(ToolCall(self.num_calls, f'call_{uuid.uuid4().hex[:24]}', name,
                                      json.dumps(arguments, ensure_ascii=False)))
                self.num_calls += 1
        if final:
            ready = len(self.text)
        else:              # stop before an open block, or before what may still become one
            ready = waiting if waiting >= 0 else len(self.text) - held_back(self.text, (OPEN,))
            ready = pos + len(self.text[pos:ready].rstrip())
        out.append(self._plain(self.text[pos:ready]))
        self.text = self.text[ready:]
        self.search = max(0, self.search - ready)
        self.open_block, self.tail = waiting >= 0 and not final, self.text[1 - len(CLOSE):]
        return ''.join(out), calls

    def _still_open(self, text: str) -> bool:
        """Keeps `text` aside when the open block stays open (no block end or start in it):
        a long argument then costs one join when its block ends, not a copy and a search of
        all of it per piece (quadratic: 6 s for a 200 kB argument in 4-character pieces)."""
        if not self.open_block:
            return False
        probe = self.tail + text
        if CLOSE in probe or OPEN in probe:
            return False
        self.pieces.append(text)
        self.tail = probe[1 - len(CLOSE):]
        return True

    def _plain(self, text: str) -> str:
        """Text outside the blocks; after a block, without its leading whitespace and joined to
        the text before the block by the whitespace that preceded it."""
        if self.after_call:
            text = text.lstrip()
            if text:
                text = (self.space if self.emitted else '') + text
                self.after_call = False
        self.emitted = self.emitted or bool(text)
        return text


def parse_tool_calls(text: str, tools: list[dict] | None, max_calls: int | None = None
                     ) -> tuple[str, list[ToolCall]]:
    """(the text outside the parsed blocks, the calls) of a whole output."""
    return ToolCallParser(tools, max_calls).feed(text, final=True)
