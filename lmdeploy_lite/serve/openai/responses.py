"""What the server sends, as JSON text written without pydantic: the OpenAI documents of
/v1/completions and /v1/chat/completions, whole or as stream chunks, field for field in the order
OpenAI's reference (and pydantic) writes them, every field present, null included
(tests/serve/test_responses.py pins each shape). A response is one template per request
(`Document`: id, object, created, model) around its choices and usage, so a streamed chunk costs a
few string joins and one C-level escape of its text, not a tree of models built and dumped per
token (~1 us a chunk with its SSE framing and metrics, where pydantic's path took ~16;
`benchmarks/bench_serve.py --frontend-cpu`).
"""
from __future__ import annotations

import json
import time

from lmdeploy_lite.messages import Response, SpecDecodeStats
from lmdeploy_lite.reasoning import ReasoningParser
from lmdeploy_lite.serve.openai.logprobs import (CompletionLogprobs, TokenStrings,
                                                 chat_logprobs_json)
from lmdeploy_lite.serve.openai.tool_parser import ToolCall, ToolCallParser

# any JSON value as compact UTF-8 text; a str goes straight to the C escaper
dumps = json.JSONEncoder(ensure_ascii=False, separators=(',', ':')).encode


def string(value: str | None) -> str:
    """A string or null as JSON (what chunks hold: ~0.1 us, where `dumps(None)` takes ~1)."""
    return 'null' if value is None else dumps(value)


def event(data: str) -> bytes:
    """One server-sent event; JSON text holds no newline, so it is one `data:` line
    (EventStream sends bytes as they are)."""
    return f'data: {data}\n\n'.encode()


class Document:
    """The JSON text of one response or chunk of request `rid`, of kind `object` ('text_completion',
    'chat.completion', 'chat.completion.chunk'); `created` is the request's, on every chunk."""

    def __init__(self, object: str, rid: str, model: str):
        self.head = (f'{{"id":{dumps(rid)},"object":"{object}","created":{int(time.time())},'
                     f'"model":{dumps(model)},"choices":[')

    def write(self, choices: list[str], usage: dict | None = None) -> str:
        """`choices`: each choice's JSON text (`completion_choice`, `chat_choice`)."""
        usage_json = 'null' if usage is None else dumps(usage)
        return f'{self.head}{",".join(choices)}],"usage":{usage_json}}}'


def completion_choice(index: int, text: str, finish_reason: str | None = None,
                      logprobs: dict | None = None, hidden_states_path: str | None = None) -> str:
    """`hidden_states_path` (extract_hidden_states): the choice's hidden-states file, last chunk."""
    return (f'{{"index":{index},"text":{dumps(text)},'
            f'"logprobs":{"null" if logprobs is None else dumps(logprobs)},'
            f'"finish_reason":{string(finish_reason)},'
            f'"hidden_states_path":{string(hidden_states_path)}}}')


def chat_choice(index: int, key: str, role: str | None, content: str | None,
                tool_calls: list[dict] | None = None, logprobs: str = 'null',
                finish_reason: str | None = None, hidden_states_path: str | None = None,
                reasoning: str | bool | None = None) -> str:
    """`key`: 'message' (a whole response's) or 'delta' (a chunk's); `logprobs`: JSON text
    (`chat_logprobs_json`); content null when the output is only tool calls (or thought).
    `reasoning`: the thought (`reasoning_content`, as vLLM and SGLang name it), True for a
    null one; None: no such field (no reasoning parser, or a delta without thought)."""
    thought = ('' if reasoning is None else
               f',"reasoning_content":{string(None if reasoning is True else reasoning)}')
    return (f'{{"index":{index},"{key}":{{"role":{string(role)},"content":{string(content)}'
            f'{thought},"tool_calls":{"null" if tool_calls is None else dumps(tool_calls)}}},'
            f'"logprobs":{logprobs},"finish_reason":{string(finish_reason)},'
            f'"hidden_states_path":{string(hidden_states_path)}}}')


def tool_calls(calls: list[ToolCall], delta: bool) -> list[dict] | None:
    """OpenAI `tool_calls`; in a chunk (`delta`) each carries its index: a whole call per
    delta, since a call is parsed once its block has closed."""
    return [{**({'index': c.index} if delta else {}), 'id': c.id, 'type': 'function',
             'function': {'name': c.name, 'arguments': c.arguments}} for c in calls] or None


def usage(lasts: list[Response | None], prompts: list[list[int]]) -> dict:
    """Each prompt counted once (its cached tokens: its choice 0's), every choice's completion
    tokens and speculative counters added up (`spec_decode`, `num_preemptions`: extensions)."""
    n, done = len(lasts) // len(prompts), [r for r in lasts if r is not None]
    num_prompt = sum(len(ids) for ids in prompts)
    completion = sum(r.generate_token_len for r in done)
    spec_stats, s = [r.spec_stats for r in done if r.spec_stats is not None], SpecDecodeStats()
    for stats in spec_stats:
        s.merge(stats)
    spec = {'num_drafts': s.num_drafts, 'num_draft_tokens': s.num_draft_tokens,
            'num_accepted_tokens': s.num_accepted_tokens,
            'accepted_per_position': list(s.accepted_per_position),
            'mean_accepted_length': s.mean_accepted_length} if spec_stats else None
    cached = sum(r.num_cached_tokens for r in lasts[::n] if r is not None)
    return {'prompt_tokens': num_prompt, 'completion_tokens': completion,
            'total_tokens': num_prompt + completion,
            'prompt_tokens_details': {'cached_tokens': cached}, 'spec_decode': spec,
            'num_preemptions': sum(r.num_preemptions for r in done)}


