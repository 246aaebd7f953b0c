"""Checking one request, off the event loop: JSON, the protocol model, tokenization, the length
checks and the engine's own validation, each failure a RequestError (400) naming the field in
the API's spelling. What passes is (request, prompts' token ids, GenerationConfig)."""
from __future__ import annotations

import asyncio
import re
import threading
from dataclasses import dataclass, field, replace

from fastapi import Request

from lmdeploy_lite.messages import GenerationConfig
from lmdeploy_lite.serve.openai import protocol as p
from lmdeploy_lite.serve.openai.body import parse_request, read_body, render
from lmdeploy_lite.serve.openai.errors import RequestError
from lmdeploy_lite.serve.openai.logprobs import TokenStrings
from lmdeploy_lite.serve.openai.metrics import ServerMetrics

# GenerationConfig's field names as the OpenAI API spells them (for error messages)
API_FIELD_NAMES = {'max_new_tokens': 'max_tokens', 'random_seed': 'seed', 'stop_words': 'stop'}
QUEUE_FACTOR = 4                       # default requests in flight: batches of the engine's
INLINE_CHECK_BYTES = 4096              # a body this small is checked on the event loop


@dataclass(frozen=True)
class ServerLimits:
    """What one request, and all of them together, may ask of the server; each is a flag of
    `serve api_server` (the name in the error it gives)."""
    max_request_bytes: int = 4 * 2**20      # a body (413)
    max_sequences: int = 256                # prompts x n of one request (400)
    max_tokens: int = 2**20                 # max_tokens x n x prompts of one request (400)
    max_concurrent: int | None = None       # generation requests in flight (429); None: none
    stall_s: float = 30.0                   # /health: 503 past this silence with work pending
    workers: int = 1                        # front-end processes max_concurrent is split among

    def __post_init__(self):
        for name, flag in (('max_request_bytes', 'max-request-bytes'),
                           ('max_sequences', 'max-sequences-per-request'),
                           ('max_tokens', 'max-tokens-per-request'),
                           ('max_concurrent', 'max-concurrent-requests')):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f'--{flag}={getattr(self, name)}: must be >= 1')
        if not self.stall_s > 0:
            raise ValueError(f'--health-stall-timeout={self.stall_s}: must be > 0')

    def sized_for(self, capacity: int) -> 'ServerLimits':
        """These limits, the concurrency one (when not set) sized from the sequences the engine
        runs at once (`Pipeline.capacity`): QUEUE_FACTOR batches, queued or running."""
        return self if self.max_concurrent is not None else replace(
            self, max_concurrent=max(16, QUEUE_FACTOR * capacity))


@dataclass(frozen=True)
class ServerContext:
    """What every handler of one server reads: the pipeline and what is fixed for its life."""
    pipe: object                       # lmdeploy_lite.api.Pipeline
    model_name: str
    metrics: ServerMetrics
    token_strings: TokenStrings        # logprobs' token strings
    limits: ServerLimits = ServerLimits()
    sampling_defaults: dict | None = None   # --generation-config auto: the model's
    # set once the server begins to shut down (serve's signal handler): streams end with 'abort'
    shutdown: threading.Event = field(default_factory=threading.Event)


async def read_checked(ctx: ServerContext, request: Request, check):
    """The body, read, then `check(ctx, body)`: a small one on the event loop (~0.2 ms a KiB on
    the 2-core CPU), a larger one in a worker thread, so that no request stalls the streams for
    long. The hop to a thread and back cost more than a small check, and in a burst of arrivals
    the threads fought the loop for the GIL: 256 requests of 0.7 KiB took 25% more CPU."""
    body = await read_body(request, ctx.limits.max_request_bytes)
    if len(body) <= INLINE_CHECK_BYTES:
        return check(ctx, body)
    return await asyncio.to_thread(check, ctx, body)


def check_completion(ctx: ServerContext, body: bytes
                     ) -> tuple[p.CompletionRequest, list[list[int]], GenerationConfig]:
    """The request, its prompts' token ids (one or several) and their GenerationConfig (the
    default max_tokens: 16, or what the longest prompt leaves)."""
    req = parse_request(body, p.CompletionRequest)
    prompts = prompt_list(req.prompt)
    check_sequences(ctx, len(prompts), req, req.max_tokens or req.default_max_tokens)
    prepared = [prepare(ctx, req, prompt, 'prompt') for prompt in prompts]   # after that check
    gen_config = min((g for _, g in prepared), key=lambda g: g.max_new_tokens)
    return req, [ids for ids, _ in prepared], gen_config


def prompt_list(prompt) -> list:
    """A completion request's prompts: one string or token-id list, or a list of them."""
    many = isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list))
    return prompt if many else [prompt]


