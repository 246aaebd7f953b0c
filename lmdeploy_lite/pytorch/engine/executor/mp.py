"""The `mp` executor: one process per rank (torch.multiprocessing, spawn), gloo on CPU.

On CUDA (device='cuda', or 'auto' on a machine with CUDA) rank r uses cuda:r (`rank_device`,
made current before anything is built; the front-end first checks that there are dp x tp GPUs)
and its device collectives run on NCCL (DistContext.init).

Every rank runs an Engine for its DP rank and the same loop: read its inbox, `engine.step()`
(whose first act is the StepPlan all-gather, so ranks advance in lockstep), send outputs home.
Ranks with no work wait on their inbox between plan gathers (at most IDLE_WAIT_S, no spinning);
an idle rank inside a busy step runs dummy target and draft forwards. The front-end routes each
request to the least-loaded DP rank and forwards results to the caller's sink. A rank that
dies is detected within a second and reported by rank; close() leaves no process behind.
"""
from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
import traceback
from dataclasses import dataclass, field

import torch.multiprocessing as mp

from lmdeploy_lite.messages import GenerationConfig, PytorchEngineConfig, SpeculativeConfig
from lmdeploy_lite.messages import SpecDecodeStats
from lmdeploy_lite.pytorch.config import DistConfig, ModelConfig

logger = logging.getLogger('lmdeploy_lite')

IDLE_WAIT_S = 0.02
STARTUP_TIMEOUT_S = float(os.environ.get('LMDEPLOY_LITE_STARTUP_TIMEOUT', '600'))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


# ---- the worker side ------------------------------------------------------------------------
def uses_cuda(device: str) -> bool:
    import torch
    return device == 'cuda' or (device == 'auto' and torch.cuda.is_available())


def rank_device(device: str, local_rank: int):
    """This rank's CUDA device, `cuda:{local_rank}`, made current (so that every later 'cuda'
    tensor, the KV cache and the NCCL communicators land on it); None on CPU."""
    import torch
    if not uses_cuda(device):
        return None
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise ValueError(f'device={device!r}: this rank needs cuda:{local_rank}, but the process '
                         f'sees {count} GPU(s) (CUDA_VISIBLE_DEVICES='
                         f'{os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>")})')
    torch.cuda.set_device(local_rank)
    return torch.device('cuda', local_rank)


def worker_main(rank: int, dist_config: DistConfig, model_path: str,
                engine_config: PytorchEngineConfig, spec_config: SpeculativeConfig | None,
                init_method: str, inbox, outbox, env: dict, local_rank: int):
    """One rank; `local_rank`: its GPU among the ones this process sees (CUDA only)."""
    os.environ.update(env)
    import torch

    from lmdeploy_lite.pytorch.distributed import DistContext
    from lmdeploy_lite.pytorch.engine.engine import Engine
    from lmdeploy_lite.pytorch.nn.token_dispatcher import dispatch_capacity
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist_config.world_size))
    dist_ctx = None
    try:
        device = rank_device(engine_config.device, local_rank)
        dist_ctx = DistContext.init(dist_config, rank, init_method, device)
        dist_ctx.max_tokens_per_rank = dispatch_capacity(
            engine_config.max_batch_size, spec_config.num_speculative_tokens if spec_config else 0)
        from lmdeploy_lite.api import load_tokenizer       # stop words need it
        tokenizer = load_tokenizer(model_path)
        engine = Engine(model_path, engine_config, spec_config, tokenizer=tokenizer,
                        progress=False, dist_ctx=dist_ctx)
        hook = os.environ.get('LMDEPLOY_LITE_WORKER_HOOK')     # tests: 'module:function'
        if hook:
            import importlib
            module, name = hook.split(':')
            getattr(importlib.import_module(module), name)(engine)
        outbox.put(('ready', rank, None))
        _rank_loop(rank, engine, inbox, outbox)
    except BaseException:
        outbox.put(('error', rank, traceback.format_exc()))
    finally:
        if dist_ctx is not None:
            dist_ctx.destroy()


