"""The `mp` executor: one process per rank (torch.multiprocessing, forked by a fork server that
has imported torch; spawn where there is none), gloo on CPU.

On CUDA (device='cuda', or 'auto' on a machine with CUDA) rank r uses cuda:r (`rank_device`,
made current before anything is built; the front-end first checks that there are dp x tp GPUs)
and its device collectives run on NCCL (DistContext.init).

Every rank runs an Engine for its DP rank and the same loop: read its inbox, `engine.step()`
(whose first act is the StepPlan all-gather over `DistContext.plan`), send outputs home.
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
import signal
import socket
import time

import torch.multiprocessing as mp

from lmdeploy_lite.messages import PytorchEngineConfig, SpeculativeConfig
from lmdeploy_lite.pytorch.engine.executor.client import RankClient
from lmdeploy_lite.pytorch.engine.executor.lifeline import make_lifeline
from lmdeploy_lite.pytorch.engine.executor.rank_worker import (NUM_THREADS_ENV, uses_cuda,
                                                               worker_main)
from lmdeploy_lite.pytorch.engine.executor.rendezvous import FileRendezvous, loopback_env
from lmdeploy_lite.pytorch.engine.heartbeat import Heartbeats

logger = logging.getLogger('lmdeploy_lite')



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


def rank_env(env: dict | None, world_size: int) -> dict:
    """What every rank adds to its environment: this process's LMDEPLOY_LITE_* variables, `env`
    and its torch thread count (`worker_num_threads`)."""
    child_env = {k: v for k, v in os.environ.items() if k.startswith('LMDEPLOY_LITE_')}
    child_env.update(env or {})
    child_env[NUM_THREADS_ENV] = str(worker_num_threads(world_size,
                                                        child_env.get(NUM_THREADS_ENV)))
    return child_env


class MPEngineLoop(RankClient):
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
        env = {**os.environ, **loopback_env(), **rank_env(env, world)}   # as spawn passes
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
