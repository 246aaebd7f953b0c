"""Forward counts per rank, for the multi-process tests: which ranks ran target and draft forwards.

`count_forwards` is a worker hook (see tests/helpers/broken.py): in every rank it counts calls
of the target model (Qwen3_5ForCausalLM) and of the MTP draft (Qwen3_5MTP), dummy forwards
included, and keeps `rank{r}` in the directory named by the worker's FORWARD_COUNT_DIR
(MPEngineLoop's `env=`) up to date with 'target draft'; `read_counts` reads them back.
"""
import os

import torch

FORWARD_COUNT_DIR = 'FORWARD_COUNT_DIR'


def count_forwards(engine):
    from lmdeploy_lite.pytorch.models.qwen3_5 import Qwen3_5ForCausalLM
    from lmdeploy_lite.pytorch.models.qwen3_5_mtp import Qwen3_5MTP
    path = os.path.join(os.environ[FORWARD_COUNT_DIR], f'rank{engine.dist.rank}')
    counts = {Qwen3_5ForCausalLM: 0, Qwen3_5MTP: 0}

    def write():
        with open(path + '.tmp', 'w') as f:
            f.write(' '.join(map(str, counts.values())))
        os.replace(path + '.tmp', path)          # a reader never sees half a file

    def count(module, args):
        if type(module) in counts:
            counts[type(module)] += 1
            write()
    write()
    torch.nn.modules.module.register_module_forward_pre_hook(count)


def read_counts(directory: str, world_size: int) -> list[tuple[int, int]]:
    """(target forwards, draft forwards) of each rank so far."""
    out = []
    for rank in range(world_size):
        with open(os.path.join(directory, f'rank{rank}')) as f:
            target, draft = map(int, f.read().split())
        out.append((target, draft))
    return out
