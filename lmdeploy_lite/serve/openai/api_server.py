"""The OpenAI-compatible HTTP server: /v1/models, /v1/completions, /v1/chat/completions (SSE
streaming), /health, /metrics.

Every request is checked before it reaches the engine; a bad one gets HTTP 400 with an OpenAI
error body and touches nothing else. A streaming client that goes away cancels its generator,
which aborts the request and frees its cache (`Pipeline.generate`).
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import secrets
from contextlib import aclosing, asynccontextmanager
from typing import AsyncIterator

import anyio
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response as HTTPResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sse_starlette.sse import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from lmdeploy_lite.messages import GenerationConfig, Response
from lmdeploy_lite.serve.openai import protocol as p
from lmdeploy_lite.serve.openai.metrics import RequestTracker, ServerMetrics

logger = logging.getLogger('lmdeploy_lite.serve')

STREAM_SHUTDOWN_GRACE_S = 5.0          # a stream's time to end itself once shutdown begins
# GenerationConfig's field names as the OpenAI API spells them (for error messages)
API_FIELD_NAMES = {'max_new_tokens': 'max_tokens', 'random_seed': 'seed', 'stop_words': 'stop'}


class RequestError(Exception):
    def __init__(self, message: str, param: str | None = None, code: str | None = None,
                 status: int = 400, type: str = 'invalid_request_error'):
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.type = (message, param, code,
                                                                       status, type)


def _error_body(message: str, type: str = 'invalid_request_error', param: str | None = None,
                code: str | None = None) -> dict:
    return p.ErrorResponse(error=p.ErrorInfo(message=message, type=type, param=param,
                                             code=code)).model_dump()


def describe_validation_error(err: dict) -> tuple[str | None, str]:
    """(param, message) of one pydantic error, in the request's own terms."""
    loc = [x for x in err.get('loc', ()) if x != 'body']
    if err.get('type') == 'json_invalid':
        reason = err.get('ctx', {}).get('error', 'malformed')
        where = f' at character {loc[0]}' if loc and isinstance(loc[0], int) else ''
        return None, f'the request body is not valid JSON ({reason}{where})'
    # drop union-member names ('str', 'list[int]', ...) that pydantic puts in the location
    path = [str(x) for x in loc if isinstance(x, int) or not any(c in str(x) for c in '[-')
            and x not in ('str', 'int', 'float', 'bool', 'list', 'dict')]
    param = '.'.join(path) or None
    if err.get('type') == 'missing':
        return param, f"'{param}' is required"
    if not path:
        return None, f'the request body must be a JSON object: {err.get("msg", "")}'
    value = json.dumps(err['input']) if isinstance(err.get('input'), (int, float, str, list)) \
        else repr(err.get('input'))
    if len(value) > 80:
        value = value[:77] + '...'
    msg = err.get('msg', 'invalid value')
    return param, f'{param}={value}: {msg[:1].lower() + msg[1:]}'


