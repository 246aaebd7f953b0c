"""The OpenAI-compatible HTTP server: /v1/models, /v1/completions, /v1/chat/completions (SSE
streaming), /health, /metrics. Each route is a function of one ServerContext (checks.py) and the
request; checking a request is checks.py, running it (to the end or streamed) streaming.py.

A request travels: API key (middleware) -> body read against the size limit (413) -> off the
event loop: JSON, validation, tokenization and the length checks (400 naming the field) -> the
engine. Nothing a request holds can reach the engine unchecked, and no failure answers with a
traceback. A streaming client that goes away cancels its generator, which aborts the request and
frees its cache (`Pipeline.generate`). If the engine dies for good, every open request ends with
an error and the server shuts itself down (`serve` returns 1).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
from contextlib import asynccontextmanager
from typing import Callable

import uvicorn
from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response as HTTPResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic.json_schema import models_json_schema

from lmdeploy_lite.serve.openai import protocol as p
from lmdeploy_lite.serve.openai.admission import ConcurrencyLimitMiddleware
from lmdeploy_lite.serve.openai.auth import APIKeyMiddleware, HostGuardMiddleware, is_loopback
from lmdeploy_lite.serve.openai.checks import (ServerContext, ServerLimits, check_chat,
                                               check_completion, read_checked)
from lmdeploy_lite.serve.openai.connections import HttpLimits
from lmdeploy_lite.serve.openai.errors import install_error_handlers
from lmdeploy_lite.serve.openai.logprobs import (CompletionLogprobs, TokenStrings, chat_logprobs,
                                                 chat_logprobs_json, splice_json)
from lmdeploy_lite.serve.openai.metrics import ServerMetrics
from lmdeploy_lite.serve.openai.streaming import (ENGINE_STOPPED, run_to_end, stream,
                                                  usage)
from lmdeploy_lite.serve.openai.tool_parser import ToolCallParser

logger = logging.getLogger('lmdeploy_lite.serve')

ENGINE_POLL_S = 0.5                    # how often the server checks that the engine is alive


def tool_calls_finish(finish_reason: str | None, num_calls: int) -> str | None:
    """'tool_calls' for an output that made calls and stopped by itself (a cut one keeps
    'length')."""
    return 'tool_calls' if num_calls and finish_reason == 'stop' else finish_reason


def create_app(pipe, model_name: str, api_keys: list[str] | None = None,
               num_spec_tokens: int = 0, on_engine_failure: Callable[[], None] | None = None,
               limits: ServerLimits = ServerLimits(), bound_host: str | None = None,
               allowed_hosts: tuple[str, ...] = ()) -> FastAPI:
    """The app of one pipeline: its routes are the functions below over one ServerContext.
    `on_engine_failure()` is called once the engine has died for good (serve: shut down);
    `limits`: what requests may ask (checks.py; max_concurrent None: no limit, admission.py);
    `bound_host`: the address the server listens on: a loopback one turns the Host guard on
    (auth.py), which lets `allowed_hosts` through besides loopback hosts."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        watcher = asyncio.create_task(watch_engine(app, on_engine_failure))
        try:
            yield
        finally:
            watcher.cancel()
            await asyncio.to_thread(pipe.close)

    app = FastAPI(title='lmdeploy_lite', version='0.1.0', lifespan=lifespan)
    metrics = ServerMetrics(pipe, num_spec_tokens)
    ctx = ServerContext(pipe, model_name, metrics, TokenStrings(pipe.tokenizer), limits)
    app.state.pipe, app.state.metrics, app.state.engine_failed = pipe, metrics, False
    install_error_handlers(app, lambda outcome: metrics.requests.labels(outcome).inc())
    if limits.max_concurrent is not None:   # innermost: only authorized requests count
        app.add_middleware(ConcurrencyLimitMiddleware, limit=limits.max_concurrent)
    if api_keys:
        app.add_middleware(APIKeyMiddleware, api_keys=api_keys)
    if bound_host is not None and is_loopback(bound_host):
        app.add_middleware(HostGuardMiddleware, allowed_hosts=tuple(allowed_hosts))
    _document_request_bodies(app, p.CompletionRequest, p.ChatCompletionRequest)
    get = ['GET', 'HEAD']                   # HEAD wherever GET is (uptime probes send it)
    app.api_route('/health', methods=get)(_bound(health, ctx))
    app.api_route('/metrics', methods=get)(_bound(prometheus, ctx))
    app.api_route('/v1/models', methods=get, response_model=p.ModelList)(_bound(models, ctx))
    app.post('/v1/completions', openapi_extra=_json_body(p.CompletionRequest))(
        _bound(completions, ctx))
    app.post('/v1/chat/completions', openapi_extra=_json_body(p.ChatCompletionRequest))(
        _bound(chat_completions, ctx))
    return app


def _bound(endpoint, ctx: ServerContext):
    """`endpoint(ctx, request)` as a route handler of `request` alone."""
    async def handler(request: Request):
        return await endpoint(ctx, request)
    handler.__name__ = endpoint.__name__
    return handler


