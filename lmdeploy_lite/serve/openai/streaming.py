"""Running one checked request: its choices through the pipeline with their metrics, to the end
(`run_to_end`) or as server-sent events (`stream`, written by responses.py). A request runs n
choices of each of its prompts (chat: one prompt); choice `index` = prompt_index * n + i, as
OpenAI numbers them. Each choice has its own RequestTracker (the prompt counted with choice 0)."""
from __future__ import annotations

import asyncio
import logging
import math
import time
from contextlib import aclosing
from typing import AsyncIterator

from fastapi import Request
from starlette.responses import Response as HTTPResponse

from lmdeploy_lite.messages import GenerationConfig, Response
from lmdeploy_lite.serve.openai.checks import ServerContext
from lmdeploy_lite.serve.openai.errors import RequestError
from lmdeploy_lite.serve.openai.metrics import RequestTracker
from lmdeploy_lite.serve.openai.responses import CompletionChunks, dumps, event, usage

logger = logging.getLogger('lmdeploy_lite.serve')

SSE_HEADERS = [(b'content-type', b'text/event-stream; charset=utf-8'),
               (b'cache-control', b'no-store'), (b'x-accel-buffering', b'no')]
DISCONNECT_CHECK_S = 0.25           # how often a non-streamed request asks whether its client left
GENERATION_FAILED = 'generation failed for this request; the server log has the details'
ENGINE_STOPPED = 'the engine stopped after an error; the server is shutting down'
DONE = event('[DONE]')


def engine_error(e: Exception | None = None) -> RequestError:
    """What a client is told when its generation failed (the details go to the log only)."""
    if e is not None:
        logger.error('generation failed: %s', e)
    return RequestError(GENERATION_FAILED, None, 'generation_failed', 500, 'internal_error')


