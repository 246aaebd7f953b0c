"""Several front-end processes over one engine (the server's `--api-workers N`). The process that
holds the engine's client (any EngineClient: thread, mp, ray) runs a `RelayHub`; each front-end
process drives it through a `RelayClient`, an EngineClient of its own, over one duplex pipe:

    worker -> hub:  ('submit', prompts, configs, rids, request_ids), ('abort', rid),
                    ('call', call_id, name, args) (stats, stalled), ('bye',)
    hub -> worker:  ('out', [(rid, item), ...]) once per engine step, ('reply', call_id, value),
                    ('error', message) once the engine has stopped for good

A worker checks a request itself (`checked_groups`, as the engine's client does) and sends it
without waiting for an answer: what the hub can no longer submit (the engine stopped meanwhile)
comes back as that request's error. Request ids (rid) are the worker's own; the hub keeps each
worker's handles by them, and aborts those of a worker that goes away. The hub sends from a
thread per worker, so a worker that reads slowly never holds up the engine's delivery."""
from __future__ import annotations

import logging
import multiprocessing
import queue
import threading

from lmdeploy_lite.messages import GenerationConfig
from lmdeploy_lite.pytorch.config import ModelConfig
from lmdeploy_lite.pytorch.engine.executor.client import (Channel, EngineStats, RequestHandle, Sink,
                                                          checked_groups, hand_out)
from lmdeploy_lite.pytorch.engine.sequence import validate_request

logger = logging.getLogger('lmdeploy_lite')

WATCH_S = 0.25                   # how often the hub looks whether the engine has stopped
CALL_TIMEOUT_S = 10.0            # a worker's wait for stats() or stalled()
CALLS = ('stats', 'stalled')     # what a worker may ask the engine's client


def portable(error: BaseException) -> BaseException:
    """`error` as it can cross a pipe: a built-in exception as it is, any other as RuntimeError."""
    return error if type(error).__module__ == 'builtins' else RuntimeError(
        f'{type(error).__name__}: {error}')


class RelayHub:
    """The engine's side: one `_Worker` per attached front-end process."""

    def __init__(self, client):
        self.client, self._workers = client, []
        self._stop = threading.Event()
        threading.Thread(target=self._watch, daemon=True, name='lmdeploy_lite-relay-watch').start()

    def attach(self):
        """A new worker's end of its pipe (for a RelayClient in that process)."""
        ours, theirs = multiprocessing.Pipe()
        self._workers.append(_Worker(self.client, ours))
        return theirs

    def _watch(self):
        while not self._stop.wait(WATCH_S):
            if self.client.error is not None:
                for worker in self._workers:
                    worker.outgoing.put(('error', str(self.client.error)))
                return

    def close(self):
        self._stop.set()
        for worker in self._workers:
            worker.outgoing.put(None)


class _Worker:
    """One front-end process as the hub sees it: its live handles by rid, a reader and a writer."""

    def __init__(self, client, conn):
        self.client, self.conn = client, conn
        self.handles: dict[int, RequestHandle] = {}
        self.lock = threading.Lock()
        self.outgoing: queue.SimpleQueue = queue.SimpleQueue()
        self.channel = Channel(self._post)
        for target in (self._read, self._write):
            threading.Thread(target=target, daemon=True, name='lmdeploy_lite-relay').start()

    def _post(self, items: list):                 # the engine's delivery, once per step
        failed = False
        with self.lock:
            for rid, item in items:
                failed |= isinstance(item, BaseException)
                if isinstance(item, BaseException) or item.finished:
                    self.handles.pop(rid, None)
        if failed and self.client.error is not None:   # the engine stopped: said first, so the
            self.outgoing.put(('error', str(self.client.error)))  # worker's 503s name it
        self.outgoing.put(('out', [(rid, portable(item) if isinstance(item, BaseException)
                                    else item) for rid, item in items]))

    def _write(self):
        while (message := self.outgoing.get()) is not None:
            try:
                self.conn.send(message)
            except (OSError, ValueError):          # the worker has gone: _read ends too
                return

    def _read(self):
        try:
            while (message := self.conn.recv())[0] != 'bye':
                getattr(self, '_on_' + message[0])(*message[1:])
        except (EOFError, OSError):
            pass
        finally:                                   # its requests end with it
            self.outgoing.put(None)
            with self.lock:
                handles, self.handles = list(self.handles.values()), {}
            for handle in handles:
                if not handle.finished:
                    self.client.abort(handle)
            self.conn.close()

    def _on_submit(self, prompts, configs, rids, request_ids):
        try:
            groups = self.client.submit_groups(prompts, configs, self.channel, rids, request_ids)
        except Exception as e:                     # stopped or closing since the worker looked
            self.outgoing.put(('out', [(rid, portable(e)) for group in rids for rid in group]))
            return
        with self.lock:                            # not one that finished already (_post)
            self.handles.update((h.tag, h) for group in groups for h in group if not h.finished)

    def _on_abort(self, rid: int):
        with self.lock:
            handle = self.handles.pop(rid, None)
        if handle is not None and not handle.finished:
            self.client.abort(handle)

    def _on_call(self, call_id: int, name: str, args: tuple):
        try:
            if name not in CALLS:
                raise ValueError(f'{name}: not one of {CALLS}')
            value = getattr(self.client, name)(*args)
        except Exception as e:
            value = portable(e)
        self.outgoing.put(('reply', call_id, value))