def _rank_loop(rank: int, engine, inbox, outbox):
    """TP rank 0 of a DP group reads the inbox and shares what it read with its TP peers, so
    every TP rank's scheduler makes the same decisions; only TP rank 0 reports results."""
    request_of: dict[int, int] = {}          # seq_id -> front-end request id
    seq_of: dict[int, object] = {}           # request id -> Sequence
    leader = engine.dist.tp_rank == 0
    while not engine.stopped:
        # wait on the inbox only when no rank had work last step: an idle rank inside a busy
        # world must reach the next plan gather at once, or every busy step waits for it
        wait = None if engine.has_work or engine.world_busy else IDLE_WAIT_S
        events = _drain(inbox, wait) if leader else None
        for kind, payload in engine.dist.broadcast_object(events, 'tp'):
            if kind == 'add':
                rid, token_ids, gen_config = payload
                seq = engine.add_request(token_ids, gen_config)
                request_of[seq.seq_id], seq_of[rid] = rid, seq
            elif kind == 'abort' and payload in seq_of:
                seq = seq_of[payload]
                if not seq.is_finished:
                    engine.abort(seq)
                    if leader:
                        outbox.put(('out', rank, _report(payload, seq, [])))
            elif kind == 'stop':
                engine.stop_requested = True
        for out in engine.step():
            rid = request_of[out.seq.seq_id]
            if leader:
                outbox.put(('out', rank, _report(rid, out.seq, out.new_token_ids)))
            if out.finished:
                del request_of[out.seq.seq_id], seq_of[rid]


def _drain(inbox, wait: float | None) -> list:
    items = []
    try:
        items.append(inbox.get(timeout=wait) if wait else inbox.get_nowait())
        while True:
            items.append(inbox.get_nowait())
    except queue.Empty:
        pass
    return items


def _report(rid: int, seq, new_token_ids: list[int]) -> tuple:
    stats = seq.spec_stats
    return (rid, list(new_token_ids), seq.is_finished, seq.finish_reason, seq.num_generated,
            (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens,
             list(stats.accepted_per_position)))


# ---- the front-end side ---------------------------------------------------------------------
@dataclass(eq=False)
class RemoteSeq:
    """What the front-end knows of a sequence living on a rank (mirrors Sequence's fields)."""
    seq_id: int
    dp_rank: int
    is_finished: bool = False
    finish_reason: str | None = None
    num_generated: int = 0
    spec_stats: SpecDecodeStats = field(default_factory=SpecDecodeStats)


@dataclass
class RemoteOutput:
    """StepOutput's fields, as one report carried them (the RemoteSeq moves on with the next)."""
    seq: RemoteSeq
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    num_generated: int
    spec_stats: SpecDecodeStats | None


@dataclass(eq=False)
class RemoteHandle:
    seq: RemoteSeq
    sink: object