def create_app(pipe, model_name: str, api_keys: list[str] | None = None,
               num_spec_tokens: int = 0) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        # uvicorn re-raises SIGTERM/SIGINT when it returns, so close here, not after it returns
        await asyncio.to_thread(pipe.close)

    app = FastAPI(title='lmdeploy_lite', version='0.1.0', lifespan=lifespan)
    metrics = ServerMetrics(pipe, num_spec_tokens)
    session_len = (pipe.engine or pipe._loop).session_len
    app.state.pipe, app.state.metrics = pipe, metrics

    # ---- errors -------------------------------------------------------------------------------
    @app.exception_handler(RequestError)
    async def _request_error(request: Request, e: RequestError):
        if e.status == 400:
            metrics.requests.labels('invalid').inc()
        return JSONResponse(_error_body(e.message, e.type, e.param, e.code), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        param, message = describe_validation_error(e.errors()[0])
        metrics.requests.labels('invalid').inc()
        return JSONResponse(_error_body(message, param=param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        return JSONResponse(_error_body(str(e.detail), 'invalid_request_error'),
                            status_code=e.status_code)

    async def check_api_key(request: Request):
        if not api_keys:
            return
        scheme, _, key = request.headers.get('authorization', '').partition(' ')
        if scheme.lower() != 'bearer' or not any(secrets.compare_digest(key.strip(), k)
                                                 for k in api_keys):
            raise RequestError('missing or invalid API key: send "Authorization: Bearer <key>" '
                               'with one of the keys given to --api-keys', code='invalid_api_key',
                               status=401)

    v1 = [Depends(check_api_key)]

    # ---- checking and running one request ----------------------------------------------------
    def prepare(req: p.SamplingRequest, prompt, param: str, default_max_tokens: int | None
                ) -> tuple[list[int], GenerationConfig]:
        if req.model is not None and req.model != model_name:
            raise RequestError(f'model={req.model!r}: unknown; this server serves '
                               f'{model_name!r} (see GET /v1/models)', 'model', 'model_not_found')
        if req.n != 1:
            raise RequestError(f'n={req.n}: only n=1 is supported', 'n')
        try:
            ids = pipe.encode(prompt)
        except ValueError as e:
            raise RequestError(str(e), param) from None
        max_tokens = default_max_tokens or max(1, session_len - len(ids))
        stop = [req.stop] if isinstance(req.stop, str) else req.stop
        try:
            gen_config = GenerationConfig(
                max_new_tokens=max_tokens, do_sample=req.temperature > 0,
                temperature=req.temperature, top_p=req.top_p, top_k=max(req.top_k, 0),
                stop_words=stop or None, ignore_eos=req.ignore_eos, random_seed=req.seed,
                skip_special_tokens=req.skip_special_tokens)
            pipe._loop.validate_request(ids, gen_config)
        except ValueError as e:              # 'field=value: reason' or 'prompt: reason'
            message = str(e)
            field = re.match(r'\w*', message).group()
            if field in API_FIELD_NAMES:
                message = API_FIELD_NAMES[field] + message[len(field):]
                field = API_FIELD_NAMES[field]
            raise RequestError(message, param if field == 'prompt' else field or None) from None
        return ids, gen_config

    async def generate(ids: list[int], gen_config: GenerationConfig, tracker: RequestTracker,
                       request: Request | None = None) -> AsyncIterator[Response]:
        """`pipe.generate` with bookkeeping; with `request`, stops when the client has gone.
        Closing or cancelling this generator aborts the request (aclosing makes that immediate)."""
        outcome = 'abort'
        try:
            async with aclosing(pipe.generate(ids, gen_config)) as responses:
                async for r in responses:
                    tracker.observe(r)
                    if r.finish_reason is not None:
                        outcome = r.finish_reason
                    elif request is not None and await request.is_disconnected():
                        logger.info('client disconnected; aborting its request')
                        return
                    yield r
        except (ValueError, RuntimeError) as e:
            outcome = 'error'
            raise RequestError(f'generation failed: {e}', status=500, type='internal_error',
                               code='engine_error') from e
        finally:
            tracker.finish(outcome)

    def usage(last: Response | None, num_prompt: int) -> p.Usage:
        n = last.generate_token_len if last else 0
        spec = None
        if last is not None and last.spec_stats is not None:
            s = last.spec_stats
            spec = p.SpecDecodeUsage(num_drafts=s.num_drafts, num_draft_tokens=s.num_draft_tokens,
                                     num_accepted_tokens=s.num_accepted_tokens,
                                     accepted_per_position=list(s.accepted_per_position),
                                     mean_accepted_length=s.mean_accepted_length)
        return p.Usage(prompt_tokens=num_prompt, completion_tokens=n, total_tokens=num_prompt + n,
                       spec_decode=spec)

    async def run_to_end(ids, gen_config, request) -> tuple[str, Response | None]:
        tracker = metrics.track(len(ids))
        text, last = '', None
        async with aclosing(generate(ids, gen_config, tracker, request)) as responses:
            async for r in responses:
                text += r.text
                last = r
        return text, last

    def stream(ids, gen_config, make_chunk, include_usage: bool) -> EventSourceResponse:
        """make_chunk(text, finish_reason, usage) -> a pydantic chunk; None text: the opening.
        On server shutdown the stream is aborted and ends with finish_reason 'abort' and [DONE]."""
        shutdown = anyio.Event()                 # set by sse-starlette when uvicorn shuts down

        async def events():
            last = None
            tracker = metrics.track(len(ids))
            try:
                opening = make_chunk(None, None, None)
                if opening is not None:
                    yield opening.model_dump_json()
                async with aclosing(generate(ids, gen_config, tracker)) as responses:
                    async for r in responses:
                        last = r
                        if r.text or r.finish_reason:
                            yield make_chunk(r.text, r.finish_reason, None).model_dump_json()
                        if shutdown.is_set() and r.finish_reason is None:
                            break
                if last is None or last.finish_reason is None:
                    yield make_chunk('', 'abort', None).model_dump_json()
                if include_usage:
                    yield make_chunk('', None, usage(last, len(ids))).model_dump_json()
            except RequestError as e:
                yield json.dumps(_error_body(e.message, e.type, e.param, e.code))
            finally:
                tracker.finish('abort')          # a no-op unless it ended before generating
            yield '[DONE]'
        return EventSourceResponse(events(), sep='\n', shutdown_event=shutdown,
                                   shutdown_grace_period=STREAM_SHUTDOWN_GRACE_S)

    # ---- endpoints ----------------------------------------------------------------------------
    @app.get('/health')
    async def health():
        error = pipe._loop.error
        if error is not None:
            return JSONResponse({'status': 'error', 'error': str(error)}, status_code=503)
        return {'status': 'ok'}

    @app.get('/metrics')
    async def prometheus():
        return HTTPResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get('/v1/models', dependencies=v1)
    async def models() -> p.ModelList:
        return p.ModelList(data=[p.ModelCard(id=model_name, max_model_len=session_len)])

    @app.post('/v1/completions', dependencies=v1)
    async def completions(req: p.CompletionRequest, request: Request):
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise RequestError(f'prompt: {len(prompt)} prompts given; send one prompt per '
                                   f'request', 'prompt')
            prompt = prompt[0]
        ids, gen_config = prepare(req, prompt, 'prompt', req.max_tokens)
        rid, include_usage = p.random_id('cmpl'), bool(req.stream_options
                                                       and req.stream_options.include_usage)
        if req.stream:
            def chunk(text, finish_reason, use):
                if text is None:
                    return None
                choices = [] if use else [p.CompletionChoice(text=text,
                                                             finish_reason=finish_reason)]
                return p.CompletionResponse(id=rid, model=model_name, choices=choices, usage=use)
            return stream(ids, gen_config, chunk, include_usage)
        text, last = await run_to_end(ids, gen_config, request)
        return p.CompletionResponse(
            id=rid, model=model_name,
            choices=[p.CompletionChoice(text=text, finish_reason=last and last.finish_reason)],
            usage=usage(last, len(ids)))

    @app.post('/v1/chat/completions', dependencies=v1)
    async def chat_completions(req: p.ChatCompletionRequest, request: Request):
        messages = [{'role': m.role, 'content': m.text()} for m in req.messages]
        ids, gen_config = prepare(req, messages, 'messages',
                                  req.max_completion_tokens or req.max_tokens)
        rid, include_usage = p.random_id('chatcmpl'), bool(req.stream_options
                                                           and req.stream_options.include_usage)
        if req.stream:
            def chunk(text, finish_reason, use):
                if use is not None:
                    return p.ChatCompletionChunk(id=rid, model=model_name, choices=[], usage=use)
                delta = (p.DeltaMessage(role='assistant', content='') if text is None
                         else p.DeltaMessage(content=text))
                return p.ChatCompletionChunk(
                    id=rid, model=model_name,
                    choices=[p.ChatChunkChoice(delta=delta, finish_reason=finish_reason)])
            return stream(ids, gen_config, chunk, include_usage)
        text, last = await run_to_end(ids, gen_config, request)
        return p.ChatCompletionResponse(
            id=rid, model=model_name,
            choices=[p.ChatChoice(message=p.ChatResponseMessage(content=text),
                                  finish_reason=last and last.finish_reason)],
            usage=usage(last, len(ids)))

    return app


def default_model_name(model_path: str) -> str:
    return os.path.basename(os.path.normpath(model_path))


def serve(pipe, model_name: str, host: str = '127.0.0.1', port: int = 23333,
          api_keys: list[str] | None = None, log_level: str = 'WARNING',
          num_spec_tokens: int = 0, graceful_timeout_s: float = 10.0):
    """Run until SIGINT/SIGTERM. uvicorn stops accepting and lets in-flight requests finish;
    streams end with finish_reason 'abort' (their requests aborted), and whatever is left after
    `graceful_timeout_s` is cancelled, which aborts it. Then the pipeline closes (its workers exit)
    and uvicorn re-raises the signal, so the process ends as that signal says."""
    import uvicorn
    app = create_app(pipe, model_name, api_keys, num_spec_tokens)
    try:
        print(f'lmdeploy_lite: serving {model_name!r} on http://{host}:{port}', flush=True)
        uvicorn.run(app, host=host, port=port, log_level=log_level.lower(),
                    timeout_graceful_shutdown=graceful_timeout_s)
    finally:
        pipe.close()                             # startup failures (a port in use); idempotent
