"""The OpenAI-compatible HTTP server: /v1/models, /v1/completions, /v1/chat/completions (SSE
streaming), /health, /metrics.

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
import json
import logging
import os
import re
import signal
import threading
import time
from contextlib import aclosing, asynccontextmanager
from typing import AsyncIterator, Callable

import anyio
import uvicorn
from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response as HTTPResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic.json_schema import models_json_schema
from sse_starlette.sse import EventSourceResponse

from lmdeploy_lite.messages import GenerationConfig, Response, SpecDecodeStats
from lmdeploy_lite.serve.openai import protocol as p
from lmdeploy_lite.serve.openai.auth import APIKeyMiddleware
from lmdeploy_lite.serve.openai.body import parse_request, read_body, render
from lmdeploy_lite.serve.openai.errors import RequestError, install_error_handlers
from lmdeploy_lite.serve.openai.logprobs import CompletionLogprobs, TokenStrings, chat_logprobs
from lmdeploy_lite.serve.openai.metrics import RequestTracker, ServerMetrics
from lmdeploy_lite.serve.openai.tool_parser import ToolCallParser

try:                                   # what a chat template raises for messages it refuses
    from jinja2 import TemplateError
except ImportError:
    class TemplateError(Exception):
        """Never raised: without jinja2 there are no chat templates."""

logger = logging.getLogger('lmdeploy_lite.serve')

DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20
STREAM_SHUTDOWN_GRACE_S = 5.0          # a stream's time to end itself once shutdown begins
DISCONNECT_CHECK_S = 0.25             # how often a non-streamed request asks whether its client left
ENGINE_POLL_S = 0.5                    # how often the server checks that the engine is alive
# GenerationConfig's field names as the OpenAI API spells them (for error messages)
API_FIELD_NAMES = {'max_new_tokens': 'max_tokens', 'random_seed': 'seed', 'stop_words': 'stop'}
GENERATION_FAILED = 'generation failed for this request; the server log has the details'
ENGINE_STOPPED = 'the engine stopped after an error; the server is shutting down'


def tool_calls_finish(finish_reason: str | None, num_calls: int) -> str | None:
    """'tool_calls' for an output that made calls and stopped by itself (a cut one keeps
    'length')."""
    return 'tool_calls' if num_calls and finish_reason == 'stop' else finish_reason


def engine_error(e: Exception | None = None) -> RequestError:
    """What a client is told when its generation failed (the details go to the log only)."""
    if e is not None:
        logger.error('generation failed: %s', e)
    return RequestError(GENERATION_FAILED, status=500, type='internal_error',
                        code='generation_failed')


def create_app(pipe, model_name: str, api_keys: list[str] | None = None,
               num_spec_tokens: int = 0, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
               on_engine_failure: Callable[[], None] | None = None) -> FastAPI:
    """`on_engine_failure()` is called once the engine has died for good (serve: shut down)."""

    async def watch_engine():
        while pipe._loop.error is None:
            await asyncio.sleep(ENGINE_POLL_S)
        logger.error('%s: %s', ENGINE_STOPPED, pipe._loop.error)
        app.state.engine_failed = True
        if on_engine_failure is not None:
            on_engine_failure()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        watcher = asyncio.create_task(watch_engine())
        try:
            yield
        finally:
            watcher.cancel()
            await asyncio.to_thread(pipe.close)

    app = FastAPI(title='lmdeploy_lite', version='0.1.0', lifespan=lifespan)
    metrics = ServerMetrics(pipe, num_spec_tokens)
    engine_like = pipe.engine or pipe._loop
    session_len, vocab_size = engine_like.session_len, engine_like.model_config.vocab_size
    token_strings = TokenStrings(pipe.tokenizer)          # logprobs' token strings
    app.state.pipe, app.state.metrics, app.state.engine_failed = pipe, metrics, False
    install_error_handlers(app, metrics.requests.labels('invalid').inc)
    if api_keys:
        app.add_middleware(APIKeyMiddleware, api_keys=api_keys)
    _document_request_bodies(app, p.CompletionRequest, p.ChatCompletionRequest)

    # ---- checking one request (off the event loop) --------------------------------------------
    def prepare(req: p.SamplingRequest, prompt, param: str, max_tokens_param: str,
                max_tokens: int | None, default_max_tokens: int | None,
                tools: list[dict] | None = None) -> tuple[list[int], GenerationConfig]:
        if req.model is not None and req.model != model_name:
            raise RequestError(f'model={render(req.model)}: unknown; this server serves '
                               f'{model_name!r} (see GET /v1/models)', 'model', 'model_not_found')
        try:
            ids = pipe.encode(prompt, tools=tools) if tools else pipe.encode(prompt)
        except ValueError as e:
            raise RequestError(str(e), 'tools' if str(e).startswith('tools') else param
                               ) from None
        except TemplateError as e:
            raise RequestError(f'{param}: the chat template refuses them ({e})', param) from None
        room = session_len - len(ids)
        if max_tokens is not None and 0 < room < max_tokens:
            raise RequestError(f'{max_tokens_param}={max_tokens}: the prompt has {len(ids)} '
                               f'tokens and session_len={session_len}, so at most {room} can be '
                               f'generated; ask for at most {room}', max_tokens_param)
        greedy = req.temperature < p.GREEDY_TEMPERATURE or req.top_p < p.GREEDY_TOP_P
        stop = [req.stop] if isinstance(req.stop, str) else req.stop
        try:
            gen_config = GenerationConfig(
                max_new_tokens=max(1, max_tokens or min(default_max_tokens or room, room)),
                do_sample=not greedy, temperature=0.0 if greedy else req.temperature,
                top_p=req.top_p, top_k=0 if req.top_k >= vocab_size else max(req.top_k, 0),
                stop_words=stop or None, ignore_eos=req.ignore_eos, random_seed=req.seed,
                skip_special_tokens=req.skip_special_tokens,
                repetition_penalty=req.repetition_penalty,
                presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                n=req.n, logprobs=req.num_logprobs)
            pipe._loop.validate_request(ids, gen_config)
        except ValueError as e:              # 'field=value: reason' or 'prompt: reason'
            message = str(e)
            field = re.match(r'\w*', message).group()
            if field in API_FIELD_NAMES:
                message = API_FIELD_NAMES[field] + message[len(field):]
                field = API_FIELD_NAMES[field]
            raise RequestError(message, param if field == 'prompt' else field or None) from None
        return ids, gen_config

    def check_completion(body: bytes
                         ) -> tuple[p.CompletionRequest, list[list[int]], GenerationConfig]:
        """The request, its prompts' token ids (one or several) and their GenerationConfig
        (the default max_tokens: 16, or what the longest prompt leaves)."""
        req = parse_request(body, p.CompletionRequest)
        prompts = req.prompt
        if not (isinstance(prompts, list) and prompts and isinstance(prompts[0], (str, list))):
            prompts = [prompts]
        prepared = [prepare(req, prompt, 'prompt', 'max_tokens', req.max_tokens, 16)
                    for prompt in prompts]
        gen_config = min((g for _, g in prepared), key=lambda g: g.max_new_tokens)
        return req, [ids for ids, _ in prepared], gen_config

    def check_chat(body: bytes
                   ) -> tuple[p.ChatCompletionRequest, list[list[int]], GenerationConfig]:
        req = parse_request(body, p.ChatCompletionRequest)
        messages = [m.template_message() for m in req.messages]
        tools = [t.model_dump(exclude_none=True) for t in req.tools or ()]
        name = 'max_completion_tokens' if req.max_completion_tokens else 'max_tokens'
        ids, gen_config = prepare(req, messages, 'messages', name,
                                  req.max_completion_tokens or req.max_tokens, None, tools)
        return req, [ids], gen_config

    async def checked(request: Request, check):
        body = await read_body(request, max_request_bytes)
        return await asyncio.to_thread(check, body)

    # ---- running one request ------------------------------------------------------------------
    # A request runs n choices of each of its prompts (chat: one prompt); choice `index` =
    # prompt_index * n + i, as OpenAI numbers them. Each choice has its own RequestTracker (the
    # prompt counted once, with its choice 0).
    def track(prompts: list[list[int]], n: int) -> list[RequestTracker]:
        return [metrics.track(len(prompts[i // n]) if i % n == 0 else 0)
                for i in range(len(prompts) * n)]

    async def generate(prompts: list[list[int]], gen_config: GenerationConfig,
                       trackers: list[RequestTracker], request: Request | None = None,
                       stream_text: bool = True, request_id: str | None = None
                       ) -> AsyncIterator[Response]:
        """`pipe.generate_ids` with bookkeeping; with `request`, stops when the client has gone
        (looked at most every DISCONNECT_CHECK_S). Closing or cancelling this generator aborts
        every unfinished choice (aclosing makes that immediate). An engine failure raises
        RequestError (500, or 503 once the engine is dead)."""
        outcomes = ['abort'] * len(trackers)
        next_check = 0.0
        try:
            async with aclosing(pipe.generate_ids(prompts, gen_config, stream_text,
                                                  request_id)) as responses:
                async for r in responses:
                    trackers[r.index].observe(r)
                    if r.finish_reason is not None:
                        outcomes[r.index] = r.finish_reason
                    elif request is not None and time.monotonic() >= next_check:
                        next_check = time.monotonic() + DISCONNECT_CHECK_S
                        if await request.is_disconnected():
                            logger.info('client disconnected; aborting its request')
                            return
                    yield r
        except Exception as e:
            outcomes = ['error' if o == 'abort' else o for o in outcomes]
            if pipe._loop.error is not None:
                raise RequestError(ENGINE_STOPPED, status=503, type='internal_error',
                                   code='engine_stopped') from e
            raise engine_error(e) from e
        finally:
            for tracker, outcome in zip(trackers, outcomes):
                tracker.finish(outcome)

    def usage(lasts: list[Response | None], prompts: list[list[int]]) -> p.Usage:
        """Each prompt counted once (its cached tokens: its choice 0's), every choice's
        completion tokens and speculative counters added up."""
        n = len(lasts) // len(prompts)
        num_prompt = sum(len(ids) for ids in prompts)
        completion = sum(r.generate_token_len for r in lasts if r is not None)
        stats = [r.spec_stats for r in lasts if r is not None and r.spec_stats is not None]
        spec = None
        if stats:
            s = SpecDecodeStats()
            for one in stats:
                s.merge(one)
            spec = p.SpecDecodeUsage(num_drafts=s.num_drafts, num_draft_tokens=s.num_draft_tokens,
                                     num_accepted_tokens=s.num_accepted_tokens,
                                     accepted_per_position=list(s.accepted_per_position),
                                     mean_accepted_length=s.mean_accepted_length)
        cached = sum(r.num_cached_tokens for r in lasts[::n] if r is not None)
        return p.Usage(prompt_tokens=num_prompt, completion_tokens=completion,
                       total_tokens=num_prompt + completion,
                       prompt_tokens_details=p.PromptTokensDetails(cached_tokens=cached),
                       spec_decode=spec)

    async def run_to_end(prompts, gen_config, request, request_id: str
                         ) -> tuple[list[str], list[Response | None], list[list]]:
        """Every choice's text, last response and logprobs (TokenLogprobs of every token: empty
        unless asked)."""
        num_choices = len(prompts) * gen_config.n
        texts, lasts = [''] * num_choices, [None] * num_choices
        logprobs = [[] for _ in range(num_choices)]
        async with aclosing(generate(prompts, gen_config, track(prompts, gen_config.n),
                                     request, stream_text=False,
                                     request_id=request_id)) as responses:
            async for r in responses:
                texts[r.index] += r.text
                logprobs[r.index] += r.logprobs or ()
                lasts[r.index] = r
        if any(last is not None and last.finish_reason == 'error' for last in lasts):
            raise engine_error()
        return texts, lasts, logprobs

    def stream(prompts, gen_config, make_chunk, include_usage: bool, request_id: str
               ) -> EventSourceResponse:
        """make_chunk(index, text, finish_reason, usage, logprobs) -> a pydantic chunk of choice
        `index`, or None for nothing to send yet; None text: the opening; usage: the last chunk
        (no choice). `logprobs` (a request that asked for them): the TokenLogprobs of the
        choice's tokens since its last chunk sent (tokens whose text is held back go with the
        chunk that carries it), else None. A choice's last chunk carries its hidden-states
        file's path (extract_hidden_states; `request_id` names it, see Pipeline.generate_ids).
        On server shutdown the stream is aborted and each unfinished choice ends with
        finish_reason 'abort', then [DONE]; a failed generation ends with finish_reason 'error',
        an error event and [DONE]."""
        shutdown = anyio.Event()                 # set by sse-starlette when uvicorn shuts down
        num_choices = len(prompts) * gen_config.n

        async def events():
            lasts: list[Response | None] = [None] * num_choices
            trackers = track(prompts, gen_config.n)
            asked = gen_config.logprobs is not None
            unsent = [[] if asked else None for _ in range(num_choices)]     # logprobs
            try:
                for index in range(num_choices):
                    opening = make_chunk(index, None, None, None, None)
                    if opening is not None:
                        yield opening.model_dump_json()
                async with aclosing(generate(prompts, gen_config, trackers,
                                             request_id=request_id)) as responses:
                    async for r in responses:
                        lasts[r.index] = r
                        if asked:
                            unsent[r.index] += r.logprobs or ()
                        if r.text or r.finish_reason:
                            chunk = make_chunk(r.index, r.text, r.finish_reason, None,
                                               unsent[r.index])
                            if chunk is not None and chunk.choices and r.hidden_states_path:
                                chunk.choices[0].hidden_states_path = r.hidden_states_path
                            if chunk is not None:           # None: all its text held back
                                yield chunk.model_dump_json()
                                unsent[r.index] = [] if asked else None
                        if shutdown.is_set() and r.finish_reason is None:
                            break
                for index, last in enumerate(lasts):
                    if last is None or last.finish_reason is None:
                        yield make_chunk(index, '', 'abort', None, None).model_dump_json()
                if any(last is not None and last.finish_reason == 'error' for last in lasts):
                    yield json.dumps(engine_error().body())
                if include_usage:
                    yield make_chunk(None, '', None, usage(lasts, prompts),
                                     None).model_dump_json()
            except Exception as e:
                error = e if isinstance(e, RequestError) else engine_error(e)
                for index, last in enumerate(lasts):
                    if last is None or last.finish_reason is None:
                        yield make_chunk(index, '', 'error', None, None).model_dump_json()
                yield json.dumps(error.body())
            finally:
                for tracker in trackers:         # a no-op for those that ended
                    tracker.finish('abort')
            yield '[DONE]'
        return EventSourceResponse(events(), sep='\n', shutdown_event=shutdown,
                                   shutdown_grace_period=STREAM_SHUTDOWN_GRACE_S)

    # ---- endpoints ----------------------------------------------------------------------------
    @app.get('/health')
    async def health():
        if pipe._loop.error is not None:
            return JSONResponse({'status': 'error', 'error': ENGINE_STOPPED}, status_code=503)
        return {'status': 'ok'}

    @app.get('/metrics')
    async def prometheus():
        return HTTPResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get('/v1/models')
    async def models() -> p.ModelList:
        return p.ModelList(data=[p.ModelCard(id=model_name, max_model_len=session_len)])

    @app.post('/v1/completions', openapi_extra=_json_body(p.CompletionRequest))
    async def completions(request: Request):
        req, prompts, gen_config = await checked(request, check_completion)
        rid, include_usage = p.random_id('cmpl'), bool(req.stream_options
                                                       and req.stream_options.include_usage)
        legacy = [CompletionLogprobs(token_strings, gen_config.skip_special_tokens)
                  if gen_config.logprobs is not None else None
                  for _ in range(len(prompts) * gen_config.n)]       # each choice's
        if req.stream:
            def chunk(index, text, finish_reason, use, logprobs):
                if text is None:
                    return None
                choices = [] if use else [p.CompletionChoice(
                    index=index, text=text, finish_reason=finish_reason,
                    logprobs=legacy[index].add(logprobs) if logprobs is not None else None)]
                return p.CompletionResponse(id=rid, model=model_name, choices=choices, usage=use)
            return stream(prompts, gen_config, chunk, include_usage, rid)
        texts, lasts, logprobs = await run_to_end(prompts, gen_config, request, rid)
        return p.CompletionResponse(
            id=rid, model=model_name,
            choices=[p.CompletionChoice(index=i, text=text,
                                        finish_reason=last and last.finish_reason,
                                        logprobs=legacy[i] and legacy[i].add(logprobs[i]),
                                        hidden_states_path=last and last.hidden_states_path)
                     for i, (text, last) in enumerate(zip(texts, lasts))],
            usage=usage(lasts, prompts))

    @app.post('/v1/chat/completions', openapi_extra=_json_body(p.ChatCompletionRequest))
    async def chat_completions(request: Request):
        req, prompts, gen_config = await checked(request, check_chat)
        rid, include_usage = p.random_id('chatcmpl'), bool(req.stream_options
                                                           and req.stream_options.include_usage)
        parsers = [ToolCallParser([t.model_dump() for t in req.tools],
                                  max_calls=None if req.parallel_tool_calls else 1)
                   if req.parses_tool_calls else None for _ in range(gen_config.n)]
        if req.stream:
            def chunk(index, text, finish_reason, use, logprobs):
                if use is not None:
                    return p.ChatCompletionChunk(id=rid, model=model_name, choices=[], usage=use)
                parser = parsers[index]
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
                                           tool_calls=[p.DeltaToolCall.of(c) for c in calls]
                                           or None)
                return p.ChatCompletionChunk(
                    id=rid, model=model_name,
                    choices=[p.ChatChunkChoice(
                        index=index, delta=delta, finish_reason=finish_reason,
                        logprobs=None if logprobs is None else
                        chat_logprobs(token_strings, logprobs))])
            return stream(prompts, gen_config, chunk, include_usage, rid)
        texts, lasts, logprobs = await run_to_end(prompts, gen_config, request, rid)
        choices = []
        for index, (text, last, parser) in enumerate(zip(texts, lasts, parsers)):
            finish_reason, calls = last and last.finish_reason, []
            if parser is not None:
                text, calls = parser.feed(text, final=True)
                finish_reason = tool_calls_finish(finish_reason, len(calls))
            message = p.ChatResponseMessage(content=text if text or not calls else None,
                                            tool_calls=[p.ToolCallOut.of(c) for c in calls]
                                            or None)
            choices.append(p.ChatChoice(index=index, message=message,
                                        finish_reason=finish_reason,
                                        logprobs=chat_logprobs(token_strings, logprobs[index])
                                        if req.logprobs else None,
                                        hidden_states_path=last and last.hidden_states_path))
        return p.ChatCompletionResponse(id=rid, model=model_name, choices=choices,
                                        usage=usage(lasts, prompts))

    return app


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


def default_model_name(model_path: str) -> str:
    return os.path.basename(os.path.normpath(model_path))


def serve(pipe, model_name: str, host: str = '127.0.0.1', port: int = 23333,
          api_keys: list[str] | None = None, log_level: str = 'WARNING',
          num_spec_tokens: int = 0, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
          graceful_timeout_s: float = 10.0) -> int:
    """Serve until SIGINT or SIGTERM (alike) or until the engine dies; returns the exit code.

    Shutdown: uvicorn stops accepting and lets in-flight requests finish; streams end with
    finish_reason 'abort' (their requests aborted), and whatever is left after
    `graceful_timeout_s` is cancelled, which aborts it. Then the pipeline closes (its workers
    exit). Returns 0 after a signal, 1 when the engine died (every open request has ended with an
    error), 3 when the server could not start (as uvicorn)."""
    server: _Server | None = None

    def stop():
        server.should_exit = True
    app = create_app(pipe, model_name, api_keys, num_spec_tokens, max_request_bytes, stop)
    server = _Server(uvicorn.Config(app, host=host, port=port, log_level=log_level.lower(),
                                    timeout_graceful_shutdown=graceful_timeout_s))
    try:
        print(f'lmdeploy_lite: serving {model_name!r} on http://{host}:{port}', flush=True)
        server.run()
    finally:
        pipe.close()                             # startup failures (a port in use); idempotent
    if app.state.engine_failed:
        return 1
    return 0 if server.started else 3
