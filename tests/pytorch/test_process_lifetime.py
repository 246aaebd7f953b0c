"""Rank processes of the mp executor die with the front-end, however it ends.

Every test starts real processes, has a hard pytest timeout and asserts it finished in time;
whatever it started is SIGKILLed on the way out, pass or fail.
"""
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FRONT_END = '''
import sys, threading, time
from lmdeploy_lite import PytorchEngineConfig, pipeline

def start():
    global pipe
    pipe = pipeline(sys.argv[1], PytorchEngineConfig(dp=2, ep=2, dtype='float32', device='cpu',
                                                     block_size=4, session_len=64), progress=False)
if sys.argv[2] == 'thread':       # built in a thread that then ends (the server may do that)
    t = threading.Thread(target=start)
    t.start()
    t.join()
else:
    start()
print(*[p.pid for p in pipe._client._procs], flush=True)
time.sleep(600)
'''


def alive(pid: int) -> bool:
    """Running (a zombie nobody reaped does not count: it burns nothing)."""
    try:
        with open(f'/proc/{pid}/stat') as f:
            return f.read().rsplit(')', 1)[1].split()[0] != 'Z'
    except FileNotFoundError:
        return False
    except OSError:                 # no /proc (not Linux)
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False


def kill_all(pids):
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


BUILT_IN = ['main', 'thread']


@pytest.fixture(scope='module')
def front_ends(tiny_ckpt):
    """built_in -> (its front-end process, when it was started), both started at once: a
    front-end's start-up (imports, its own fork server's, two ranks) is seconds of one core
    or two, so the second overlaps the first. Each test kills its own; any left at the end too."""
    path = tiny_ckpt(True, layout='plain')
    started = {built_in: (subprocess.Popen([sys.executable, '-c', FRONT_END, path, built_in],
                                           cwd=REPO, stdout=subprocess.PIPE, text=True,
                                           env=dict(os.environ, OMP_NUM_THREADS='1',
                                                    PYTHONPATH=REPO)), time.monotonic())
               for built_in in BUILT_IN}
    yield started
    for front, _ in started.values():
        front.kill()
        front.wait(10)


@pytest.mark.timeout(150)
@pytest.mark.parametrize('built_in', BUILT_IN)
def test_workers_die_with_a_sigkilled_front_end(built_in, front_ends):
    """dp=2 ep=2: SIGKILL of the front-end leaves no rank running. 'main': the kernel's
    parent-death signal; 'thread': the pipeline was built in a thread that has ended (so no
    parent-death signal may be armed: it fires when that thread exits), the watchdog's job."""
    front, start = front_ends[built_in]
    pids = []
    try:
        line = []
        reader = threading.Thread(target=lambda: line.append(front.stdout.readline()), daemon=True)
        reader.start()
        reader.join(100)
        assert line and line[0].strip(), f'the front-end printed no worker pids (rc {front.poll()})'
        pids = [int(p) for p in line[0].split()]
        assert len(pids) == 2
        if built_in == 'thread':      # the ranks serve on (a builder thread's exit killed none)
            time.sleep(1.0)
        assert all(alive(p) for p in pids), 'a rank died with the thread that started it'
        front.send_signal(signal.SIGKILL)
        front.wait(10)
        killed = time.monotonic()
        while any(alive(p) for p in pids) and time.monotonic() - killed < 10:
            time.sleep(0.1)
        left = [p for p in pids if alive(p)]
        assert not left, f'ranks {left} outlived the front-end by 10 s'
        assert time.monotonic() - killed < 3
    finally:
        front.kill()
        kill_all(pids)
    assert time.monotonic() - start < 130
