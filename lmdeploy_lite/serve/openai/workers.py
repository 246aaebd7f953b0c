"""`serve api_server --api-workers N`: N front-end processes (each the whole app: checks,
tokenization, detokenization, streaming) on one listening socket, over the one engine this
process holds (executor/relay.py). One front-end process streams ~25k chunks a second on a GPU
host's core and falls behind past ~15k (BENCHMARKS.md, "One front-end process's ceiling"); the
engine's side costs this process ~a pickled message per worker and step.

The workers get the terminal's Ctrl-C through this process only (their own process group): SIGINT
or SIGTERM here stops each with SIGTERM, the single server's graceful shutdown, then the engine.
A worker that dies stops the others; an engine that dies ends every worker (exit 1)."""
from __future__ import annotations

import dataclasses
import logging
import math
import multiprocessing
import multiprocessing.connection
import os
import socket
import sys
import tempfile
import time

from lmdeploy_lite.messages import PytorchEngineConfig
from lmdeploy_lite.pytorch.config import ModelConfig
from lmdeploy_lite.pytorch.engine.executor.relay import RelayClient, RelayHub
from lmdeploy_lite.serve.openai.checks import ServerLimits
from lmdeploy_lite.serve.openai.connections import bind_socket

logger = logging.getLogger('lmdeploy_lite.serve')

POLL_S = 0.5                          # how often this process looks at the workers and the engine


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    """What a worker builds its Pipeline and server from (pickled into it)."""
    model_path: str
    engine_config: PytorchEngineConfig
    model_config: ModelConfig
    session_len: int
    model_name: str
    reasoning_parser: str | None
    chat_template: str | None
    serve_options: dict                # api_server.serve's keyword arguments


def serve_workers(pipe, workers: int, sock, spec: WorkerSpec, graceful_timeout_s: float) -> int:
    """Serve through `workers` processes until SIGINT/SIGTERM (KeyboardInterrupt here, as
    `cmd_serve` turns SIGTERM into it), a worker's death or the engine's. Exit codes as `serve`'s:
    0 after a signal, 1 when the engine or a worker died, 3 when a worker could not start."""
    hub = RelayHub(pipe.engine_client)
    context = multiprocessing.get_context('spawn')
    procs = [context.Process(target=worker_main, args=(hub.attach(), sock, spec),
                             name=f'lmdeploy_lite-api-{i}') for i in range(workers)]
    code, metrics_dir = 0, tempfile.TemporaryDirectory(prefix='lmdeploy_lite_metrics_')
    try:
        _start(procs, metrics_dir.name)
        host, port = sock.getsockname()[:2]
        print(f'lmdeploy_lite: serving {spec.model_name!r} on http://{host}:{port} '
              f'({workers} front-end processes)', flush=True)
        code = _supervise(pipe, procs)
    except KeyboardInterrupt:
        code = 0
    finally:
        _stop(procs, graceful_timeout_s + 10)
        hub.close()
        pipe.close()
        metrics_dir.cleanup()
    return code


def _start(procs: list, metrics_dir: str):
    """Started with PROMETHEUS_MULTIPROC_DIR (metrics.py: /metrics sums every worker's)."""
    previous = os.environ.get('PROMETHEUS_MULTIPROC_DIR')
    os.environ['PROMETHEUS_MULTIPROC_DIR'] = metrics_dir
    try:
        for proc in procs:
            proc.start()
    finally:
        if previous is None:
            del os.environ['PROMETHEUS_MULTIPROC_DIR']
        else:
            os.environ['PROMETHEUS_MULTIPROC_DIR'] = previous


def _supervise(pipe, procs: list) -> int:
    """Until a worker ends: its code (1 where it died of a signal); the engine's death ends them."""
    while True:
        ended = multiprocessing.connection.wait([p.sentinel for p in procs], timeout=POLL_S)
        if ended:
            proc = next(p for p in procs if p.sentinel in ended)
            proc.join()
            code = proc.exitcode
            if pipe.error is not None:
                return 1
            logger.error('front-end process %s ended (exit code %s); stopping the server',
                         proc.name, code)
            return code if code in (1, 3) else 1


def _stop(procs: list, timeout_s: float):
    """SIGTERM to each live worker (its graceful shutdown), SIGKILL after `timeout_s`."""
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        if proc.pid is not None:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join()


def worker_limits(limits: ServerLimits, capacity: int, workers: int) -> ServerLimits:
    """Each worker's share of the concurrency limit (sized from the engine's capacity when not
    given): the total split evenly, rounded up."""
    total = limits.sized_for(capacity).max_concurrent
    return dataclasses.replace(limits, max_concurrent=math.ceil(total / workers), workers=workers)


def own_socket(sock: socket.socket) -> socket.socket:
    """This worker's listening socket. Where the parent's socket has SO_REUSEPORT (Linux; the
    CLI binds it so), a socket of the worker's own on the same address: the kernel spreads new
    connections evenly over the workers' sockets. Else the parent's, shared: whichever worker's
    event loop wakes first accepts a whole burst of connections (up to uvicorn's backlog)."""
    if not (hasattr(socket, 'SO_REUSEPORT')
            and sock.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT)):
        return sock
    own = bind_socket(*sock.getsockname()[:2], reuse_port=True)
    sock.close()
    return own


def worker_main(conn, sock, spec: WorkerSpec):
    """A worker process: the Pipeline over a RelayClient, the app, uvicorn on its own socket."""
    os.setpgrp()                       # the terminal's Ctrl-C reaches the parent only
    sock = own_socket(sock)
    from lmdeploy_lite.api import Pipeline
    from lmdeploy_lite.serve.openai.api_server import serve
    client = RelayClient(conn, spec.model_config, spec.session_len)
    pipe = Pipeline(spec.model_path, spec.engine_config, progress=False,
                    reasoning_parser=spec.reasoning_parser, chat_template=spec.chat_template,
                    num_threads=1, engine_client=client)
    sys.exit(serve(pipe, spec.model_name, sock=sock, announce=False, **spec.serve_options))
