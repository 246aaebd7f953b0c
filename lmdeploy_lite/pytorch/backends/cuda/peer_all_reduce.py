"""A one-shot all-reduce over NVLink peer memory for the small messages of decode steps.

Each rank copies its tensor into a buffer that every rank of the group can read (torch's
symmetric memory: CUDA IPC over NVLink, no multicast), the ranks meet at a barrier in that
memory, and each one reads every peer's copy and adds them up: one kernel, no NCCL proxy and
no host work, so it replays inside a CUDA graph. NCCL's ring spends its latency on protocol
steps that a few KB do not need; lmdeploy, vLLM and SGLang use such a kernel for small
messages for the same reason. Larger messages (prefill) go to NCCL, which is faster there.

`LMDEPLOY_LITE_TP_ALLREDUCE` picks: `auto` (default: one-shot up to `MAX_BYTES_ENV` bytes,
default 1 MiB, NCCL above), `oneshot` (the same; start-up fails if it cannot be set up) or
`nccl` (never one-shot). The sum adds the ranks' values in rank order in float32 (bf16 inputs)
or float32 itself, so two ranks give exactly NCCL's bits (one addition, commutative); with
more ranks the order may differ from NCCL's ring.

Supported: bfloat16 and float32 tensors of a CUDA group of 2, 4 or 8 ranks; anything else
returns None from `PeerAllReduce.create` / falls back per call (`can_reduce`).
"""
from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger('lmdeploy_lite')

MODE_ENV = 'LMDEPLOY_LITE_TP_ALLREDUCE'
MAX_BYTES_ENV = 'LMDEPLOY_LITE_ONESHOT_MAX_BYTES'
MODES = ('auto', 'oneshot', 'nccl')
_DTYPES = (torch.bfloat16, torch.float32)


def mode() -> str:
    value = os.environ.get(MODE_ENV, 'auto')
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
        self.group_name = group.group_name
        self.buffer = buffer            # [limit] uint8 of symmetric memory, rendezvoused
        self.limit = limit

    @classmethod
    def create(cls, group, size: int, device: torch.device) -> 'PeerAllReduce | None':
        """Set up on every rank of `group` at once (the rendezvous is a collective); None when
        the mode is `nccl` or the group or machine cannot (the reason is logged; `oneshot`
        raises instead)."""
        chosen = mode()
        if chosen == 'nccl':
            return None
        try:
            if size not in (2, 4, 8):
                raise RuntimeError(f'group of {size} ranks (the kernel takes 2, 4 or 8)')
            import torch.distributed._symmetric_memory as symm_mem
            limit = max_bytes()
            if hasattr(symm_mem, 'enable_symm_mem_for_group'):   # needed before torch 2.9
                symm_mem.enable_symm_mem_for_group(group.group_name)
            buffer = symm_mem.empty(limit, dtype=torch.uint8, device=device)
            symm_mem.rendezvous(buffer, group.group_name)
        except Exception as e:          # noqa: BLE001 - any failure means: NCCL does it
            if chosen == 'oneshot':
                raise RuntimeError(f'{MODE_ENV}=oneshot: the peer-memory all-reduce cannot be '
                                   f'set up: {e}') from e
            logger.info('TP all-reduce on NCCL only: one-shot peer memory unavailable (%s)', e)
            return None
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
