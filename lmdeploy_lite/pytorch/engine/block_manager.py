"""Paged KV blocks, linear-attention state slots and the prefix cache's bookkeeping.

A block is in exactly one of three places: the free list, held by running sequences (`ref` > 0;
a cached block may have several holders), or cached and unheld (`ref` == 0, in `evictable`, LRU
first: taken only when the free list is empty). Cached blocks are named by their key
(engine/prefix_cache.py); a held cached block is never handed to another allocation."""
from __future__ import annotations

from collections import OrderedDict

from lmdeploy_lite.pytorch.engine.prefix_cache import PrefixCacheStats, SnapshotPool, block_keys
from lmdeploy_lite.pytorch.engine.sequence import Sequence


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockManager:
    """A sequence's blocks cover positions 0..len(blocks)*block_size-1. Block 0 and state slot 0
    are reserved for dummy forwards. `num_snapshots` > 0 turns the prefix cache on."""

    def __init__(self, num_blocks: int, block_size: int, num_state_slots: int,
                 num_snapshots: int = 0, lookahead: bool = False):
        self.num_blocks, self.block_size, self.num_state_slots = (num_blocks, block_size,
                                                                  num_state_slots)
        self.free_blocks = list(range(num_blocks - 1, 0, -1))      # pop() hands out 1, 2, ...
        self.free_slots = list(range(num_state_slots - 1, 0, -1))
        self.ref = [0] * num_blocks
        self.caching, self.lookahead = num_snapshots > 0, lookahead
        self.key_of: dict[int, int] = {}                  # cached block -> key
        self.block_of: dict[int, int] = {}                # key -> cached block
        self.evictable: OrderedDict[int, None] = OrderedDict()     # cached, ref 0; LRU first
        self.snapshots = SnapshotPool(num_snapshots)
        self.stats = PrefixCacheStats()

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take: free, or cached and held by no one."""
        return len(self.free_blocks) + len(self.evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.block_of)

    def can_hold(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether `seq` can grow to cover `num_tokens` positions (and has or can get a slot)."""
        need = blocks_needed(num_tokens, self.block_size) - len(seq.blocks)
        has_slot = seq.state_slot is not None or bool(self.free_slots)
        return need <= self.num_free_blocks and has_slot

    def grow(self, seq: Sequence, num_tokens: int):
        """Allocate so that `seq` covers `num_tokens` positions; the caller checked can_hold."""
        if seq.state_slot is None:
            seq.state_slot = self.free_slots.pop()
        for _ in range(blocks_needed(num_tokens, self.block_size) - len(seq.blocks)):
            self._allocate(seq)

    def _allocate(self, seq: Sequence) -> int:
        """A new block at the end of `seq`'s, the free list first, else the LRU cached one."""
        if self.free_blocks:
            block = self.free_blocks.pop()
        else:
            block, _ = self.evictable.popitem(last=False)
            key = self.key_of.pop(block)
            del self.block_of[key]
            self.snapshots.drop(key)          # the snapshot at its end can no longer be reached
        self.ref[block] = 1
        seq.blocks.append(block)
        return block

    def free(self, seq: Sequence):
        """Release `seq`'s blocks and slot; its complete blocks stay cached (last evicted first)."""
        self.register(seq, seq.num_computed)
        self.release(seq)
        if seq.state_slot is not None:
            self.free_slots.append(seq.state_slot)
            seq.state_slot = None
        if seq.prefix.pending_save is not None:        # its step's snapshot is never named
            self.snapshots.give_back(seq.prefix.pending_save[1])
            seq.prefix.pending_save = None
        seq.prefix.restore_row = None
        seq.fork.copy = None                    # a fork whose step never ran: nothing to copy

    def can_fork(self, parent: Sequence, num_tokens: int) -> bool:
        """Whether a sequence forked from `parent` (`fork`) can cover `num_tokens` positions."""
        shared = parent.num_computed // self.block_size
        need = blocks_needed(num_tokens, self.block_size) - shared
        return need <= self.num_free_blocks and bool(self.free_slots)

    def fork(self, seq: Sequence, parent: Sequence) -> tuple[int, int] | None:
        """Give `seq` `parent`'s cache: its full blocks shared, a state slot, a new block for a
        partial one. Returns (parent's partial block, its copy) to copy on the device, or None."""
        shared = parent.num_computed // self.block_size
        for block in parent.blocks[:shared]:
            self.ref[block] += 1
            seq.blocks.append(block)
        seq.state_slot = self.free_slots.pop()
        if parent.num_computed % self.block_size == 0:
            return None
        return parent.blocks[shared], self._allocate(seq)

    def keys(self, seq: Sequence) -> list[int]:
        """The keys of `seq`'s full blocks (kept on the sequence, extended as it grows)."""
        seq.prefix.block_keys = block_keys(seq.token_ids, self.block_size, self.lookahead,
                                           seq.prefix.block_keys)
        return seq.prefix.block_keys

    def register(self, seq: Sequence, num_computed: int):
        """Name `seq`'s complete blocks once `num_computed` positions are cached (a key another
        block already has keeps that block)."""
        if not self.caching:
            return
        keys = self.keys(seq)
        extra = 1 if self.lookahead else 0     # (a stop may have cut tokens the step computed)
        full = min(num_computed // self.block_size, len(seq.blocks),
                   (len(seq.token_ids) - extra) // self.block_size, len(keys))
        for j in range(full):
            block, key = seq.blocks[j], keys[j]
            if block in self.key_of or key in self.block_of:
                continue
            self.key_of[block], self.block_of[key] = key, block

    def match(self, seq: Sequence) -> tuple[int, int]:
        """(hit, matched) blocks: `seq`'s longest cached prefix ending at a snapshot, and the run
        of cached blocks from its start; at least one token is left to compute."""
        keys = self.keys(seq)
        limit = (len(seq.token_ids) - 1) // self.block_size
        hit = matched = 0
        for j, key in enumerate(keys[:limit]):
            if key not in self.block_of:
                break
            matched = j + 1
            if key in self.snapshots:
                hit = matched
        return hit, matched

    def acquire(self, seq: Sequence, num_blocks: int) -> int:
        """Give a sequence with no blocks its prefix's first `num_blocks` cached blocks; returns
        the snapshot row at their end (to restore into its state slot)."""
        keys = self.keys(seq)
        for key in keys[:num_blocks]:
            block = self.block_of[key]
            if self.ref[block] == 0:
                del self.evictable[block]
            self.ref[block] += 1
            seq.blocks.append(block)
        return self.snapshots.touch(keys[num_blocks - 1])

    def release(self, seq: Sequence):
        """Unhold `seq`'s blocks: a block no one holds is cached (evictable) or free. Also undoes
        `acquire` when admission falls through."""
        for block in reversed(seq.blocks):
            self.ref[block] -= 1
            if self.ref[block]:
                continue
            if block in self.key_of:
                self.evictable[block] = None
            else:
                self.free_blocks.append(block)
        seq.blocks = []

    def check(self):
        """Every block is free, held, or cached and unheld, exactly once (tests call this)."""
        free, evictable = set(self.free_blocks), set(self.evictable)
        held = {b for b in range(1, self.num_blocks) if self.ref[b] > 0}
        assert len(free) == len(self.free_blocks), 'a block is on the free list twice'
        assert not (free & evictable) and not (free & held) and not (evictable & held)
        assert free | evictable | held == set(range(1, self.num_blocks)), 'a block was lost'
        assert all(self.ref[b] == 0 for b in free | evictable)
        assert evictable <= set(self.key_of), 'an unheld block is neither free nor cached'
        assert {self.block_of[k] for k in self.key_of.values()} == set(self.key_of)
        assert all(k in self.block_of for k in self.snapshots.row_of), 'an orphan snapshot'
