"""Paged KV blocks and linear-attention state slots: free lists, nothing more."""
from __future__ import annotations

from lmdeploy_lite.pytorch.engine.sequence import Sequence


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockManager:
    """Owns the free lists. A sequence's blocks cover positions 0..len(blocks)*block_size-1.

    Block 0 and state slot 0 are reserved for dummy forwards (a rank with no work) and are never
    handed to a sequence.
    """

    def __init__(self, num_blocks: int, block_size: int, num_state_slots: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_state_slots = num_state_slots
        self.free_blocks = list(range(num_blocks - 1, 0, -1))      # pop() hands out 1, 2, ...
        self.free_slots = list(range(num_state_slots - 1, 0, -1))

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def can_hold(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether `seq` can grow to cover `num_tokens` positions (and has or can get a slot)."""
        need = blocks_needed(num_tokens, self.block_size) - len(seq.blocks)
        has_slot = seq.state_slot is not None or bool(self.free_slots)
        return need <= len(self.free_blocks) and has_slot

    def grow(self, seq: Sequence, num_tokens: int):
        """Allocate so that `seq` covers `num_tokens` positions; the caller checked can_hold."""
        if seq.state_slot is None:
            seq.state_slot = self.free_slots.pop()
        need = blocks_needed(num_tokens, self.block_size) - len(seq.blocks)
        for _ in range(max(need, 0)):
            seq.blocks.append(self.free_blocks.pop())

    def free(self, seq: Sequence):
        self.free_blocks.extend(reversed(seq.blocks))
        seq.blocks = []
        if seq.state_slot is not None:
            self.free_slots.append(seq.state_slot)
            seq.state_slot = None
