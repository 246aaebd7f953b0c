"""The in-thread executor: one Engine in this process, run by `rank_loop` in a background thread
whose reports go straight to the sinks. A request's own failure ends that request alone
('error'); a failed step ends the engine: `error` is that exception, for every live request and
every later submit."""
from __future__ import annotations

import logging
import queue
import threading

from lmdeploy_lite.pytorch.engine.executor.client import RankClient
from lmdeploy_lite.pytorch.engine.executor.rank_worker import rank_loop
from lmdeploy_lite.pytorch.engine.heartbeat import Heartbeats

logger = logging.getLogger('lmdeploy_lite')


class EngineLoop(RankClient):
    """`engine`: for tests and benchmarks that look inside; nothing else touches it."""

    def __init__(self, engine):
        self.engine = engine
        super().__init__(None, engine.engine_config)

    def _configure(self, model_path, engine_config, speculative_config):
        self.model_config, self.session_len = self.engine.model_config, self.engine.session_len

    def _start(self, model_path, cfg, spec_config, env):
        self._inboxes = [queue.Queue()]
        self._heartbeats = Heartbeats(1)
        self._thread = threading.Thread(target=self._run, name='lmdeploy_lite-engine', daemon=True)
        self._thread.start()

    def _wait_ready(self):
        bm = self.engine.scheduler.bm
        self._prefix_naming = (bm.block_size, bm.lookahead, bm.caching)

    def _run(self):
        try:
            rank_loop(0, self.engine, self._inboxes[0], lambda report: self._on_report(*report),
                      self._heartbeats.beater(0))
        except BaseException as e:          # the engine is unusable: tell every waiter
            logger.exception('engine step failed; the engine stops')
            self._fail(e)

    def _describe_rank(self, rank: int) -> str:
        return 'the engine thread'

    def _dead_ranks(self) -> dict[int, str]:
        return {}

    def _join(self, timeout_s: float):
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.error('engine thread did not stop within %.0f s', timeout_s)

    def _kill(self):
        """Free the caches of requests still running (the thread has ended)."""
        if not self._thread.is_alive():
            for seq in [*self.engine.scheduler.running, *self.engine.scheduler.waiting]:
                self.engine.abort(seq)

    def _release(self):
        """The engine is the caller's again, usable in its own thread (tests, benchmarks)."""
        if not self._thread.is_alive() and self.error is None:
            self.engine.stop_requested = self.engine.stopped = False
