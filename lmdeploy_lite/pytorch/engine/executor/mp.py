"""The `mp` executor: one process per rank (torch.multiprocessing, forked by a fork server that
has imported torch; spawn where there is none), gloo on CPU; on CUDA rank r uses cuda:r
(`rank_device`; the front-end first checks that there are dp x tp GPUs) and NCCL.

Every rank runs `rank_loop` (rank_worker.py); the ranks of a plan group advance in lockstep, and
close() ends each group in one step (the plan's shutdown flag). A dead rank is found within
LIVENESS_CHECK_S; `error` is then one line naming it and how it ended ('rank 1 (pid 4242) was
killed by signal SIGKILL') or the first line of what it raised (tracebacks go to the log), every
live request gets it and the other ranks are ended. Ranks die with the front-end (lifeline.py)
and ignore SIGINT (Ctrl-C reaches the whole process group). `worker_hook`: a picklable top-level
function called with each rank's Engine before it serves (tests break engines with it).

The ranks meet without a network listener: torch.distributed's store is a file (FileStore) in a
private temporary directory, not a TCP store (which listens on every interface, unauthenticated),
and the collectives' own TCP links (gloo's pairs, the bootstrap of NCCL and NVSHMEM) are pinned to
the loopback interface unless the user named one. (ray.py, multi-node, keeps TCP.)"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import tempfile
import time

import torch
import torch.multiprocessing as mp

from lmdeploy_lite.messages import PytorchEngineConfig, SpeculativeConfig
from lmdeploy_lite.pytorch.engine.executor.client import RankClient
from lmdeploy_lite.pytorch.engine.executor.lifeline import make_lifeline
from lmdeploy_lite.pytorch.engine.executor.rank_worker import (NUM_THREADS_ENV, uses_cuda,
                                                               worker_main)
from lmdeploy_lite.pytorch.engine.heartbeat import Heartbeats


def worker_num_threads(world_size: int, requested: str | None = None) -> int:
    """Torch threads per rank: `requested` (LMDEPLOY_LITE_NUM_THREADS), else this process's
    thread count shared among the ranks, at least 1."""
    if not requested:
        return max(1, torch.get_num_threads() // world_size)
    if not requested.strip().isdigit() or int(requested) < 1:
        raise ValueError(f'{NUM_THREADS_ENV}={requested!r}: must be a positive integer '
                         f'(torch threads per rank)')
    return int(requested)


SOCKET_IFNAME_VARS = ('GLOO_SOCKET_IFNAME', 'NCCL_SOCKET_IFNAME',
                      'NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME')


def loopback_env() -> dict[str, str]:
    """The loopback interface ('lo' on Linux, 'lo0' on macOS) for each socket-interface variable
    the user has not set."""
    names = [name for _, name in socket.if_nameindex()]
    lo = next((n for n in ('lo', 'lo0') if n in names), None)
    return {name: lo for name in SOCKET_IFNAME_VARS if lo and name not in os.environ}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


# modules every rank imports, imported once in multiprocessing's fork server, whose forked
# children start with them (a spawned rank would import them again: seconds of CPU per rank)
FORKSERVER_PRELOAD = ['torch', 'transformers']
START_METHOD_ENV = 'LMDEPLOY_LITE_MP_START_METHOD'      # 'spawn': no fork server


def rank_context():
    """A fork server (spawned, so never with CUDA state; forks from its main thread) that has
    imported FORKSERVER_PRELOAD, where the platform has one; else spawn."""
    how = os.environ.get(START_METHOD_ENV, 'forkserver')
    if how not in ('forkserver', 'spawn'):
        raise ValueError(f'{START_METHOD_ENV}={how!r}: must be forkserver or spawn')
    if how == 'spawn' or 'forkserver' not in mp.get_all_start_methods():
        return mp.get_context('spawn')
    ctx = mp.get_context('forkserver')
    ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
    return ctx


def rank_env(env: dict | None, world_size: int) -> dict:
    """What every rank adds to its environment: this process's LMDEPLOY_LITE_*, `env`, threads."""
    child_env = {k: v for k, v in os.environ.items() if k.startswith('LMDEPLOY_LITE_')}
    child_env.update(env or {})
    child_env[NUM_THREADS_ENV] = str(worker_num_threads(world_size, child_env.get(NUM_THREADS_ENV)))
    return child_env


class MPEngineLoop(RankClient):
    _procs: tuple | list = ()                 # set by _start; empty until then
    _lifeline_writer = None                   # the pipe end whose closing tells workers to end
    _rendezvous_dir = None                    # the ranks' FileStore's, until released

    def _start(self, model_path: str, cfg: PytorchEngineConfig,
               spec_config: SpeculativeConfig | None, env: dict):
        world = self.dist_config.world_size
        if uses_cuda(cfg.device):           # rank r on cuda:r of this machine
            self.dist_config.validate(self.model_config, num_devices=torch.cuda.device_count())
        ctx = rank_context()
        self._rendezvous_dir = tempfile.mkdtemp(prefix='lmdeploy_lite_rendezvous_')    # 0700
        init_method = 'file://' + os.path.join(self._rendezvous_dir, 'store')
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
        if self._rendezvous_dir is not None:
            shutil.rmtree(self._rendezvous_dir, ignore_errors=True)
            self._rendezvous_dir = None


def describe_exit(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            return f'was killed by signal {signal.Signals(-exitcode).name}'
        except ValueError:
            return f'was killed by signal {-exitcode}'
    return f'exited with code {exitcode}'
