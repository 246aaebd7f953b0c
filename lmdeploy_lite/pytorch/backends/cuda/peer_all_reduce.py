"""A one-shot all-reduce over NVLink peer memory for the small messages of decode steps.

Each rank copies its tensor into a buffer every rank of the group can read (torch's symmetric
memory, `torch.ops.symm_mem.one_shot_all_reduce_copy`: CUDA IPC over NVLink, no multicast), the
ranks meet at a barrier in that memory, and each reads and adds every peer's copy: one kernel, no
host work, so it replays inside a CUDA graph. lmdeploy, vLLM and SGLang use such kernels for
small messages; here NCCL, captured in the same graphs, measured faster. Prefill-sized messages
always go to NCCL.

`LMDEPLOY_LITE_TP_ALLREDUCE`: `nccl` (default, every size) or `oneshot` (up to `MAX_BYTES_ENV`
bytes, default 1 MiB, NCCL above; start-up fails if it cannot be set up). Inside the decode
graphs on two H100s (NV18, 0.8B shape, bf16; BENCHMARKS.md "More GPUs, more speed") the one-shot
kernel took 1.88 / 3.01 ms per step at batch 1 / 64 against NCCL's 1.81 / 2.69, so it stays an
option to measure on other machines. With two ranks a sum is one addition whichever kernel adds,
so the bits are NCCL's; with more ranks the order of the additions may differ. Supported:
bfloat16 and float32 tensors of a CUDA group of 2, 4 or 8 ranks; other tensors go to NCCL per
call (`can_reduce`).
"""
from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger('lmdeploy_lite')

MODE_ENV = 'LMDEPLOY_LITE_TP_ALLREDUCE'
MAX_BYTES_ENV = 'LMDEPLOY_LITE_ONESHOT_MAX_BYTES'
MODES = ('nccl', 'oneshot')
_DTYPES = (torch.bfloat16, torch.float32)


def mode() -> str:
    value = os.environ.get(MODE_ENV, 'nccl')
    if value not in MODES:
        raise ValueError(f'{MODE_ENV}={value!r}: must be one of {MODES}')
    return value


def max_bytes() -> int:
    value = os.environ.get(MAX_BYTES_ENV, str(1 << 20))
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f'{MAX_BYTES_ENV}={value!r}: must be a positive number of bytes')
    return int(value)


class PeerAllReduce:
    """The one-shot all-reduce of one NCCL group (`group`, its ranks' devices peer-linked)."""

    def __init__(self, group, buffer: torch.Tensor, limit: int):
        self.group_name, self.limit = group.group_name, limit
        self.buffer = buffer            # [limit] uint8 of symmetric memory, rendezvoused

    @classmethod
    def create(cls, group, size: int, device: torch.device) -> 'PeerAllReduce | None':
        """Set up on every rank of `group` at once (the rendezvous is a collective); None in
        the `nccl` mode. Raises RuntimeError naming the reason when it cannot be set up."""
        if mode() == 'nccl':
            return None
        try:
            if size not in (2, 4, 8):
                raise RuntimeError(f'group of {size} ranks (the kernel takes 2, 4 or 8)')
            import torch.distributed._symmetric_memory as symm_mem
            limit = max_bytes()
            buffer = symm_mem.empty(limit, dtype=torch.uint8, device=device)
            symm_mem.rendezvous(buffer, group.group_name)
        except Exception as e:          # noqa: BLE001 - whatever failed, name it
            raise RuntimeError(f'{MODE_ENV}=oneshot: the peer-memory all-reduce cannot be set '
                               f'up: {e}') from e
        logger.info('TP all-reduce: one-shot over peer memory up to %d bytes, NCCL above', limit)
        return cls(group, buffer, limit)

    def can_reduce(self, tensor: torch.Tensor) -> bool:
        return (tensor.dtype in _DTYPES and tensor.is_contiguous()
                and tensor.numel() * tensor.element_size() <= self.limit)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The group's sum of `tensor` (a new tensor; `tensor` is left as it was)."""
        symm = self.buffer[:tensor.numel() * tensor.element_size()].view(tensor.dtype)
        return torch.ops.symm_mem.one_shot_all_reduce_copy(symm.view(tensor.shape), tensor,
                                                           'sum', self.group_name)
