"""The OpenAI-compatible HTTP server: /v1/models (and /v1/models/{id}), /v1/completions,
/v1/chat/completions (SSE streaming), /tokenize and /detokenize (vLLM's), /health, /metrics. Each
route is a function of one ServerContext (checks.py) and the request; checks.py checks a request,
streaming.py runs it (to the end or streamed), responses.py writes what it sends.

A request travels: API key (middleware) -> body read against the size limit (413) -> JSON,
validation, tokenization, the length checks (400 naming the field; a large body's off the event
loop) -> the engine.
Nothing a request holds reaches the engine unchecked, and no failure answers with a traceback. If
the engine dies for good, every open request ends with an error and the server shuts down.
"""
from __future__ import annotations

import asyncio
import gc
import logging
import signal
import socket
import sys
import threading
import time
from contextlib import asynccontextmanager, contextmanager
from typing import Callable, Literal

import uvicorn
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response as HTTPResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, Field
from pydantic.json_schema import models_json_schema

from lmdeploy_lite.serve.openai import protocol as p
from lmdeploy_lite.serve.openai.admission import ConcurrencyLimitMiddleware
from lmdeploy_lite.serve.openai.auth import APIKeyMiddleware, HostGuardMiddleware, is_loopback
from lmdeploy_lite.serve.openai.checks import (ServerContext, ServerLimits, check_chat,
                                               check_completion, check_model, prompt_texts,
                                               read_checked)
from lmdeploy_lite.serve.openai.connections import CannotListen, HttpLimits, bind_socket
from lmdeploy_lite.serve.openai.errors import install_error_handlers
from lmdeploy_lite.serve.openai.logprobs import CompletionLogprobs, TokenStrings
from lmdeploy_lite.serve.openai.metrics import ServerMetrics
from lmdeploy_lite.serve.openai.responses import (ChatChunks, CompletionChunks, chat_response,
                                                  completion_response, usage)
from lmdeploy_lite.serve.openai.streaming import ENGINE_STOPPED, best_of, run_to_end, stream
from lmdeploy_lite.serve.openai.tokenize import (DetokenizeRequest, TokenizeRequest,
                                                 check_detokenize, check_tokenize)
from lmdeploy_lite.serve.openai.tool_parser import ToolCallParser

logger = logging.getLogger('lmdeploy_lite.serve')

ENGINE_POLL_S = 0.5                    # how often the server checks that the engine is alive
GC_YOUNG_OBJECTS = 20_000              # the collector's first generation (Python's default: 700)


class ModelCard(BaseModel):
    id: str
    object: Literal['model'] = 'model'
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = 'lmdeploy_lite'
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal['list'] = 'list'
    data: list[ModelCard]


def create_app(pipe, model_name: str, api_keys: list[str] | None = None,
               num_spec_tokens: int = 0, on_engine_failure: Callable[[], None] | None = None,
               limits: ServerLimits = ServerLimits(), bound_host: str | None = None,
               allowed_hosts: tuple[str, ...] = (), allow_origins: tuple[str, ...] = (),
               sampling_defaults: dict | None = None) -> FastAPI:
    """The app of one pipeline: its routes are the functions below over one ServerContext.
    `on_engine_failure()`: called once the engine has died for good; `limits`: checks.py and
    admission.py; `bound_host`: a loopback one turns on the Host guard (auth.py), which lets
    `allowed_hosts` through; `allow_origins`: CORS ('*': any), outermost, so a preflight needs no
    API key and every answer has the headers; `sampling_defaults`: for fields a request omits."""

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
    ctx = ServerContext(pipe, model_name, metrics, TokenStrings(pipe.tokenizer), limits,
                        sampling_defaults)
    app.state.pipe, app.state.metrics, app.state.engine_failed = pipe, metrics, False
    app.state.shutdown = ctx.shutdown
    install_error_handlers(app, lambda outcome: metrics.requests.labels(outcome).inc())
    if limits.max_concurrent is not None:   # innermost: only authorized requests count
        app.add_middleware(ConcurrencyLimitMiddleware, limit=limits.max_concurrent,
                           workers=limits.workers)
    if api_keys:
        app.add_middleware(APIKeyMiddleware, api_keys=api_keys)
    if bound_host is not None and is_loopback(bound_host):
        app.add_middleware(HostGuardMiddleware, allowed_hosts=tuple(allowed_hosts))
    if allow_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(allow_origins),
                           allow_methods=['*'], allow_headers=['*'])
    posts = {'/v1/completions': (completions, p.CompletionRequest),   # path: (endpoint, body)
             '/v1/chat/completions': (chat_completions, p.ChatCompletionRequest),
             '/tokenize': (tokenize, TokenizeRequest),
             '/detokenize': (detokenize, DetokenizeRequest)}
    _document_request_bodies(app, *(body for _, body in posts.values()))
    get = ['GET', 'HEAD']                   # HEAD wherever GET is (uptime probes send it)
    app.api_route('/health', methods=get)(_bound(health, ctx))
    app.api_route('/metrics', methods=get)(_bound(prometheus, ctx))
    app.api_route('/v1/models', methods=get, response_model=ModelList)(_bound(models, ctx))
    app.api_route('/v1/models/{model_id:path}', methods=get,
                  response_model=ModelCard)(_bound(model, ctx))
    for path, (endpoint, body) in posts.items():
        app.post(path, openapi_extra=_json_body(body))(_bound(endpoint, ctx))
    return app