async def watch_engine(app: FastAPI, on_engine_failure: Callable[[], None] | None):
    """Wait for the engine to die for good; then mark the app and call `on_engine_failure`."""
    pipe = app.state.pipe
    while pipe.error is None:
        await asyncio.sleep(ENGINE_POLL_S)
    logger.error('%s: %s', ENGINE_STOPPED, pipe.error)
    app.state.engine_failed = True
    if on_engine_failure is not None:
        on_engine_failure()


# ---- endpoints: each a function of the server's context and the request ----------------------
async def health(ctx: ServerContext, request: Request):
    """200, or 503 when the engine has stopped, or has made no progress for longer than
    `--health-stall-timeout` while requests are pending (naming the rank the others wait for)."""
    if ctx.pipe.error is not None:
        return JSONResponse({'status': 'error', 'error': ENGINE_STOPPED}, status_code=503)
    stalled = ctx.pipe.stalled(ctx.limits.stall_s)
    if stalled is not None:
        return JSONResponse({'status': 'stalled', 'error': stalled}, status_code=503)
    return {'status': 'ok'}


async def prometheus(ctx: ServerContext, request: Request):
    return HTTPResponse(generate_latest(ctx.metrics.registry), media_type=CONTENT_TYPE_LATEST)


async def models(ctx: ServerContext, request: Request) -> p.ModelList:
    return p.ModelList(data=[p.ModelCard(id=ctx.model_name, max_model_len=ctx.session_len)])


async def completions(ctx: ServerContext, request: Request):
    req, prompts, gen_config = await read_checked(ctx, request, check_completion)
    rid, include_usage = p.random_id('cmpl'), bool(req.stream_options
                                                   and req.stream_options.include_usage)
    legacy = [CompletionLogprobs(ctx.token_strings, gen_config.skip_special_tokens)
              if gen_config.logprobs is not None else None
              for _ in range(len(prompts) * gen_config.n)]       # each choice's
    if req.stream:
        def chunk(index, text, finish_reason, use, logprobs):
            if text is None:
                return None
            choices = [] if use else [p.CompletionChoice(
                index=index, text=text, finish_reason=finish_reason,
                logprobs=legacy[index].add(logprobs) if logprobs is not None else None)]
            return p.CompletionResponse(id=rid, model=ctx.model_name, choices=choices, usage=use)
        return stream(ctx, prompts, gen_config, chunk, include_usage, rid)
    texts, lasts, logprobs = await run_to_end(ctx, prompts, gen_config, request, rid)

    def build() -> bytes:
        return p.CompletionResponse(
            id=rid, model=ctx.model_name,
            choices=[p.CompletionChoice(index=i, text=text,
                                        finish_reason=last and last.finish_reason,
                                        logprobs=legacy[i] and legacy[i].add(logprobs[i]),
                                        hidden_states_path=last and last.hidden_states_path)
                     for i, (text, last) in enumerate(zip(texts, lasts))],
            usage=usage(lasts, prompts)).model_dump_json().encode()
    return await off_the_loop(build)


async def chat_completions(ctx: ServerContext, request: Request):
    req, prompts, gen_config = await read_checked(ctx, request, check_chat)
    rid, include_usage = p.random_id('chatcmpl'), bool(req.stream_options
                                                       and req.stream_options.include_usage)
    parsers = [ToolCallParser([t.model_dump() for t in req.tools],
                              max_calls=None if req.parallel_tool_calls else 1)
               if req.parses_tool_calls else None for _ in range(gen_config.n)]
    if req.stream:
        return stream(ctx, prompts, gen_config, ChatChunks(ctx, rid, parsers), include_usage,
                      rid)
    texts, lasts, logprobs = await run_to_end(ctx, prompts, gen_config, request, rid)
    return await off_the_loop(lambda: chat_response(ctx, rid, req, parsers, texts, lasts,
                                                    logprobs, prompts))


async def off_the_loop(build) -> HTTPResponse:
    """A whole JSON response, built and serialized (pydantic, at C speed) in a worker thread:
    a response of many choices and logprobs takes time in proportion to its size, which must
    not hold up the event loop (every other stream, /health)."""
    return HTTPResponse(await asyncio.to_thread(build), media_type='application/json')


def chat_response(ctx: ServerContext, rid: str, req: p.ChatCompletionRequest,
                  parsers: list[ToolCallParser | None], texts: list[str], lasts: list,
                  logprobs: list[list], prompts: list[list[int]]) -> bytes:
    """A non-streamed chat completion's JSON: each choice's text, tool calls parsed out."""
    choices = []
    for index, (text, last, parser) in enumerate(zip(texts, lasts, parsers)):
        finish_reason, calls = last and last.finish_reason, []
        if parser is not None:
            text, calls = parser.feed(text, final=True)
            finish_reason = tool_calls_finish(finish_reason, len(calls))
        message = p.ChatResponseMessage(content=text if text or not calls else None,
                                        tool_calls=[p.ToolCallOut.of(c) for c in calls] or None)
        choices.append(p.ChatChoice(index=index, message=message, finish_reason=finish_reason,
                                    hidden_states_path=last and last.hidden_states_path))
    document = p.ChatCompletionResponse(id=rid, model=ctx.model_name, choices=choices,
                                        usage=usage(lasts, prompts)).model_dump_json().encode()
    if not req.logprobs:
        return document
    # written as JSON text, not as objects: see chat_logprobs_json
    return splice_json(document, b'logprobs', [chat_logprobs_json(ctx.token_strings, entries)
                                               for entries in logprobs])


