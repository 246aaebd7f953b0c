"""Drives an Engine in a background thread so that callers (pipeline, server) can submit,
stream and abort concurrently. Engine state is touched by this thread alone."""
from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import Callable

from lmdeploy_lite.messages import GenerationConfig
from lmdeploy_lite.pytorch.engine.engine import Engine, StepOutput
from lmdeploy_lite.pytorch.engine.sequence import Sequence

logger = logging.getLogger('lmdeploy_lite')

Sink = Callable[[StepOutput | BaseException], None]


@dataclass(eq=False)
class RequestHandle:
    token_ids: list[int]
    gen_config: GenerationConfig
    sink: Sink                         # receives every StepOutput, or the exception that ended it
    seq: Sequence | None = None
    aborted: bool = field(default=False)


class EngineLoop:

    def __init__(self, engine: Engine, idle_wait_s: float = 0.05):
        self.engine = engine
        self.idle_wait_s = idle_wait_s
        self._inbox: queue.Queue = queue.Queue()
        self._live: dict[int, RequestHandle] = {}
        self._stopping = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name='lmdeploy_lite-engine', daemon=True)
        self._thread.start()

    def validate_request(self, token_ids: list[int], gen_config: GenerationConfig):
        self.engine.validate_request(token_ids, gen_config)

    def submit(self, token_ids: list[int], gen_config: GenerationConfig, sink: Sink
               ) -> RequestHandle:
        """Validates in the caller's thread (a bad request raises here and touches nothing)."""
        if self.error is not None:
            raise RuntimeError(f'the engine stopped after an error: {self.error!r}')
        self.engine.validate_request(token_ids, gen_config)
        handle = RequestHandle(list(token_ids), gen_config, sink)
        self._inbox.put(('add', handle))
        return handle

    def abort(self, handle: RequestHandle):
        self._inbox.put(('abort', handle))

    def close(self, timeout_s: float = 30.0):
        self._stopping.set()
        self._inbox.put(('stop', None))
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.error('engine thread did not stop within %.0f s', timeout_s)

    # ---- the thread -----------------------------------------------------------------------
    def _run(self):
        try:
            while not self._stopping.is_set():
                self._drain_inbox(block=not self.engine.has_work)
                if self.engine.has_work:
                    for out in self.engine.step():
                        self._deliver(out)
        except BaseException as e:          # the engine is unusable: tell every waiter
            logger.exception('engine step failed')
            self.error = e
            for handle in list(self._live.values()):
                handle.sink(e)
            self._live.clear()
        finally:
            for handle in list(self._live.values()):
                if handle.seq is not None and not handle.seq.is_finished:
                    self.engine.abort(handle.seq)
                handle.sink(RuntimeError('the engine was closed'))
            self._live.clear()

    def _drain_inbox(self, block: bool):
        try:
            item = self._inbox.get(timeout=self.idle_wait_s) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, handle = item
            if kind == 'add' and not handle.aborted:
                self._add(handle)
            elif kind == 'abort':
                self._abort(handle)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _add(self, handle: RequestHandle):
        try:
            handle.seq = self.engine.add_request(handle.token_ids, handle.gen_config)
        except ValueError as e:
            handle.sink(e)
            return
        self._live[handle.seq.seq_id] = handle

    def _abort(self, handle: RequestHandle):
        handle.aborted = True
        if handle.seq is None or handle.seq.is_finished:
            return
        self.engine.abort(handle.seq)
        self._deliver(StepOutput(handle.seq, []))

    def _deliver(self, out: StepOutput):
        handle = self._live.get(out.seq.seq_id)
        if handle is None:
            return
        if out.finished:
            del self._live[out.seq.seq_id]
        try:
            handle.sink(out)
        except Exception:
            logger.exception('a request sink failed; aborting that request only')
            if not out.finished:
                self._abort(handle)
