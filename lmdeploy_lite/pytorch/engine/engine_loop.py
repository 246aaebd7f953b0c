"""Drives an Engine in a background thread so that callers (pipeline, server) can submit,
stream and abort concurrently. Engine state is touched by this thread alone.

Results reach a front-end once per engine step, not once per token per request: requests
submitted with the same `Channel` get one `post` per step carrying all of their outputs of that
step (a batch of 64 streams is one queue put, one thread wake-up). A plain callable sink still
gets one call per output (tests, simple callers)."""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from lmdeploy_lite.messages import GenerationConfig
from lmdeploy_lite.pytorch.engine.engine import Engine
from lmdeploy_lite.pytorch.engine.heartbeat import Heartbeats
from lmdeploy_lite.pytorch.engine.step_output import StepOutput
from lmdeploy_lite.pytorch.engine.hidden_states import check_request_id
from lmdeploy_lite.pytorch.engine.sequence import SeqStatus, Sequence, request_error

logger = logging.getLogger('lmdeploy_lite')

Item = StepOutput | BaseException      # a request's output, or the exception that ended it


class Channel:
    """A front-end's inbox for many requests. `post(items)` is called in the engine's thread
    once per step with `[(tag, item), ...]` for every request of this channel that has news
    (in the engine's order; `tag` as given to `submit`). It must not block for long; raising
    aborts those requests (the engine goes on)."""

    def __init__(self, post: Callable[[list[tuple[object, Item]]], None]):
        self.post = post


Sink = Callable[[Item], None] | Channel


@dataclass(eq=False)
class RequestHandle:
    token_ids: list[int]
    gen_config: GenerationConfig
    sink: Sink                         # a Channel, or a callable that receives every item
    tag: object = None                 # names the request in its Channel's posts
    request_id: str | None = None      # names its hidden-states file (None: the engine's choice)
    seq: Sequence | None = None
    aborted: bool = field(default=False)


def hand_out(pairs: list[tuple[object, Item]]) -> list:
    """Give each (handle, item) to its request's sink: one `post` per Channel with all of its
    items (in order), one call per item for a callable sink. A sink that raises is logged and
    its handles are returned (the caller aborts them); the others are unaffected."""
    failed, posts = [], {}
    for handle, item in pairs:
        sink = handle.sink
        if isinstance(sink, Channel):
            posts.setdefault(id(sink), (sink, []))[1].append((handle, item))
            continue
        try:
            sink(item)
        except Exception:
            logger.exception('a request sink failed; aborting that request only')
            failed.append(handle)
    for channel, entries in posts.values():
        try:
            channel.post([(h.tag, item) for h, item in entries])
        except Exception:
            logger.exception('a front-end channel failed; aborting its requests of this step')
            failed += [h for h, _ in entries]
    return failed


def check_group(gen_config: GenerationConfig, tags: list,
                request_ids: list[str | None] | None = None) -> list[str | None]:
    """The caller names each of the n choices (tags; request ids, default None each)."""
    n = getattr(gen_config, 'n', 1)
    request_ids = [None] * len(tags) if request_ids is None else request_ids
    if len(tags) != n or len(request_ids) != n:
        raise ValueError(f'n={n}: {len(tags)} request tags and {len(request_ids)} request ids '
                         f'given, one of each per choice needed (submit takes one choice, '
                         f'submit_group the n of a prompt)')
    return request_ids