def _bound(endpoint, ctx: ServerContext):
    async def handler(request: Request):
        return await endpoint(ctx, request)
    handler.__name__ = endpoint.__name__
    return handler


async def watch_engine(app: FastAPI, on_engine_failure: Callable[[], None] | None):
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
    if (stalled := ctx.pipe.stalled(ctx.limits.stall_s)) is not None:
        return JSONResponse({'status': 'stalled', 'error': stalled}, status_code=503)
    return {'status': 'ok'}


async def prometheus(ctx: ServerContext, request: Request):
    return HTTPResponse(generate_latest(ctx.metrics.registry), media_type=CONTENT_TYPE_LATEST)


async def models(ctx: ServerContext, request: Request) -> ModelList:
    return ModelList(data=[ModelCard(id=ctx.model_name, max_model_len=ctx.pipe.session_len)])


async def model(ctx: ServerContext, request: Request) -> ModelCard:
    """The served model's card; any other id is a 404 (model_not_found), as OpenAI answers."""
    check_model(ctx, request.path_params['model_id'], status=404)
    return ModelCard(id=ctx.model_name, max_model_len=ctx.pipe.session_len)


async def tokenize(ctx: ServerContext, request: Request):
    return JSONResponse(await read_checked(ctx, request, check_tokenize))


async def detokenize(ctx: ServerContext, request: Request):
    return JSONResponse(await read_checked(ctx, request, check_detokenize))


async def completions(ctx: ServerContext, request: Request):
    req, prompts, gen_config = await read_checked(ctx, request, check_completion)
    rid = p.random_id('cmpl')
    legacy = [CompletionLogprobs(ctx.token_strings, gen_config.skip_special_tokens)
              if req.logprobs is not None else None
              for _ in range(len(prompts) * req.n)]       # each choice's
    echoes = [text for text in prompt_texts(ctx, req, prompts)
              for _ in range(req.n)] if req.echo else None
    if req.stream:                                        # best_of > n is not streamed
        chunks = CompletionChunks(rid, ctx.model_name, legacy, echoes)
        return stream(ctx, prompts, gen_config, chunks, req.includes_usage, rid)
    texts, lasts, logprobs = await run_to_end(ctx, prompts, gen_config, request, rid)
    use = None
    if req.picks_best:                                    # usage: every candidate's tokens
        use = usage(lasts, prompts)
        texts, lasts, logprobs = best_of(req.n, gen_config.n, texts, lasts, logprobs)
    texts = [echo + text for echo, text in zip(echoes, texts)] if echoes else texts
    return await off_the_loop(completion_response, rid, ctx.model_name, prompts, texts, lasts,
                              logprobs, legacy, use)


async def chat_completions(ctx: ServerContext, request: Request):
    req, prompts, gen_config = await read_checked(ctx, request, check_chat)
    rid = p.random_id('chatcmpl')
    parsers = [ToolCallParser([t.model_dump() for t in req.tools],
                              max_calls=None if req.parallel_tool_calls else 1)
               if req.parses_tool_calls else None for _ in range(gen_config.n)]
    thoughts = [ctx.pipe.reasoning_parser(prompts[0]) if ctx.pipe.reasoning else None
                for _ in range(gen_config.n)]
    if req.stream:
        chunks = ChatChunks(rid, ctx.model_name, parsers, ctx.token_strings, thoughts)
        return stream(ctx, prompts, gen_config, chunks, req.includes_usage, rid)
    texts, lasts, logprobs = await run_to_end(ctx, prompts, gen_config, request, rid)
    return await off_the_loop(chat_response, rid, ctx.model_name, prompts, texts, lasts,
                              logprobs if req.logprobs else None, parsers, ctx.token_strings,
                              thoughts)


