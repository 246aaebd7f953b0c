"""Prefix caching for a hybrid model: which full KV blocks and linear-attention state snapshots
an earlier request left behind, and what a new request may take from them.

Keys: key(j) = blake2b(key(j - 1), int64 tokens of block j), the same in every process (the DP
front-end routes with the ranks' keys). With a draft that keeps its KV in the same blocks (the
MTP head), a block's last entry was computed from the token AFTER it: that token is hashed too
(`lookahead`). Snapshots: three of four Qwen3.5 layers keep a recurrent state and conv window,
not per-token KV, so a cached prefix is usable only up to where the state after exactly those
tokens was kept: a snapshot (every linear-attention layer's recurrent state and K - 1 conv
columns) named by the key of the block that ends there. A hit is the longest run of cached
blocks from the start that ends at a snapshot. Snapshots are taken at block-aligned chunk ends:
the prompt's last full block, where a request's cached blocks run out (a branch point), and a
long prefill's chunk ends; a fixed LRU pool (`CacheConfig.num_snapshots`, cache_plan.py), a
snapshot going with the block it ends at."""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass


def block_keys(token_ids: list[int], block_size: int, lookahead: bool,
               known: list[int] | None = None) -> list[int]:
    """Keys of every full block of `token_ids` that can be named (with `lookahead`, a block
    needs the token after it); `known`: keys of a prefix already computed."""
    keys = list(known or ())
    extra = 1 if lookahead else 0
    prev = keys[-1].to_bytes(16, 'little') if keys else b''
    for j in range(len(keys), (len(token_ids) - extra) // block_size):
        chunk = token_ids[j * block_size:(j + 1) * block_size + extra]
        digest = hashlib.blake2b(prev + array('q', chunk).tobytes(), digest_size=16).digest()
        keys.append(int.from_bytes(digest, 'little'))
        prev = digest
    return keys


@dataclass
class PrefixCacheStats:
    """Prompt tokens served from the cache at admission."""
    hit_tokens: int = 0


class SnapshotPool:
    """`size` snapshot rows named by block keys, LRU evicted. `events`: (key, kept) for each
    snapshot named or dropped since `take_events` (the DP front-end routes by them)."""

    def __init__(self, size: int):
        self.size = size
        self.free = list(range(size - 1, -1, -1))
        self.row_of: OrderedDict[int, int] = OrderedDict()     # key -> row, LRU first
        self.events: list[tuple[int, bool]] = []

    def take_events(self) -> list[tuple[int, bool]]:
        events, self.events = self.events, []
        return events

    def __contains__(self, key: int) -> bool:
        return key in self.row_of

    def __len__(self) -> int:
        return len(self.row_of)

    def touch(self, key: int) -> int:
        self.row_of.move_to_end(key)
        return self.row_of[key]

    def take(self) -> int | None:
        """A row for a new snapshot (evicting the least recently used); None: no rows."""
        if self.free:
            return self.free.pop()
        if not self.row_of:
            return None
        key, row = self.row_of.popitem(last=False)
        self.events.append((key, False))
        return row

    def name(self, key: int, row: int):
        """Row `row` now holds the snapshot at block `key` (replacing one of the same key)."""
        old = self.row_of.pop(key, None)
        if old is not None and old != row:
            self.free.append(old)
        self.row_of[key] = row
        self.events.append((key, True))

    def give_back(self, row: int):
        self.free.append(row)

    def drop(self, key: int):
        row = self.row_of.pop(key, None)
        if row is not None:
            self.free.append(row)
            self.events.append((key, False))


def longest_cached(keys: list[int], snapshot_keys, num_tokens: int, block_size: int) -> int:
    """Tokens of the longest prefix whose last block's key is in `snapshot_keys`, leaving one to
    compute: the DP front-end's routing hint (it does not see every eviction; the rank decides)."""
    usable = keys[:(num_tokens - 1) // block_size]
    return block_size * max((j + 1 for j, key in enumerate(usable) if key in snapshot_keys),
                            default=0)


# ---- the scheduler's side: what a sequence takes from the cache and gives back ----------------
def take_cached_prefix(bm, seq) -> int:
    """A sequence admitted with nothing computed takes its longest cached prefix and plans its
    snapshot points (module docstring); returns the tokens taken."""
    if not bm.caching or seq.num_computed or seq.blocks:
        return 0
    bs, state = bm.block_size, seq.prefix
    hit, matched = bm.match(seq)
    if hit:
        state.restore_row = bm.acquire(seq, hit)
        seq.num_computed = hit * bs
    prompt_end = (len(seq.token_ids) - 1) // bs * bs      # its last full block, one token left
    state.snapshot_points = sorted(p for p in {matched * bs, prompt_end} if p > hit * bs)
    return hit * bs


def drop_cached_prefix(bm, seq):
    """Admission fell through: give back what `take_cached_prefix` took."""
    if seq.blocks:
        bm.release(seq)
    seq.num_computed, seq.prefix.restore_row = 0, None


def count_lookup(bm, seq, hit: int):
    """An admitted sequence's lookup, counted (its first one's hit: Response.num_cached_tokens)."""
    if not bm.caching:
        return
    bm.stats.hit_tokens += hit
    if not seq.num_generated:
        seq.num_cached_tokens = hit


def add_state_copies(bm, batch):
    """Restores of admitted cached prefixes; a save where a chunk ends on a block boundary."""
    if batch is None or not bm.caching or batch.is_decoding:
        return batch
    bs = bm.block_size
    for seq, n in zip(batch.seqs, batch.q_lens):
        state = seq.prefix
        if state.restore_row is not None:
            batch.restores.append((state.restore_row, seq.state_slot))
            state.restore_row = None
        end = seq.num_computed + n
        if seq.prefilled or end % bs or end >= len(seq.token_ids):
            continue
        keys = bm.keys(seq)
        if end // bs > len(keys) or keys[end // bs - 1] in bm.snapshots:
            continue
        row = bm.snapshots.take()
        if row is not None:
            state.pending_save = (end, row)
            batch.saves.append((seq.state_slot, row))
    return batch


def keep_snapshot(bm, seq):
    """The step that saved `seq`'s state has run: name its blocks up to there and the snapshot."""
    end, row = seq.prefix.pending_save
    seq.prefix.pending_save = None
    keys = bm.keys(seq)
    bm.register(seq, end)
    key = keys[end // bm.block_size - 1]
    if seq.num_computed >= end and key in bm.block_of:
        bm.snapshots.name(key, row)
    else:
        bm.snapshots.give_back(row)
