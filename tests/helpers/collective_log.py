"""Each step's collectives per rank, for the multi-process tests: which tensors a step shipped.

`log_collectives` is a worker hook (see tests/helpers/broken.py): in every rank it appends the
trace of each step with work (DistContext records (op, group, shape, dtype) per collective) as
one line of `rank{r}` in the directory named by the worker's COLLECTIVE_LOG_DIR (MPEngineLoop's
`env=`); `read_steps` reads them back.
"""
import json
import os

COLLECTIVE_LOG_DIR = 'COLLECTIVE_LOG_DIR'


def log_collectives(engine):
    path = os.path.join(os.environ[COLLECTIVE_LOG_DIR], f'rank{engine.dist.rank}')
    open(path, 'w').close()
    end_step = engine.dist.end_step

    def logged_end_step():
        with open(path, 'a') as f:
            f.write(json.dumps([[op, group, list(shape), dtype]
                                for op, group, shape, dtype in engine.dist.trace]) + '\n')
        end_step()
    engine.dist.end_step = logged_end_step


def read_steps(directory: str, rank: int) -> list[list[tuple]]:
    """Rank `rank`'s steps so far, each a list of (op, group, shape tuple, dtype)."""
    with open(os.path.join(directory, f'rank{rank}')) as f:
        return [[(op, group, tuple(shape), dtype) for op, group, shape, dtype in json.loads(line)]
                for line in f]


def count_object_broadcasts(engine):
    """A worker hook: each `torch.distributed.broadcast_object_list` call of this rank's process
    appends a line to `broadcasts{rank}` in COLLECTIVE_LOG_DIR (`read_broadcasts`)."""
    import torch.distributed as dist
    path = os.path.join(os.environ[COLLECTIVE_LOG_DIR], f'broadcasts{engine.dist.rank}')
    open(path, 'w').close()
    real = dist.broadcast_object_list

    def counted(*args, **kwargs):
        with open(path, 'a') as f:
            f.write('broadcast_object_list\n')
        return real(*args, **kwargs)
    dist.broadcast_object_list = counted


def read_broadcasts(directory: str, rank: int) -> int:
    with open(os.path.join(directory, f'broadcasts{rank}')) as f:
        return len(f.read().splitlines())