async def off_the_loop(build, *args) -> HTTPResponse:
    """A whole JSON response, `build(*args)`, written in a worker thread: its time grows with its
    size (choices, logprobs) and must not hold up the event loop (every other stream, /health)."""
    return HTTPResponse(await asyncio.to_thread(build, *args), media_type='application/json')


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
    both signals mean the same graceful shutdown, after which `serve` returns 0. Its shutdown
    first sets `shutdown` (ServerContext.shutdown: open streams end with 'abort')."""

    def __init__(self, config: uvicorn.Config, shutdown: threading.Event):
        super().__init__(config)
        self.shutdown_begins = shutdown

    async def shutdown(self, sockets=None):
        self.shutdown_begins.set()
        await super().shutdown(sockets)

    @contextmanager
    def capture_signals(self):
        main = threading.current_thread() is threading.main_thread()
        saved = {sig: signal.signal(sig, self.handle_exit)
                 for sig in ((signal.SIGINT, signal.SIGTERM) if main else ())}
        try:
            yield
        finally:
            for sig, handler in saved.items():
                signal.signal(sig, handler)


def server_config(app, host: str, port: int, log_level: str, graceful_timeout_s: float,
                  limits: HttpLimits) -> uvicorn.Config:
    """uvicorn's settings (on uvloop where installed): its HTTP protocol with the connection limits;
    keep-alive is the idle timeout."""
    return uvicorn.Config(app, host=host, port=port, log_level=log_level.lower(),
                          timeout_graceful_shutdown=graceful_timeout_s, http=limits.protocol(),
                          timeout_keep_alive=limits.idle_timeout_s)


def settle_collector():
    """What startup made (modules, the model's Python objects: ~400k) out of the collector's full
    passes, which scan it all holding the GIL (a ~0.2 s stall of every stream); and a young
    generation of GC_YOUNG_OBJECTS: a pass scans the young objects still alive, at 256 streams a
    step's pending chunks (~0.4 ms a pass on the 2-core CPU), so Python's 700 (~250 passes a
    second) took ~10% of the front-end's CPU. Streaming makes no cyclic garbage to wait for."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_YOUNG_OBJECTS, *gc.get_threshold()[1:])


def serve(pipe, model_name: str, host: str = '127.0.0.1', port: int = 23333,
          api_keys: list[str] | None = None, log_level: str = 'WARNING',
          graceful_timeout_s: float = 10.0, limits: ServerLimits = ServerLimits(),
          http_limits: HttpLimits | None = None, sock: socket.socket | None = None,
          announce: bool = True, **app_options) -> int:
    """Serve until SIGINT or SIGTERM (alike) or until the engine dies. `limits`: checks.py (a
    concurrency limit not given is sized from the engine's capacity); `http_limits`: connections.py
    (None: the defaults); `sock`: host:port already bound (`bind_socket`, which the CLI calls before
    it loads the model); `announce`: print the address once serving (a front-end worker's parent
    prints it instead, workers.py); `app_options`: create_app's.

    Shutdown: uvicorn stops accepting; streams end with finish_reason 'abort' (their requests
    aborted), other requests may finish until `graceful_timeout_s`, then are cancelled; then the
    pipeline closes. Returns 0 after a signal, 1 when the engine died, 3 when the server could not
    start (as uvicorn)."""
    server: _Server | None = None
    app = create_app(pipe, model_name, api_keys, limits=limits.sized_for(pipe.capacity),
                     on_engine_failure=lambda: setattr(server, 'should_exit', True),
                     bound_host=host, **app_options)
    server = _Server(server_config(app, host, port, log_level, graceful_timeout_s,
                                   http_limits or HttpLimits()), app.state.shutdown)
    try:
        sock = sock or bind_socket(host, port)
        if announce:
            print(f'lmdeploy_lite: serving {model_name!r} on http://{host}:{port}', flush=True)
        settle_collector()
        server.run(sockets=[sock])
    except CannotListen as e:
        print(f'error: {e}', file=sys.stderr)
    finally:
        pipe.close()                             # startup failures; idempotent
    return 1 if app.state.engine_failed else 0 if server.started else 3