def track(ctx: ServerContext, prompts: list[list[int]], n: int) -> list[RequestTracker]:
    return [ctx.metrics.track(len(prompts[i // n]) if i % n == 0 else 0)
            for i in range(len(prompts) * n)]


async def generate(ctx: ServerContext, prompts: list[list[int]], gen_config: GenerationConfig,
                   trackers: list[RequestTracker], request: Request | None = None,
                   stream_text: bool = True, request_id: str | None = None
                   ) -> AsyncIterator[Response]:
    """`pipe.generate_ids` with bookkeeping; with `request`, stops when the client has gone
    (looked at most every DISCONNECT_CHECK_S). Closing or cancelling it aborts every unfinished
    choice. An engine failure raises RequestError (500, or 503 once the engine is dead)."""
    outcomes, next_check = ['abort'] * len(trackers), 0.0
    try:
        async with aclosing(ctx.pipe.generate_ids(prompts, gen_config, stream_text,
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
        if ctx.pipe.error is not None:
            raise RequestError(ENGINE_STOPPED, None, 'engine_stopped', 503, 'internal_error') from e
        raise engine_error(e) from e
    finally:
        for tracker, outcome in zip(trackers, outcomes):
            tracker.finish(outcome)


async def run_to_end(ctx: ServerContext, prompts: list[list[int]], gen_config: GenerationConfig,
                     request: Request, request_id: str
                     ) -> tuple[list[str], list[Response | None], list[list]]:
    """Every choice's text, last response and logprobs (each token's TokenLogprobs, if asked)."""
    choices = len(prompts) * gen_config.n
    texts, lasts, logprobs = [''] * choices, [None] * choices, [[] for _ in range(choices)]
    async with aclosing(generate(ctx, prompts, gen_config, track(ctx, prompts, gen_config.n),
                                 request, stream_text=False, request_id=request_id)) as responses:
        async for r in responses:
            texts[r.index] += r.text
            logprobs[r.index] += r.logprobs or ()
            lasts[r.index] = r
    if any(last is not None and last.finish_reason == 'error' for last in lasts):
        raise engine_error()
    return texts, lasts, logprobs


def best_of(n: int, candidates: int, texts: list[str], lasts: list[Response | None],
            logprobs: list[list]) -> tuple[list[str], list[Response | None], list[list]]:
    """Of each prompt's `candidates` results (consecutive, as run_to_end returns them), the `n`
    whose tokens have the highest mean log-probability (OpenAI's best_of), best first."""
    def score(i: int) -> float:
        return (sum(e.logprob for e in logprobs[i]) / len(logprobs[i]) if logprobs[i]
                else -math.inf)
    picked = [i for start in range(0, len(texts), candidates)
              for i in sorted(range(start, start + candidates), key=score, reverse=True)[:n]]
    return [texts[i] for i in picked], [lasts[i] for i in picked], [logprobs[i] for i in picked]


def stream(ctx: ServerContext, prompts: list[list[int]], gen_config: GenerationConfig,
           chunks: CompletionChunks, include_usage: bool, request_id: str) -> 'EventStream':
    """The request's chunks as server-sent events, written by `chunks` (responses.py: openings,
    deltas, usage when `include_usage`). A chunk carries every engine step since its choice's last
    one (text_stream.Backlog: a slow client's missed steps are held as one), logprobs with their
    tokens' text; the last one carries the hidden-states path (`request_id` names the file).
    Shutdown: each unfinished choice ends with finish_reason 'abort', then [DONE]; a failed
    generation: finish_reason 'error', an error event, [DONE]."""
    return EventStream(_events(ctx, prompts, gen_config, chunks, include_usage, request_id))


class EventStream(HTTPResponse):
    """An ASGI response of server-sent events: each item of `events` (bytes) is one body message,
    sent as it comes; the one that ends with [DONE] ends the body too (one write). A client
    that disconnects cancels the stream, which closes `events` (the request is aborted). Per
    event it costs one `send`: no cancel scope, task or lock per chunk
    as in sse-starlette (~20 us a chunk on the 2-core CPU, at 64 streams a fifth of the
    front-end's time). The events are sent from a task of their own: a chunk wakes its few
    frames, not every middleware's above the route (~20 more at each wake-up)."""

    status_code, media_type = 200, 'text/event-stream'

    def __init__(self, events: AsyncIterator[bytes]):
        self.body_iterator, self.background = events, None

    async def __call__(self, scope, receive, send):
        sender, left = asyncio.create_task(self._send_all(send)), False

        async def watch():                         # the client's disconnect, read in the background
            nonlocal left
            while (await receive())['type'] != 'http.disconnect':
                pass
            left = True
            sender.cancel()
        watcher = asyncio.create_task(watch())
        try:
            await sender                           # cancelling this task cancels it too
            if self.background is not None:
                await self.background()
        except asyncio.CancelledError:
            if not left or asyncio.current_task().cancelling():
                raise
            logger.info('client disconnected; its stream is aborted')   # nothing is owed
        finally:
            watcher.cancel()

    async def _send_all(self, send):
        async with aclosing(self.body_iterator) as events:
            await send({'type': 'http.response.start', 'status': 200, 'headers': SSE_HEADERS})
            async for data in events:
                last = data.endswith(DONE)           # the event that ends the stream
                await send({'type': 'http.response.body', 'body': data, 'more_body': not last})
                if last:
                    return
        await send({'type': 'http.response.body', 'body': b'', 'more_body': False})


async def _events(ctx: ServerContext, prompts: list[list[int]], gen_config: GenerationConfig,
                  chunks: CompletionChunks, include_usage: bool, request_id: str
                  ) -> AsyncIterator[bytes]:
    """The stream's events; what ends it (the last choice's last delta, the usage, [DONE]) is
    one item, so one write (EventStream ends the body with it)."""
    num_choices = len(prompts) * gen_config.n
    lasts: list[Response | None] = [None] * num_choices
    trackers = track(ctx, prompts, gen_config.n)
    asked = gen_config.logprobs is not None
    unsent = [[] for _ in range(num_choices)]     # each choice's logprobs not sent yet
    tail, unfinished = [], num_choices
    try:
        for opening in map(chunks.opening, range(num_choices)):
            if opening is not None:
                yield event(opening)
        async with aclosing(generate(ctx, prompts, gen_config, trackers,
                                     request_id=request_id)) as responses:
            async for r in responses:
                lasts[r.index] = r
                unsent[r.index] += r.logprobs or ()
                unfinished -= r.finish_reason is not None
                if r.text or r.finish_reason:
                    chunk = chunks.delta(r.index, r.text, r.finish_reason,
                                         unsent[r.index] if asked else None, r.hidden_states_path)
                    if chunk is not None:           # None: all its text held back
                        unsent[r.index] = []
                        if unfinished:
                            yield event(chunk)
                        else:
                            tail.append(event(chunk))
                if ctx.shutdown.is_set() and r.finish_reason is None:
                    break
        tail += [event(chunks.delta(i, '', 'abort', None)) for i in _unended(lasts)]
        if any(last is not None and last.finish_reason == 'error' for last in lasts):
            tail.append(event(dumps(engine_error().body())))
        if include_usage:
            tail.append(event(chunks.usage(usage(lasts, prompts))))
    except Exception as e:
        error = e if isinstance(e, RequestError) else engine_error(e)
        tail += [event(chunks.delta(i, '', 'error', None)) for i in _unended(lasts)]
        tail.append(event(dumps(error.body())))
    finally:
        for tracker in trackers:         # a no-op for those that ended
            tracker.finish('abort')
    yield b''.join(tail) + DONE


def _unended(lasts: list[Response | None]) -> list[int]:
    return [i for i, last in enumerate(lasts) if last is None or last.finish_reason is None]