class CompletionChunks:
    """The chunks of a /v1/completions stream (streaming.stream's `chunks`); `legacy`: each
    choice's logprobs writer, None when the request asked for none; `echoes`: each choice's
    prompt text (`echo`), which opens it."""

    def __init__(self, rid: str, model: str, legacy: list[CompletionLogprobs | None],
                 echoes: list[str] | None = None):
        self.document, self.legacy = Document('text_completion', rid, model), legacy
        self.echoes = echoes

    def opening(self, index: int) -> str | None:
        """The chunk that opens choice `index` before its first token (None: none)."""
        if self.echoes is None:
            return None
        return self.document.write([completion_choice(index, self.echoes[index])])

    def delta(self, index: int, text: str, finish_reason: str | None, logprobs: list | None,
              hidden_states_path: str | None = None) -> str | None:
        """Choice `index`'s next chunk (None: nothing to send yet); `logprobs`: the
        TokenLogprobs of its tokens since its last chunk, None when not asked for."""
        if logprobs is not None:
            logprobs = self.legacy[index].add(logprobs)
        return self.document.write([completion_choice(index, text, finish_reason, logprobs,
                                                      hidden_states_path)])

    def usage(self, use: dict) -> str:
        return self.document.write([], use)


class ChatChunks(CompletionChunks):
    """The chunks of a /v1/chat/completions stream: the opening delta (role), content deltas
    (the thought split off where the server parses reasoning, tool calls parsed out where the
    request has tools), the usage chunk."""

    def __init__(self, rid: str, model: str, parsers: list[ToolCallParser | None],
                 strings: TokenStrings, thoughts: list[ReasoningParser | None] | None = None):
        self.document = Document('chat.completion.chunk', rid, model)
        self.parsers, self.strings = parsers, strings
        self.thoughts = thoughts or [None] * len(parsers)

    def opening(self, index: int) -> str:
        return self.document.write([chat_choice(index, 'delta', 'assistant', '')])

    def delta(self, index: int, text: str, finish_reason: str | None, logprobs: list | None,
              hidden_states_path: str | None = None) -> str | None:
        choice = reply_choice(index, False, text, finish_reason, logprobs, hidden_states_path,
                              self.parsers[index], self.thoughts[index], self.strings)
        return None if choice is None else self.document.write([choice])


def reply_choice(index: int, whole: bool, text: str, finish_reason: str | None,
                 logprobs: list | None, hidden_states_path: str | None,
                 parser: ToolCallParser | None, thought: ReasoningParser | None,
                 strings: TokenStrings) -> str | None:
    """A chat choice, whole (its message) or its next delta (None: all of it held back). The
    thought is split off first (reasoning.py), then calls parsed out of the rest; content is
    null when there is only a thought or only calls; finish_reason 'tool_calls' for an output
    that made calls, whether it stopped by itself or was cut after them (as vLLM; 'abort' and
    'error' stay)."""
    final, reasoning, calls = whole or finish_reason is not None, None, []
    if thought is not None:
        reasoning, text = thought.feed(text, final)
        reasoning = reasoning or None
    if parser is not None:
        text, calls = parser.feed(text, final=final)
        if parser.num_calls > 0 and finish_reason in ('stop', 'length'):
            finish_reason = 'tool_calls'
    if (parser or thought) is not None and not (final or text or calls or reasoning is not None):
        return None
    return chat_choice(index, 'message' if whole else 'delta', 'assistant' if whole else None,
                       None if not text and (calls or reasoning) else text,
                       tool_calls(calls, delta=not whole),
                       'null' if logprobs is None else chat_logprobs_json(strings, logprobs),
                       finish_reason, hidden_states_path,
                       (reasoning or True) if whole and thought is not None else reasoning)


def completion_response(rid: str, model: str, prompts: list[list[int]], texts: list[str],
                        lasts: list[Response | None], logprobs: list[list],
                        legacy: list[CompletionLogprobs | None], use: dict | None = None
                        ) -> bytes:
    """A whole /v1/completions response: each choice's text, logprobs and last response;
    `use`: the usage when not these choices' own (best_of: every candidate's)."""
    choices = [completion_choice(i, text, last and last.finish_reason,
                                 legacy[i] and legacy[i].add(logprobs[i]),
                                 last and last.hidden_states_path)
               for i, (text, last) in enumerate(zip(texts, lasts))]
    return Document('text_completion', rid, model).write(
        choices, use or usage(lasts, prompts)).encode()


def chat_response(rid: str, model: str, prompts: list[list[int]], texts: list[str],
                  lasts: list[Response | None], logprobs: list[list] | None,
                  parsers: list[ToolCallParser | None], strings: TokenStrings,
                  thoughts: list[ReasoningParser | None] | None = None) -> bytes:
    """A whole /v1/chat/completions response: each choice's text, its thought split off and
    tool calls parsed out; `logprobs` None when the request asked for none."""
    choices = [reply_choice(i, True, text, last and last.finish_reason,
                            None if logprobs is None else logprobs[i],
                            last and last.hidden_states_path, parser, thought, strings)
               for i, (text, last, parser, thought) in enumerate(zip(
                   texts, lasts, parsers, thoughts or [None] * len(parsers)))]
    return Document('chat.completion', rid, model).write(choices, usage(lasts, prompts)).encode()