class RelayClient:
    """`EngineClient` of a front-end worker: the hub's client does the work, in its process."""

    def __init__(self, conn, model_config: ModelConfig, session_len: int):
        self.model_config, self.session_len = model_config, session_len
        self.error: BaseException | None = None
        self._conn, self._send_lock, self._lock = conn, threading.Lock(), threading.Lock()
        self._live: dict[int, RequestHandle] = {}
        self._calls: dict[int, list] = {}          # call id -> [threading.Event, answer]
        self._next_rid = self._next_call = 0
        self._closing = False
        threading.Thread(target=self._read, daemon=True, name='lmdeploy_lite-relay').start()

    def validate_request(self, token_ids: list[int], gen_config: GenerationConfig):
        validate_request(token_ids, gen_config, self.model_config.vocab_size, self.session_len)

    def submit_group(self, token_ids: list[int], gen_config: GenerationConfig, sink: Sink,
                     tags: list, request_ids: list[str | None] | None = None
                     ) -> list[RequestHandle]:
        return self.submit_groups([token_ids], gen_config, sink, [tags],
                                  None if request_ids is None else [request_ids])[0]

    def submit_groups(self, prompts: list[list[int]], gen_config, sink: Sink, tags: list[list],
                      request_ids: list[list[str | None]] | None = None
                      ) -> list[list[RequestHandle]]:
        """As RankClient's: all checked before any is sent (ValueError touches nothing)."""
        configs, request_ids = checked_groups(self, prompts, gen_config, tags, request_ids)
        with self._lock:
            groups = []
            for choice_tags in tags:
                first, self._next_rid = self._next_rid, self._next_rid + len(choice_tags)
                groups.append([RequestHandle(first + i, -1, sink, tag)
                               for i, tag in enumerate(choice_tags)])
            self._live.update((h.rid, h) for group in groups for h in group)
        self._send(('submit', [list(p) for p in prompts], configs,
                    [[h.rid for h in group] for group in groups], request_ids))
        return groups

    def abort(self, handle: RequestHandle):
        if not handle.finished and not self._closing:
            self._send(('abort', handle.rid))

    def stats(self) -> EngineStats:
        return self._call('stats')

    def stalled(self, limit_s: float) -> str | None:
        return self._call('stalled', limit_s)

    def close(self, timeout_s: float = 30.0):
        """Ends this worker's requests (RuntimeError) and its pipe; the engine runs on."""
        if not self._closing:
            self._closing = True               # first: the hub's answer to 'bye' is an EOF
            self._send(('bye',))
            self._end(RuntimeError('the engine was closed'))

    def _send(self, message: tuple):
        try:
            with self._send_lock:
                self._conn.send(message)
        except (OSError, ValueError) as e:
            if message[0] in ('submit', 'call'):
                raise RuntimeError(f"the engine's process cannot be reached: {e}") from e

    def _call(self, name: str, *args):
        slot = [threading.Event(), None]
        with self._lock:
            call_id, self._next_call = self._next_call, self._next_call + 1
            self._calls[call_id] = slot
        self._send(('call', call_id, name, args))
        if not slot[0].wait(CALL_TIMEOUT_S):
            self._calls.pop(call_id, None)
            raise RuntimeError(f"{name}: the engine's process gave no answer in "
                               f'{CALL_TIMEOUT_S:.0f} s')
        if isinstance(slot[1], BaseException):
            raise slot[1]
        return slot[1]

    def _read(self):
        try:
            while True:
                kind, *rest = self._conn.recv()
                if kind == 'out':
                    self._deliver(rest[0])
                elif kind == 'reply':
                    self._answer(*rest)
                else:                              # 'error': the engine has stopped
                    self.error = self.error or RuntimeError(rest[0])
                    self._end(self.error)
        except (EOFError, OSError):
            if not self._closing:
                self.error = self.error or RuntimeError("the engine's process went away")
                self._end(self.error)

    def _deliver(self, items: list):
        pairs = []
        with self._lock:
            for rid, item in items:
                handle = self._live.get(rid)
                if handle is None:
                    continue
                if isinstance(item, BaseException) or item.finished:
                    del self._live[rid]
                    handle.finished = not isinstance(item, BaseException)
                pairs.append((handle, item))
        for handle in hand_out(pairs):
            self.abort(handle)

    def _answer(self, call_id: int, value):
        slot = self._calls.pop(call_id, None)
        if slot is not None:
            slot[1] = value
            slot[0].set()

    def _end(self, error: BaseException):
        """Every live request and pending call ends with `error`."""
        with self._lock:
            handles, self._live = list(self._live.values()), {}
            calls, self._calls = list(self._calls.values()), {}
        hand_out([(handle, error) for handle in handles])
        for slot in calls:
            slot[1] = error
            slot[0].set()