class RemoteEngineLoop:
    """The EngineLoop interface (submit, abort, close, error) over one worker per rank running
    `worker_main`. Subclasses start the ranks (`_start`: sets `_inboxes`, one per rank, and
    `_outbox`), name the dead ones (`_dead_ranks`), wait for them (`_join`) and end them (`_kill`);
    validation, routing, result collection and failure handling are shared."""

    def __init__(self, model_path: str, engine_config: PytorchEngineConfig,
                 speculative_config: SpeculativeConfig | None = None, env: dict | None = None):
        cfg = engine_config
        self.dist_config = DistConfig(cfg.tp, cfg.dp, cfg.ep)
        self.model_config = ModelConfig.from_pretrained(model_path)
        self.dist_config.validate(self.model_config, num_devices=None)
        if speculative_config is not None:
            from lmdeploy_lite.pytorch.spec_decode.build import check_speculative_config
            check_speculative_config(speculative_config, model_path, self.dist_config.tp,
                                     cfg.load_format)
        self.session_len = cfg.session_len or self.model_config.max_position_embeddings
        self.error: BaseException | None = None
        self._live: dict[int, RemoteHandle] = {}
        self._load = [0] * self.dist_config.dp
        self._next_rid = 0
        self._lock = threading.Lock()
        self._closing = False
        child_env = {k: v for k, v in os.environ.items() if k.startswith('LMDEPLOY_LITE_')}
        child_env.update(env or {})
        try:
            self._start(model_path, cfg, speculative_config, child_env)
            self._wait_ready()
        except BaseException:
            self._kill()
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
                raise RuntimeError(f'rank {rank} failed to start:\n{payload}')
            ready.add(rank)

    def _check_alive(self):
        for description in self._dead_ranks().values():
            raise RuntimeError(description)

    # ---- requests -------------------------------------------------------------------------
    def validate_request(self, token_ids: list[int], gen_config: GenerationConfig):
        from lmdeploy_lite.pytorch.engine.engine import validate_request
        validate_request(token_ids, gen_config, self.model_config.vocab_size, self.session_len)

    def submit(self, token_ids: list[int], gen_config: GenerationConfig, sink) -> RemoteHandle:
        if self.error is not None:
            raise RuntimeError(f'the engine stopped after an error: {self.error}')
        self.validate_request(token_ids, gen_config)
        with self._lock:
            dp_rank = min(range(len(self._load)), key=self._load.__getitem__)   # least loaded
            self._load[dp_rank] += 1
            rid, self._next_rid = self._next_rid, self._next_rid + 1
            handle = RemoteHandle(RemoteSeq(rid, dp_rank), sink)
            self._live[rid] = handle
        self._inboxes[dp_rank * self.dist_config.tp].put(('add', (rid, list(token_ids),
                                                                  gen_config)))
        return handle

    def abort(self, handle: RemoteHandle):
        self._inboxes[handle.seq.dp_rank * self.dist_config.tp].put(('abort', handle.seq.seq_id))

    # ---- results --------------------------------------------------------------------------
    def _collect(self):
        while True:
            try:
                kind, rank, payload = self._outbox.get(timeout=0.5)
            except queue.Empty:
                if self._closing:
                    return
                try:
                    self._check_alive()
                except RuntimeError as e:
                    self._fail(e)
                    return
                continue
            if kind == 'error':
                self._fail(RuntimeError(self._describe_failure(rank, payload)))
                return
            self._deliver(*payload)

    def _deliver(self, rid, new_ids, finished, reason, num_generated, stats):
        with self._lock:
            handle = self._live.get(rid)
            if handle is None:
                return
            if finished:
                del self._live[rid]
                self._load[handle.seq.dp_rank] -= 1
        seq = handle.seq
        seq.is_finished, seq.finish_reason, seq.num_generated = finished, reason, num_generated
        seq.spec_stats = SpecDecodeStats(stats[0], stats[1], stats[2], list(stats[3]))
        snapshot = SpecDecodeStats(stats[0], stats[1], stats[2], list(stats[3]))
        handle.sink(RemoteOutput(seq, new_ids, finished, reason, num_generated,
                                 snapshot if snapshot.num_drafts else None))

    def _describe_failure(self, rank: int, trace: str) -> str:
        """A rank's collective fails when a peer dies: name the dead rank first."""
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            dead = [d for r, d in self._dead_ranks().items() if r != rank]
            if dead:
                return f'{", ".join(dead)}; rank {rank} then failed:\n{trace}'
            time.sleep(0.1)
        return f'rank {rank} failed:\n{trace}'

    def _fail(self, error: BaseException):
        logger.error('%s', error)
        self.error = error
        with self._lock:
            handles, self._live = list(self._live.values()), {}
        for handle in handles:
            handle.sink(error)
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
        for handle in handles:
            handle.sink(RuntimeError('the engine was closed'))


class MPEngineLoop(RemoteEngineLoop):
    """One process per rank on this machine (torch.multiprocessing, spawn)."""
    _procs: tuple | list = ()                 # set by _start; empty until then

    def _start(self, model_path: str, cfg: PytorchEngineConfig,
               spec_config: SpeculativeConfig | None, env: dict):
        import torch
        world = self.dist_config.world_size
        if uses_cuda(cfg.device):           # rank r on cuda:r of this machine
            self.dist_config.validate(self.model_config, num_devices=torch.cuda.device_count())
        ctx = mp.get_context('spawn')
        init_method = f'tcp://127.0.0.1:{free_port()}'
        self._inboxes = [ctx.Queue() for _ in range(world)]
        self._outbox = ctx.Queue()
        self._procs = [ctx.Process(target=worker_main, daemon=True, name=f'lmdeploy_lite-rank{r}',
                                   args=(r, self.dist_config, model_path, cfg, spec_config,
                                         init_method, self._inboxes[r], self._outbox, env, r))
                       for r in range(world)]
        for p in self._procs:
            p.start()

    def _dead_ranks(self) -> dict[int, str]:
        return {r: f'rank {r} (pid {p.pid}) exited with code {p.exitcode}'
                for r, p in enumerate(self._procs) if not p.is_alive()}

    def _join(self, timeout_s: float):
        deadline = time.monotonic() + timeout_s
        for p in self._procs:
            p.join(max(0.1, deadline - time.monotonic()))

    def _kill(self):
        for p in self._procs:
            if p.is_alive():
                p.terminate()
        for p in self._procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
