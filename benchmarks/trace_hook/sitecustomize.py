"""Put this folder on PYTHONPATH to log every engine step of any process that runs one (the
server's engine process included) to $STEP_TRACE_DIR/steps_<pid>.tsv: wall time at the step's
end, its seconds, seconds from scheduling to its tokens, decode or not, rows, tokens. The
scheduler's `observe_step` is wrapped when its module is first imported; nothing else changes.
Read with benchmarks/step_trace.py."""
import atexit
import importlib.abc
import importlib.machinery
import os
import sys
import time

TARGET = 'lmdeploy_lite.pytorch.engine.scheduler'


def _wrap(module):
    cls, out = module.Scheduler, open(os.path.join(
        os.environ['STEP_TRACE_DIR'], f'steps_{os.getpid()}.tsv'), 'a', buffering=1 << 16)
    original, flushed = cls.observe_step, [time.time()]
    atexit.register(out.flush)

    def observe_step(self, batch, seconds, chunk_seconds):
        if batch is not None:
            out.write(f'{time.time():.6f}\t{seconds:.6f}\t{chunk_seconds:.6f}\t'
                      f'{int(batch.is_decoding)}\t{len(batch.seqs)}\t{sum(batch.q_lens)}\n')
            if time.time() > flushed[0] + 1.0:           # a process killed loses <= 1 s
                out.flush()
                flushed[0] = time.time()
        return original(self, batch, seconds, chunk_seconds)
    cls.observe_step = observe_step


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _wrap(module)
        spec.loader.exec_module = exec_module
        return spec


if os.environ.get('STEP_TRACE_DIR'):
    sys.meta_path.insert(0, _Finder())