class EngineLoop:
    """Failures: one request's own failure in the engine thread (its admission: the checks
    again, its generator) ends that request alone with finish_reason 'error' and
    `seq.error` saying why; the engine goes on. A failure of a step itself cannot be put on one
    request (the engine's state is then unknown): `error` is set, every waiting request and
    every later submit gets a RuntimeError, and the thread ends."""

    def __init__(self, engine: Engine, idle_wait_s: float = 0.05):
        self.engine = engine
        self.idle_wait_s = idle_wait_s
        self._inbox: queue.Queue = queue.Queue()
        self._live: dict[int, RequestHandle] = {}
        self._stopping = threading.Event()
        self._lock = threading.Lock()      # submit vs. the thread's last look at the inbox
        self._ended = False                # the thread takes no more requests
        self.error: BaseException | None = None
        self._heartbeats = Heartbeats(1)       # the thread's progress (heartbeat.py)
        self._busy_since = 0.0
        self._thread = threading.Thread(target=self._run, name='lmdeploy_lite-engine', daemon=True)
        self._thread.start()

    def validate_request(self, token_ids: list[int], gen_config: GenerationConfig):
        self.engine.validate_request(token_ids, gen_config)

    def submit(self, token_ids: list[int], gen_config: GenerationConfig, sink: Sink,
               tag: object = None, request_id: str | None = None) -> RequestHandle:
        """One request (gen_config.n == 1). Validates in the caller's thread (a bad request
        raises here and touches nothing). Raises RuntimeError once the engine has stopped or is
        closing. `request_id`: names the request's hidden-states file (extract_hidden_states;
        None: a random one)."""
        return self.submit_group(token_ids, gen_config, sink, [tag], [request_id])[0]

    def submit_group(self, token_ids: list[int], gen_config: GenerationConfig, sink: Sink,
                     tags: list, request_ids: list[str | None] | None = None
                     ) -> list[RequestHandle]:
        """The gen_config.n choices of one prompt (`Engine.add_group`), one handle each (choice
        i tagged `tags[i]`, named `request_ids[i]`; each one can be aborted alone). As `submit`
        otherwise."""
        self._check_running()
        request_ids = check_group(gen_config, tags, request_ids)
        self.engine.validate_request(token_ids, gen_config)
        for request_id in request_ids:
            if request_id is not None:
                check_request_id(request_id)
        handles = [RequestHandle(list(token_ids), gen_config, sink, tag, request_id)
                   for tag, request_id in zip(tags, request_ids)]
        with self._lock:
            self._check_running()
            if not self._live and self._inbox.empty():
                self._busy_since = time.monotonic()
            self._inbox.put(('add', handles))
        return handles

    def _check_running(self):
        if self.error is not None:
            raise RuntimeError(f'the engine stopped after an error: {self.error!r}')
        if self._ended or self._stopping.is_set():
            raise RuntimeError('the engine is closed')

    def abort(self, handle: RequestHandle):
        self._inbox.put(('abort', handle))

    def stalled(self, limit_s: float) -> str | None:
        """One line when the engine thread has shown no progress for over `limit_s` while
        requests are pending, else None."""
        if not self._live and self._inbox.empty():
            return None
        return self._heartbeats.stalled(limit_s, self._busy_since,
                                        describe=lambda _: 'the engine thread')

    def close(self, timeout_s: float = 30.0):
        """Ends the thread; requests still running get RuntimeError. Idempotent."""
        self._stopping.set()
        self._inbox.put(('stop', None))
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.error('engine thread did not stop within %.0f s', timeout_s)

    # ---- the thread -----------------------------------------------------------------------
    def _run(self):
        ended: BaseException = RuntimeError('the engine was closed')
        try:
            while not self._stopping.is_set():
                self._heartbeats.beat(0)
                self._drain_inbox(block=not self.engine.has_work)
                if self.engine.has_work:
                    self._deliver(self.engine.step())
        except BaseException as e:          # the engine is unusable: tell every waiter
            logger.exception('engine step failed; the engine stops')
            self.error = ended = e
        finally:
            with self._lock:                # from here on submit raises
                self._ended = True
                queued = self._take_queued()
            handles = list(self._live.values()) + queued
            self._live.clear()
            if self.error is None:          # closed: free their caches (a no-op if finished)
                for handle in handles:
                    if handle.seq is not None:
                        self.engine.abort(handle.seq)
            hand_out([(handle, ended) for handle in handles])

    def _take_queued(self) -> list[RequestHandle]:
        """Requests submitted but never admitted."""
        handles = []
        while True:
            try:
                kind, handle = self._inbox.get_nowait()
            except queue.Empty:
                return handles
            if kind == 'add':
                handles += [h for h in handle if not h.aborted]

    def _drain_inbox(self, block: bool):
        try:
            item = self._inbox.get(timeout=self.idle_wait_s) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, handle = item
            if kind == 'add' and not all(h.aborted for h in handle):
                self._add(handle)
            elif kind == 'abort':
                self._abort(handle)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _add(self, handles: list[RequestHandle]):
        """One prompt's choices (aborted before admission: admitted and aborted at once)."""
        first = handles[0]
        try:
            if len(handles) == 1:
                named = {} if first.request_id is None else {'request_id': first.request_id}
                seqs = [self.engine.add_request(first.token_ids, first.gen_config, **named)]
            else:
                seqs = self.engine.add_group(first.token_ids, first.gen_config,
                                             [h.request_id for h in handles])
        except Exception as e:              # this request's own failure: it alone ends
            logger.warning('request failed on admission: %s', request_error(e))
            for handle in handles:
                handle.seq = Sequence(seq_id=-1, token_ids=list(handle.token_ids),
                                      num_prompt=len(handle.token_ids),
                                      gen_config=handle.gen_config, arrival=-1,
                                      status=SeqStatus.FINISHED, finish_reason='error',
                                      error=request_error(e))
            hand_out([(handle, StepOutput(handle.seq, [])) for handle in handles])
            return
        for handle, seq in zip(handles, seqs):
            handle.seq = seq
            self._live[seq.seq_id] = handle
        for handle in handles:
            if handle.aborted:
                self._abort(handle)

    def _abort(self, handle: RequestHandle):
        handle.aborted = True
        if handle.seq is None or handle.seq.is_finished:
            return
        self.engine.abort(handle.seq)
        self._deliver([StepOutput(handle.seq, [])])

    def _deliver(self, outputs: list[StepOutput]):
        """One step's outputs to their requests' sinks (one post per Channel)."""
        pairs = []
        for out in outputs:
            handle = self._live.get(out.seq.seq_id)
            if handle is None:
                continue
            if out.finished:
                del self._live[out.seq.seq_id]
            pairs.append((handle, out))
        for handle in hand_out(pairs):
            if not handle.seq.is_finished:
                self._abort(handle)