def prompt_texts(ctx: ServerContext, req: p.CompletionRequest, prompts: list[list[int]]
                 ) -> list[str]:
    """Each prompt as text (`echo`): a string as sent, token ids decoded (special tokens
    written out, as sent)."""
    sent, tokenizer = prompt_list(req.prompt), ctx.pipe.tokenizer
    if tokenizer is None and not all(isinstance(prompt, str) for prompt in sent):
        raise RequestError('echo=true: this model has no tokenizer to write token ids as text',
                           'echo')
    return [prompt if isinstance(prompt, str) else
            tokenizer.decode(ids, skip_special_tokens=False) for prompt, ids in zip(sent, prompts)]


def check_chat(ctx: ServerContext, body: bytes
               ) -> tuple[p.ChatCompletionRequest, list[list[int]], GenerationConfig]:
    req = parse_request(body, p.ChatCompletionRequest)
    _, max_tokens = req.length_field
    check_sequences(ctx, 1, req, max_tokens)
    messages = [m.template_message() for m in req.messages]
    tools = [t.model_dump(exclude_none=True) for t in req.tools or ()]
    ids, gen_config = prepare(ctx, req, messages, 'messages', tools, req.chat_template_kwargs)
    if max_tokens is None:             # what the session leaves, now that the prompt is known
        check_sequences(ctx, 1, req, gen_config.max_new_tokens)
    return req, [ids], gen_config


def check_sequences(ctx: ServerContext, num_prompts: int, req: p.SamplingRequest,
                    max_tokens: int | None):
    """400 naming the numbers when a request asks for more sequences (prompts x n, or x best_of
    candidates) or more generated tokens (that times max_tokens; None: not known yet) than the
    server runs for one request: each sequence waits in the engine's queue, each token is a
    step's work."""
    limits, n, (max_tokens_param, _) = ctx.limits, req.num_candidates, req.length_field
    n_param = 'best_of' if req.picks_best else 'n'
    sequences = num_prompts * n
    if sequences > limits.max_sequences:
        raise RequestError(f'prompt: {num_prompts} prompt(s) x {n_param}={n} = {sequences} '
                           f'sequences; this server runs at most {limits.max_sequences} per '
                           f'request (--max-sequences-per-request): send fewer prompts or a '
                           f'smaller {n_param}', 'prompt' if num_prompts > 1 else n_param)
    # a sequence generates at most what its session holds: past that, the length check speaks
    tokens = None if max_tokens is None else sequences * min(max_tokens, ctx.pipe.session_len)
    if tokens is not None and tokens > limits.max_tokens:
        raise RequestError(f'{max_tokens_param}: {sequences} sequence(s) x {max_tokens_param}='
                           f'{max_tokens} = {tokens} tokens; this server '
                           f'generates at most {limits.max_tokens} per request '
                           f'(--max-tokens-per-request): ask for fewer', max_tokens_param)


def prepare(ctx: ServerContext, req: p.SamplingRequest, prompt, param: str,
            tools: list[dict] | None = None, template_kwargs: dict | None = None
            ) -> tuple[list[int], GenerationConfig]:
    """One prompt's token ids and GenerationConfig (`req.generation_config`); `param`: its field."""
    check_model(ctx, req.model)
    ids = encode(ctx, prompt, param, tools, template_kwargs)
    session_len, (max_tokens_param, max_tokens) = ctx.pipe.session_len, req.length_field
    room = session_len - len(ids)
    if max_tokens is not None and 0 < room < max_tokens:
        raise RequestError(f'{max_tokens_param}={max_tokens}: the prompt has {len(ids)} '
                           f'tokens and session_len={session_len}, so at most {room} can be '
                           f'generated; ask for at most {room}', max_tokens_param)
    try:
        gen_config = req.generation_config(room, ctx.pipe.vocab_size, ctx.sampling_defaults)
        ctx.pipe.validate_request(ids, gen_config)
    except ValueError as e:              # 'field=value: reason' or 'prompt: reason'
        field = re.match(r'\w*', str(e)).group()
        name = API_FIELD_NAMES.get(field, field)
        raise RequestError(name + str(e)[len(field):],
                           param if field == 'prompt' else name or None) from None
    return ids, gen_config


def check_model(ctx: ServerContext, model: str | None, status: int = 400):
    if model is not None and model != ctx.model_name:
        raise RequestError(f'model={render(model)}: unknown; this server serves {ctx.model_name!r} '
                           '(see GET /v1/models)', 'model', 'model_not_found', status=status)


def encode(ctx: ServerContext, prompt, param: str, tools: list[dict] | None,
           template_kwargs: dict | None = None) -> list[int]:
    """The token ids the engine runs for `prompt` (`Pipeline.encode`), or a RequestError naming
    `param` (or tools, chat_template_kwargs)."""
    extra = {'tools': tools} if tools else {}
    if template_kwargs:
        extra['chat_template_kwargs'] = template_kwargs
    try:
        return ctx.pipe.encode(prompt, **extra)
    except ValueError as e:            # a template's own refusal included (Pipeline.encode)
        named = next((f for f in ('tools', 'chat_template_kwargs') if str(e).startswith(f)), None)
        raise RequestError(str(e), named or param) from None
