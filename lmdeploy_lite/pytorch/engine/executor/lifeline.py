"""A rank process ends when the process that started it ends, however (SIGKILL included). Armed
first thing in the worker:
- Linux: prctl(PR_SET_PDEATHSIG, SIGKILL), then a check that the parent still lives. The kernel
  signals when the *thread* that started the worker exits, so it is armed only for workers
  started from the parent's main thread; a fork server's children (mp's) always: it forks from
  its main thread and exits with the front-end.
- Everywhere: a watchdog thread ends the worker within WATCH_INTERVAL_S once its parent pid
  changes or the lifeline pipe breaks (the front-end holds the only write end)."""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from dataclasses import dataclass

WATCH_INTERVAL_S = 0.5
_PR_SET_PDEATHSIG = 1


@dataclass
class Lifeline:
    """What a worker needs to follow its parent; picklable (the reader travels with spawn)."""
    parent_pid: int | None         # None: forked by a fork server, the parent is whoever it is
    reader: object                 # read end of a pipe whose only write end the front-end holds
    kernel_signal: bool            # arm PR_SET_PDEATHSIG (the parent forks from its main thread)


def make_lifeline(ctx) -> tuple[Lifeline, object]:
    """(the workers' Lifeline, the write end the front-end keeps open while it lives)."""
    reader, writer = ctx.Pipe(duplex=False)
    if ctx.get_start_method() == 'forkserver':
        return Lifeline(None, reader, True), writer
    started_in_main = threading.current_thread() is threading.main_thread()
    return Lifeline(os.getpid(), reader, started_in_main), writer


def follow_parent(lifeline: Lifeline):
    """In the worker: die with the parent. Returns at once."""
    parent = os.getppid() if lifeline.parent_pid is None else lifeline.parent_pid
    if lifeline.kernel_signal and sys.platform.startswith('linux'):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), 'prctl(PR_SET_PDEATHSIG) failed')
    if os.getppid() != parent or parent == 1:        # the parent died before the signal was set
        _die()
    threading.Thread(target=_watch, args=(lifeline.reader, parent), daemon=True,
                     name='lmdeploy_lite-parent-watch').start()


def _watch(reader, parent: int):
    while True:
        try:
            if reader.poll(WATCH_INTERVAL_S):     # data never comes: readable = EOF
                reader.recv()
        except (EOFError, OSError):
            _die()
        if os.getppid() != parent:
            _die()


def _die():
    """End now, without cleanup that could block (a collective, a queue's feeder thread)."""
    if hasattr(signal, 'SIGKILL'):
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(1)
