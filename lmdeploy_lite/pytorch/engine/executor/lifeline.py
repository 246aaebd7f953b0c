"""A rank process ends when the process that started it ends, however that ended (SIGKILL
included, which no `daemon=True` or atexit hook survives).

Two mechanisms, both armed first thing in the worker:
- Linux: prctl(PR_SET_PDEATHSIG, SIGKILL), so the kernel kills the worker when its parent dies;
  checked right after it is set that the parent is still the one that started us (it may have
  died before). The kernel sends the signal when the *thread* that started the worker exits, so
  it is armed only for workers started from the parent's main thread (which lives as long as
  the process); a pipeline built in a short-lived thread relies on the watchdog alone. Workers
  forked by multiprocessing's fork server (the mp executor's) have the server as their parent,
  which forks from its main thread and exits when the front-end does: always armed.
- Everywhere: a daemon watchdog thread that ends the worker within WATCH_INTERVAL_S once its
  parent pid changes (re-parented: the parent died) or the lifeline pipe breaks (the front-end
  holds the only write end; the OS closes it when the front-end dies, whatever the platform).
"""
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
    """(the workers' Lifeline, the write end the front-end keeps open for as long as it lives).
    `ctx`: the multiprocessing context that starts the workers."""
    reader, writer = ctx.Pipe(duplex=False)
    if ctx.get_start_method() == 'forkserver':
        return Lifeline(None, reader, True), writer
    started_in_main = threading.current_thread() is threading.main_thread()
    return Lifeline(os.getpid(), reader, started_in_main), writer


def follow_parent(lifeline: Lifeline):
    """In the worker: die with the parent (see the module docstring). Returns at once."""
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
    """The parent is gone: nobody reads our results; end now, without cleanup that could block
    (a collective, a queue's feeder thread)."""
    if hasattr(signal, 'SIGKILL'):
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(1)
