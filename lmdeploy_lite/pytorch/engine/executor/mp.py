"""The `mp` executor: one process per rank (torch.multiprocessing, forked by a fork server that
has imported torch; spawn where there is none), gloo on CPU.

On CUDA (device='cuda', or 'auto' on a machine with CUDA) rank r uses cuda:r (`rank_device`,
made current before anything is built; the front-end first checks that there are dp x tp GPUs)
and its device collectives run on NCCL (DistContext.init).

Every rank runs an Engine for its DP rank and the same loop: read its inbox, `engine.step()`
(whose first act is the StepPlan all-gather over `DistContext.plan_group`), send outputs home.
The ranks of a plan group advance in lockstep; plan groups do not wait for each other:
- ep > 1: the plan group is the world (the MoE all-to-alls join every rank). A rank with no work
  inside a busy step runs dummy target and draft forwards, and polls its inbox without waiting
  while any rank is busy (`engine.plan_busy`), or every busy step would wait for it.
- ep = 1: the plan group is the DP rank's TP group. DP ranks share no collective, so each runs
  as an independent engine: an idle DP rank runs no forward and never holds up a busy one.
A plan group with no work waits on its inbox between plan gathers (at most IDLE_WAIT_S, no
spinning; short, since its TP peers wait for TP rank 0's inbox broadcast within the collective
timeout). A stop reaches every rank through the executor, not through one rank's plan: close()
puts it in every rank's inbox, each DP group's TP rank 0 shares it with its TP peers, and the
plan's shutdown flag ends the group's loop in the same step on every rank of the group. The
front-end routes each request to the DP rank whose prefix cache holds the longest prefix of its
prompt (each rank leader reports the state snapshots it keeps and drops, engine/prefix_cache.py),
unless that rank already has a full batch (max_batch_size) more live requests than the least
loaded one; ties and misses go to the rank with the fewest live requests. Each rank leader
sends one message per step with all of its requests' outputs, which the front-end hands to
their sinks (one post per Channel).

Failures: a rank that dies is detected within a second (the front-end checks every
LIVENESS_CHECK_S, however busy the other ranks are: pure-DP ranks run on without a dead peer);
the loop's `error` becomes one short line naming it and how it ended ('rank 1 (pid 4242) was
killed by signal SIGKILL'), or the first line of the exception a rank raised (a collective
timeout names rank, step and operation); tracebacks go to the log. Every live request's sink
gets that error, the other ranks are ended, and close() returns promptly. Ranks die with the
front-end, however it ends (lifeline.py), and ignore SIGINT (a Ctrl-C reaches the whole process
group; the front-end decides). `worker_hook`: a picklable top-level function called with each
rank's Engine before it serves (tests break engines on purpose with it); production code never
sets it.
"""
from __future__ import annotations

import logging
import os
import queue
import signal
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Callable

import torch.multiprocessing as mp

from lmdeploy_lite.messages import GenerationConfig, PytorchEngineConfig, SpeculativeConfig
from lmdeploy_lite.pytorch.config import DistConfig, ModelConfig
from lmdeploy_lite.pytorch.engine.step_output import StepOutput
from lmdeploy_lite.pytorch.engine.hidden_states import check_request_id
from lmdeploy_lite.pytorch.engine.engine_loop import Sink, check_group, hand_out
from lmdeploy_lite.pytorch.engine.prefix_cache import block_keys, longest_cached
from lmdeploy_lite.pytorch.engine.executor.lifeline import make_lifeline
from lmdeploy_lite.pytorch.engine.executor.rank_worker import (NUM_THREADS_ENV, uses_cuda,
                                                               worker_main)
from lmdeploy_lite.pytorch.engine.executor.rendezvous import FileRendezvous, loopback_env
from lmdeploy_lite.pytorch.engine.heartbeat import Heartbeats

logger = logging.getLogger('lmdeploy_lite')

LIVENESS_CHECK_S = 0.5           # the front-end looks for dead ranks this often
STARTUP_TIMEOUT_S = float(os.environ.get('LMDEPLOY_LITE_STARTUP_TIMEOUT', '600'))