class ChatChunks:
    """A chat stream's `make_chunk` (streaming.stream): the opening delta, content deltas (tool
    calls parsed out of them when the request has tools), the usage chunk."""

    def __init__(self, ctx: ServerContext, rid: str, parsers: list[ToolCallParser | None]):
        self.ctx, self.rid, self.parsers = ctx, rid, parsers

    def __call__(self, index, text, finish_reason, use, logprobs):
        ctx = self.ctx
        if use is not None:
            return p.ChatCompletionChunk(id=self.rid, model=ctx.model_name, choices=[], usage=use)
        parser = self.parsers[index]
        if text is None:
            delta = p.DeltaMessage(role='assistant', content='')
        elif parser is None:
            delta = p.DeltaMessage(content=text)
        else:
            text, calls = parser.feed(text, final=finish_reason is not None)
            if not text and not calls and finish_reason is None:
                return None
            finish_reason = tool_calls_finish(finish_reason, parser.num_calls)
            delta = p.DeltaMessage(content=text if text or not calls else None,
                                   tool_calls=[p.DeltaToolCall.of(c) for c in calls] or None)
        return p.ChatCompletionChunk(
            id=self.rid, model=ctx.model_name,
            choices=[p.ChatChunkChoice(
                index=index, delta=delta, finish_reason=finish_reason,
                logprobs=None if logprobs is None else chat_logprobs(ctx.token_strings,
                                                                     logprobs))])


# ---- OpenAPI: the endpoints read their bodies themselves, so the schema is declared here -------
def _json_body(model) -> dict:
    return {'requestBody': {'required': True, 'content': {'application/json': {
        'schema': {'$ref': f'#/components/schemas/{model.__name__}'}}}}}


def _document_request_bodies(app: FastAPI, *models):
    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            _, defs = models_json_schema([(m, 'validation') for m in models],
                                         ref_template='#/components/schemas/{model}')
            schema.setdefault('components', {}).setdefault('schemas', {}).update(defs['$defs'])
            app.openapi_schema = schema
        return app.openapi_schema
    app.openapi = openapi


# ---- running the server ---------------------------------------------------------------------
class _Server(uvicorn.Server):
    """uvicorn's server, except that it does not re-raise SIGINT/SIGTERM once it has shut down:
    both signals mean the same graceful shutdown, after which `serve` returns 0."""

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        saved = {sig: signal.signal(sig, self.handle_exit)
                 for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in saved.items():
                signal.signal(sig, handler)


def server_config(app, host: str, port: int, log_level: str, graceful_timeout_s: float,
                  limits: HttpLimits) -> uvicorn.Config:
    """uvicorn's settings: h11 with the connection limits; the keep-alive timeout is the idle
    one."""
    return uvicorn.Config(app, host=host, port=port, log_level=log_level.lower(),
                          timeout_graceful_shutdown=graceful_timeout_s, http=limits.protocol(),
                          timeout_keep_alive=limits.idle_timeout_s)


def default_model_name(model_path: str) -> str:
    return os.path.basename(os.path.normpath(model_path))


def serve(pipe, model_name: str, host: str = '127.0.0.1', port: int = 23333,
          api_keys: list[str] | None = None, log_level: str = 'WARNING',
          num_spec_tokens: int = 0, graceful_timeout_s: float = 10.0,
          limits: ServerLimits = ServerLimits(), allowed_hosts: tuple[str, ...] = (),
          http_limits: HttpLimits | None = None) -> int:
    """Serve until SIGINT or SIGTERM (alike) or until the engine dies; returns the exit code.
    `limits`: what requests may ask (checks.py; a concurrency limit not given is sized from
    the engine's capacity); `http_limits`: what one connection may hold (connections.py; None:
    the defaults).

    Shutdown: uvicorn stops accepting and lets in-flight requests finish; streams end with
    finish_reason 'abort' (their requests aborted), and whatever is left after
    `graceful_timeout_s` is cancelled, which aborts it. Then the pipeline closes (its workers
    exit). Returns 0 after a signal, 1 when the engine died (every open request has ended with an
    error), 3 when the server could not start (as uvicorn)."""
    server: _Server | None = None

    def stop():
        server.should_exit = True
    app = create_app(pipe, model_name, api_keys, num_spec_tokens, stop,
                     limits.sized_for(pipe.capacity), bound_host=host,
                     allowed_hosts=allowed_hosts)
    server = _Server(server_config(app, host, port, log_level, graceful_timeout_s,
                                   http_limits or HttpLimits()))
    try:
        print(f'lmdeploy_lite: serving {model_name!r} on http://{host}:{port}', flush=True)
        server.run()
    finally:
        pipe.close()                             # startup failures (a port in use); idempotent
    if app.state.engine_failed:
        return 1
    return 0 if server.started else 3
