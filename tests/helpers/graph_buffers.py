"""Decode steps of every rank through the CUDA-graph runners' static buffers, for the
multi-process tests: `graph_buffers` is a worker hook (see tests/helpers/broken.py) that enables
the runners on a CPU rank (static-buffer mode: the graphs' copies and batch padding, each forward
run eagerly on the padded buffers, its collectives in the graph's order; layouts that capture
graphs on a GPU only: TP, not EP's all-to-all dispatcher, which runs eagerly there) and keeps
`rank{r}` in the directory named by the worker's GRAPH_REPLAY_DIR (MPEngineLoop's `env=`) up to
date with one 'name replays' line per runner that replayed; `read_replays` reads them back.
"""
import os

GRAPH_REPLAY_DIR = 'GRAPH_REPLAY_DIR'


def graph_buffers(engine):
    from lmdeploy_lite.pytorch.backends.cuda.graph_runner import GraphRunner
    path = os.path.join(os.environ[GRAPH_REPLAY_DIR], f'rank{engine.dist.rank}')
    engine.agent.enable_graphs([2, 4, 8], max_blocks=16, recorder=engine.dist)
    replay, counts = GraphRunner._replay, {}

    def counting(runner, bucket, rows):
        counts[runner.name] = counts.get(runner.name, 0) + 1
        with open(path + '.tmp', 'w') as f:
            f.writelines(f'{name}\t{n}\n' for name, n in counts.items())
        os.replace(path + '.tmp', path)          # a reader never sees half a file
        return replay(runner, bucket, rows)
    GraphRunner._replay = counting               # this worker process only


def read_replays(directory: str, world_size: int) -> list[dict[str, int]]:
    """{runner name: replays} of each rank so far."""
    out = []
    for rank in range(world_size):
        with open(os.path.join(directory, f'rank{rank}')) as f:
            out.append({name: int(n) for name, n in (line.split('\t') for line in f)})
    return out