def worker_num_threads(world_size: int, requested: str | None = None) -> int:
    """Torch threads for each rank: `requested` (LMDEPLOY_LITE_NUM_THREADS) if given, else this
    front-end process's torch thread count shared among the ranks, at least 1 (so a front-end
    held to one thread, e.g. by OMP_NUM_THREADS=1 or the test suite, starts one-thread ranks)."""
    import torch
    if not requested:
        return max(1, torch.get_num_threads() // world_size)
    if not requested.strip().isdigit() or int(requested) < 1:
        raise ValueError(f'{NUM_THREADS_ENV}={requested!r}: must be a positive integer '
                         f'(torch threads per rank)')
    return int(requested)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


# modules every rank imports, imported once in multiprocessing's fork server, whose forked
# children start with them (a spawned rank would import them again: seconds of CPU per rank)
FORKSERVER_PRELOAD = ['torch', 'transformers']
START_METHOD_ENV = 'LMDEPLOY_LITE_MP_START_METHOD'      # 'spawn': no fork server


def rank_context():
    """The multiprocessing context ranks start in: a fork server that has imported torch and
    transformers (a fresh process, never one with CUDA state: it is spawned, and forks from its
    main thread), where the platform has one; else spawn."""
    how = os.environ.get(START_METHOD_ENV, 'forkserver')
    if how not in ('forkserver', 'spawn'):
        raise ValueError(f'{START_METHOD_ENV}={how!r}: must be forkserver or spawn')
    if how == 'spawn' or 'forkserver' not in mp.get_all_start_methods():
        return mp.get_context('spawn')
    ctx = mp.get_context('forkserver')
    ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
    return ctx


# ---- the front-end side ---------------------------------------------------------------------
@dataclass(eq=False)
class RemoteSeq:
    """What the front-end knows of a sequence living on a rank (mirrors Sequence's fields)."""
    seq_id: int
    dp_rank: int
    is_finished: bool = False
    finish_reason: str | None = None
    num_generated: int = 0
    error: str | None = None


@dataclass(eq=False)
class RemoteHandle:
    seq: RemoteSeq
    sink: Sink
    tag: object = None


class RemoteEngineLoop:
    """The EngineLoop interface (submit, abort, close, error) over one worker per rank running
    `worker_main`. Subclasses start the ranks (`_start`: sets `_inboxes`, one per rank, and
    `_outbox`; passes `_worker_hook` on), name the dead ones (`_dead_ranks`), wait for them
    (`_join`), end them (`_kill`) and let go of them (`_release`); validation, routing, result
    collection and failure handling are shared."""

    def __init__(self, model_path: str, engine_config: PytorchEngineConfig,
                 speculative_config: SpeculativeConfig | None = None, env: dict | None = None,
                 worker_hook: Callable | None = None):
        cfg = engine_config
        self.dist_config = DistConfig(cfg.tp, cfg.dp, cfg.ep, cfg.sequence_parallel)
        self.model_config = ModelConfig.from_pretrained(model_path)
        self.dist_config.validate(self.model_config, num_devices=None)
        if speculative_config is not None:
            from lmdeploy_lite.pytorch.spec_decode.build import check_speculative_config
            check_speculative_config(speculative_config, model_path, self.dist_config,
                                     cfg.load_format)
        self.session_len = cfg.session_len or self.model_config.max_position_embeddings
        self.error: BaseException | None = None
        self._live: dict[int, RemoteHandle] = {}
        self._busy_since = 0.0                   # when _live last became non-empty
        self._heartbeats: Heartbeats | None = None       # the ranks' (_start sets it)
        self._load = [0] * self.dist_config.dp
        # prefix-cache routing (dp > 1): each DP rank's snapshot keys, from its 'cache' reports;
        # (block_size, lookahead, caching) from the ranks' ready messages
        self._snapshot_keys: list[set[int]] = [set() for _ in range(self.dist_config.dp)]
        self._cached_blocks = [0] * self.dist_config.dp
        self._prefill_tokens = [0] * self.dist_config.dp
        self._prefix_naming = (0, False, False)
        self._max_batch_size = cfg.max_batch_size
        self._next_rid = 0
        self._lock = threading.Lock()
        self._closing = False
        self._worker_hook = worker_hook
        child_env = {k: v for k, v in os.environ.items() if k.startswith('LMDEPLOY_LITE_')}
        child_env.update(env or {})
        child_env[NUM_THREADS_ENV] = str(worker_num_threads(self.dist_config.world_size,
                                                            child_env.get(NUM_THREADS_ENV)))
        try:
            self._start(model_path, cfg, speculative_config, child_env)
            self._wait_ready()
        except BaseException:
            self._kill()
            self._release()
            raise
        self._collector = threading.Thread(target=self._collect, daemon=True,
                                           name='lmdeploy_lite-collector')
        self._collector.start()

    def _start(self, model_path: str, cfg: PytorchEngineConfig,
               spec_config: SpeculativeConfig | None, env: dict):
        raise NotImplementedError

    def _dead_ranks(self) -> dict[int, str]:
        """rank -> how it ended, for every rank that is no longer running (in rank order)."""
        raise NotImplementedError

    def _join(self, timeout_s: float):
        raise NotImplementedError

    def _kill(self):
        raise NotImplementedError

    def _wait_ready(self):
        world = self.dist_config.world_size
        ready, deadline = set(), time.monotonic() + STARTUP_TIMEOUT_S
        while len(ready) < world:
            try:
                kind, rank, payload = self._outbox.get(timeout=0.5)
            except queue.Empty:
                self._check_alive()
                if time.monotonic() > deadline:
                    raise TimeoutError(f'ranks {sorted(set(range(world)) - ready)} '
                                       f'did not start within {STARTUP_TIMEOUT_S:.0f} s')
                continue
            if kind == 'error':
                summary, trace = payload
                logger.error('rank %d failed to start:\n%s', rank, trace)
                raise RuntimeError(f'failed to start: {summary}')
            ready.add(rank)
            self._prefix_naming = payload

    def _check_alive(self):
        for description in self._dead_ranks().values():
            raise RuntimeError(description)

    # ---- requests -------------------------------------------------------------------------
    def validate_request(self, token_ids: list[int], gen_config: GenerationConfig):
        from lmdeploy_lite.pytorch.engine.engine import validate_request
        validate_request(token_ids, gen_config, self.model_config.vocab_size, self.session_len)

    def submit(self, token_ids: list[int], gen_config: GenerationConfig, sink: Sink,
               tag: object = None, request_id: str | None = None) -> RemoteHandle:
        """`request_id`: names the request's hidden-states file (extract_hidden_states); None:
        a random one, made here, unique across DP ranks."""
        return self.submit_group(token_ids, gen_config, sink, [tag], [request_id])[0]

    def submit_group(self, token_ids: list[int], gen_config: GenerationConfig, sink: Sink,
                     tags: list, request_ids: list[str | None] | None = None
                     ) -> list[RemoteHandle]:
        """The n choices of one prompt go to one DP rank (they share its prefill there);
        `request_ids`: each one's (see submit)."""
        if self.error is not None:
            raise RuntimeError(f'the engine stopped after an error: {self.error}')
        request_ids = check_group(gen_config, tags, request_ids)
        self.validate_request(token_ids, gen_config)
        request_ids = [uuid.uuid4().hex if r is None else check_request_id(r)
                       for r in request_ids]
        cached = self._cached_tokens(token_ids)
        with self._lock:
            # the rank that holds the longest cached prefix, unless it is a whole batch busier
            # than the least loaded; ties: the least loaded
            least = min(self._load)
            dp_rank = min(range(len(self._load)), key=lambda r: (
                -cached[r] if self._load[r] - least < self._max_batch_size else 0, self._load[r]))
            self._load[dp_rank] += len(tags)
            rids = list(range(self._next_rid, self._next_rid + len(tags)))
            self._next_rid += len(tags)
            handles = [RemoteHandle(RemoteSeq(rid, dp_rank), sink, tag)
                       for rid, tag in zip(rids, tags)]
            if not self._live:
                self._busy_since = time.monotonic()
            self._live.update(zip(rids, handles))
        self._inboxes[dp_rank * self.dist_config.tp].put(('add', (rids, list(token_ids),
                                                                  gen_config, request_ids)))
        return handles

    def stalled(self, limit_s: float) -> str | None:
        """One line naming the rank that has shown no progress for over `limit_s` while
        requests are pending (heartbeat.py), else None (also where no heartbeat is kept)."""
        if not self._live or self._heartbeats is None:
            return None
        return self._heartbeats.stalled(limit_s, since=self._busy_since,
                                        describe=self._describe_rank)

    def _describe_rank(self, rank: int) -> str:
        """'rank R', with its process's pid and state where this host can see it."""
        return f'rank {rank}'

    def _cached_tokens(self, token_ids: list[int]) -> list[int]:
        """Per DP rank, the prompt tokens its prefix cache holds as far as its reports say."""
        block_size, lookahead, caching = self._prefix_naming
        dp = self.dist_config.dp
        if dp == 1 or not caching:
            return [0] * dp
        keys = block_keys(list(token_ids), block_size, lookahead)
        with self._lock:
            return [longest_cached(keys, held, len(token_ids), block_size)
                    for held in self._snapshot_keys]

    def abort(self, handle: RemoteHandle):
        self._inboxes[handle.seq.dp_rank * self.dist_config.tp].put(('abort', handle.seq.seq_id))

    # ---- results --------------------------------------------------------------------------
    def _collect(self):
        """Hand the ranks' reports to their sinks, and check every LIVENESS_CHECK_S, busy or
        not, that every rank is alive: DP ranks that share no collective (ep = 1) run on
        without a dead peer, so their reports must not hide it."""
        next_check = time.monotonic() + LIVENESS_CHECK_S
        while True:
            try:
                kind, rank, payload = self._outbox.get(
                    timeout=max(0.01, next_check - time.monotonic()))
            except queue.Empty:
                if self._closing:
                    return
                kind = None
            if kind == 'error':
                self._fail(RuntimeError(self._describe_failure(rank, *payload)))
                return
            if kind is not None:
                reports, news = payload
                if news is not None:
                    self._note_snapshots(rank, news)
                if reports:
                    self._deliver(reports)
            if time.monotonic() >= next_check and not self._closing:
                next_check = time.monotonic() + LIVENESS_CHECK_S
                try:
                    self._check_alive()
                except RuntimeError as e:
                    self._fail(e)
                    return

    def prefix_cache_blocks(self) -> int:
        """KV blocks in the DP ranks' prefix caches, as last reported."""
        return sum(self._cached_blocks)

    def prefill_tokens(self) -> int:
        """Tokens the DP ranks fed in prefill rows (Engine.num_prefill_tokens), as last
        reported."""
        return sum(self._prefill_tokens)

    def _note_snapshots(self, rank: int, report: tuple[list[tuple[int, bool]], int, int]):
        dp_rank = rank // self.dist_config.tp
        events, self._cached_blocks[dp_rank], self._prefill_tokens[dp_rank] = report
        held = self._snapshot_keys[dp_rank]
        with self._lock:
            for key, kept in events:
                if kept:
                    held.add(key)
                else:
                    held.discard(key)

    def _deliver(self, reports: list[tuple[int, StepOutput]]):
        """One step's reports of one rank (request id, StepOutput) to their requests' sinks
        (one post per Channel)."""
        pairs = []
        with self._lock:
            for rid, out in reports:
                handle = self._live.get(rid)
                if handle is None:
                    continue
                if out.finished:
                    del self._live[rid]
                    self._load[handle.seq.dp_rank] -= 1
                seq = handle.seq
                seq.is_finished, seq.finish_reason = out.finished, out.finish_reason
                seq.num_generated, seq.error = out.num_generated, out.error
                pairs.append((handle, out))
        for handle in hand_out(pairs):
            if not handle.seq.is_finished:
                self.abort(handle)

    def _describe_failure(self, rank: int, summary: str, trace: str) -> str:
        """A rank's collective fails when a peer dies: then the dead peer is the news, not the
        survivor's error (logged with its traceback). A rank that reported an error of its own
        and then ended (its report is in the outbox before its exit is seen) is no such peer."""
        logger.error('rank %d failed:\n%s', rank, trace)
        reported = {rank}
        deadline = time.monotonic() + 1.0
        while True:
            dead = self._dead_ranks()              # before the drain: their reports are in it
            while True:
                try:
                    kind, other, payload = self._outbox.get(timeout=0)
                except queue.Empty:
                    break
                if kind == 'error' and other not in reported:
                    reported.add(other)
                    logger.error('rank %d failed:\n%s', other, payload[1])
            unexplained = [d for r, d in dead.items() if r not in reported]
            if unexplained:
                return '; '.join(unexplained)
            if time.monotonic() > deadline:
                return summary
            time.sleep(0.05)

    def _fail(self, error: BaseException):
        logger.error('engine stopped: %s', error)
        self.error = error
        with self._lock:
            handles, self._live = list(self._live.values()), {}
        hand_out([(handle, error) for handle in handles])
        self._kill()

    # ---- lifetime -------------------------------------------------------------------------
    def close(self, timeout_s: float = 30.0):
        self._closing = True
        for inbox in self._inboxes:
            inbox.put(('stop', None))
        self._join(timeout_s)
        if threading.current_thread() is not self._collector:
            self._collector.join(5)         # a failing collector may be in _kill: one at a time
        self._kill()
        with self._lock:
            handles, self._live = list(self._live.values()), {}
        closed = RuntimeError('the engine was closed')
        hand_out([(handle, closed) for handle in handles])
        self._release()

    def _release(self):
        """Let go of what ties the workers to this process (after they are gone)."""


class MPEngineLoop(RemoteEngineLoop):
    """One process per rank on this machine (rank_context: forked by a fork server), each
    following this process's life through a lifeline (lifeline.py)."""
    _procs: tuple | list = ()                 # set by _start; empty until then
    _lifeline_writer = None                   # the pipe end whose closing tells workers to end
    _rendezvous = None                        # the ranks' FileRendezvous, until released

    def _start(self, model_path: str, cfg: PytorchEngineConfig,
               spec_config: SpeculativeConfig | None, env: dict):
        import torch
        world = self.dist_config.world_size
        if uses_cuda(cfg.device):           # rank r on cuda:r of this machine
            self.dist_config.validate(self.model_config, num_devices=torch.cuda.device_count())
        ctx = rank_context()
        self._rendezvous = FileRendezvous()        # no network listener on one host
        init_method = self._rendezvous.init_method
        env = {**os.environ, **loopback_env(), **env}       # this process's, as spawn passes
        self._inboxes = [ctx.Queue() for _ in range(world)]
        self._outbox = ctx.Queue()
        lifeline, self._lifeline_writer = make_lifeline(ctx)
        self._heartbeats = Heartbeats(world, ctx)
        self._procs = [ctx.Process(target=worker_main, daemon=True, name=f'lmdeploy_lite-rank{r}',
                                   args=(r, self.dist_config, model_path, cfg, spec_config,
                                         init_method, self._inboxes[r], self._outbox, env, r,
                                         lifeline, self._worker_hook, self._heartbeats,
                                         True))
                       for r in range(world)]
        try:
            for p in self._procs:
                p.start()
        finally:
            lifeline.reader.close()             # the workers hold their own copies

    def _describe_rank(self, rank: int) -> str:
        pid = self._procs[rank].pid
        try:
            with open(f'/proc/{pid}/stat') as f:
                state = f.read().rsplit(')', 1)[1].split()[0]
        except (OSError, IndexError):
            state = None
        return f'rank {rank} (pid {pid}' + (', stopped by a signal)' if state in ('T', 't')
                                             else ')')

    def _dead_ranks(self) -> dict[int, str]:
        return {r: f'rank {r} (pid {p.pid}) {describe_exit(p.exitcode)}'
                for r, p in enumerate(self._procs) if p.pid is not None and not p.is_alive()}

    def _join(self, timeout_s: float):
        deadline = time.monotonic() + timeout_s
        for p in self._procs:
            p.join(max(0.1, deadline - time.monotonic()))

    def _kill(self):
        for p in self._procs:
            if p.is_alive():
                p.terminate()
        for p in self._procs:
            if p.pid is None:                   # never started
                continue
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
        for q in [*getattr(self, '_inboxes', ()), getattr(self, '_outbox', None)]:
            if q is not None:     # a dead reader must not keep this process from exiting
                q.cancel_join_thread()

    def _release(self):
        if self._lifeline_writer is not None:
            self._lifeline_writer.close()
            self._lifeline_writer = None
        if self._rendezvous is not None:
            self._rendezvous.close()
            self._rendezvous = None


def describe_exit(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            return f'was killed by signal {signal.Signals(-exitcode).name}'
        except ValueError:
            return f'was killed by signal {-exitcode}'
    return f'exited with code {exitcode}'
