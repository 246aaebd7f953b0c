"""Checking one request, off the event loop: JSON, the protocol model, tokenization, the length
checks and the engine's own validation, each failure a RequestError (400) naming the field in
the API's spelling. What passes is (request, prompts' token ids, GenerationConfig)."""
from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass

from fastapi import Request

from lmdeploy_lite.messages import GenerationConfig
from lmdeploy_lite.serve.openai import protocol as p
from lmdeploy_lite.serve.openai.body import parse_request, read_body, render
from lmdeploy_lite.serve.openai.errors import RequestError
from lmdeploy_lite.serve.openai.logprobs import TokenStrings
from lmdeploy_lite.serve.openai.metrics import ServerMetrics

try:                                   # what a chat template raises for messages it refuses
    from jinja2 import TemplateError
except ImportError:
    class TemplateError(Exception):
        """Never raised: without jinja2 there are no chat templates."""

# GenerationConfig's field names as the OpenAI API spells them (for error messages)
API_FIELD_NAMES = {'max_new_tokens': 'max_tokens', 'random_seed': 'seed', 'stop_words': 'stop'}
COMPLETION_DEFAULT_MAX_TOKENS = 16     # OpenAI's default for /v1/completions
DEFAULT_MAX_SEQUENCES = 256            # prompts x n of one request (--max-sequences-per-request)


@dataclass(frozen=True)
class ServerContext:
    """What every handler of one server reads: the pipeline and what is fixed for its life."""
    pipe: object                       # lmdeploy_lite.api.Pipeline
    model_name: str
    metrics: ServerMetrics
    token_strings: TokenStrings        # logprobs' token strings
    max_request_bytes: int
    max_sequences: int = DEFAULT_MAX_SEQUENCES     # prompts x n one request may run

    @property
    def session_len(self) -> int:
        return self.pipe.session_len


async def read_checked(ctx: ServerContext, request: Request, check):
    """The body read against the size limit (413), then `check(ctx, body)` in a worker thread."""
    body = await read_body(request, ctx.max_request_bytes)
    return await asyncio.to_thread(check, ctx, body)


def check_completion(ctx: ServerContext, body: bytes
                     ) -> tuple[p.CompletionRequest, list[list[int]], GenerationConfig]:
    """The request, its prompts' token ids (one or several) and their GenerationConfig (the
    default max_tokens: 16, or what the longest prompt leaves)."""
    req = parse_request(body, p.CompletionRequest)
    prompts = req.prompt
    if not (isinstance(prompts, list) and prompts and isinstance(prompts[0], (str, list))):
        prompts = [prompts]
    check_sequences(ctx, len(prompts), req.n)      # before any prompt is tokenized
    prepared = [prepare(ctx, req, prompt, 'prompt', 'max_tokens', req.max_tokens,
                        COMPLETION_DEFAULT_MAX_TOKENS) for prompt in prompts]
    gen_config = min((g for _, g in prepared), key=lambda g: g.max_new_tokens)
    return req, [ids for ids, _ in prepared], gen_config


def check_chat(ctx: ServerContext, body: bytes
               ) -> tuple[p.ChatCompletionRequest, list[list[int]], GenerationConfig]:
    req = parse_request(body, p.ChatCompletionRequest)
    check_sequences(ctx, 1, req.n)
    messages = [m.template_message() for m in req.messages]
    tools = [t.model_dump(exclude_none=True) for t in req.tools or ()]
    name = 'max_completion_tokens' if req.max_completion_tokens else 'max_tokens'
    ids, gen_config = prepare(ctx, req, messages, 'messages', name,
                              req.max_completion_tokens or req.max_tokens, None, tools)
    return req, [ids], gen_config


def check_sequences(ctx: ServerContext, num_prompts: int, n: int):
    """400 naming both numbers when a request asks for more sequences (prompts x n) than the
    server runs for one request: each is a sequence in the engine's queue."""
    if num_prompts * n > ctx.max_sequences:
        raise RequestError(f'prompt: {num_prompts} prompt(s) x n={n} = {num_prompts * n} '
                           f'sequences; this server runs at most {ctx.max_sequences} per request '
                           f'(--max-sequences-per-request): send fewer prompts or a smaller n',
                           'prompt' if num_prompts > 1 else 'n')


def prepare(ctx: ServerContext, req: p.SamplingRequest, prompt, param: str,
            max_tokens_param: str, max_tokens: int | None, default_max_tokens: int | None,
            tools: list[dict] | None = None) -> tuple[list[int], GenerationConfig]:
    """One prompt's token ids and GenerationConfig. `param`: the prompt's field name;
    max_tokens (None: `default_max_tokens`, None: what the session leaves)."""
    if req.model is not None and req.model != ctx.model_name:
        raise RequestError(f'model={render(req.model)}: unknown; this server serves '
                           f'{ctx.model_name!r} (see GET /v1/models)', 'model', 'model_not_found')
    ids = _encode(ctx, prompt, param, tools)
    session_len = ctx.session_len
    room = session_len - len(ids)
    if max_tokens is not None and 0 < room < max_tokens:
        raise RequestError(f'{max_tokens_param}={max_tokens}: the prompt has {len(ids)} '
                           f'tokens and session_len={session_len}, so at most {room} can be '
                           f'generated; ask for at most {room}', max_tokens_param)
    try:
        gen_config = req.generation_config(
            max(1, max_tokens or min(default_max_tokens or room, room)), ctx.pipe.vocab_size)
        ctx.pipe.validate_request(ids, gen_config)
    except ValueError as e:              # 'field=value: reason' or 'prompt: reason'
        message = str(e)
        field = re.match(r'\w*', message).group()
        if field in API_FIELD_NAMES:
            message = API_FIELD_NAMES[field] + message[len(field):]
            field = API_FIELD_NAMES[field]
        raise RequestError(message, param if field == 'prompt' else field or None) from None
    return ids, gen_config


def _encode(ctx: ServerContext, prompt, param: str, tools: list[dict] | None) -> list[int]:
    try:
        return ctx.pipe.encode(prompt, tools=tools) if tools else ctx.pipe.encode(prompt)
    except ValueError as e:
        raise RequestError(str(e), 'tools' if str(e).startswith('tools') else param) from None
    except TemplateError as e:
        raise RequestError(f'{param}: the chat template refuses them ({e})', param) from None
