"""Forking: the n choices of one prompt of P tokens share one prefill.

The leader (choice 0) prefills the prompt but its last token (its chunks stop at P - 1) while its
members wait; waiting members are passed over by admission, so requests behind them are not held
up. The step that schedules the leader's last prompt token forks the members that fit (a state
slot and the blocks for P positions, max_batch_size; not the token budget: at most n - 1
one-token rows more): each shares the leader's full blocks, gets a copy of the partial block past
them and of the leader's linear-attention state after P - 1 tokens (copied on the device before
the step's forward, `ScheduledBatch.block_copies` / `state_copies`, for the target's layers and
the draft's), and feeds the last prompt token in the same step as an ordinary final prefill
chunk, sampling its first token from its own generator. The group's prefill costs (P - 1) + n
tokens instead of n * P. Members that do not fit then, or whose leader went away (aborted),
prefill on their own as ordinary requests (the prefix cache may still serve them). A forked
member is an ordinary sequence from then on: preempted, it prefills on its own again.
"""
from __future__ import annotations

from lmdeploy_lite.pytorch.engine.sequence import SeqStatus, Sequence


def link_group(seqs: list[Sequence]):
    """The choices of one prompt: choice 0 leads, the others wait for its prefill (a one-token
    prompt has nothing to share)."""
    leader = seqs[0]
    if len(leader.token_ids) < 2:
        return
    leader.fork.members = seqs[1:]
    for member in leader.fork.members:
        member.fork.leader = leader


def chunk_end(seq: Sequence) -> list[int]:
    """Where a leader with members waiting must end a prefill chunk: at its last prompt token."""
    return [seq.num_prompt - 1] if seq.fork.members else []


def fork_members(scheduler, leader: Sequence, seqs: list[Sequence], q_lens: list[int]):
    """`leader` was just scheduled: if this is its last prompt token, its waiting members that
    fit start from its cache now, each with that token as its chunk (appended to the step's
    `seqs` and `q_lens`)."""
    if not leader.fork.members or leader.num_computed != leader.num_prompt - 1:
        return
    members, leader.fork.members = leader.fork.members, []
    bm = scheduler.bm
    whole = min(leader.num_prompt + scheduler.num_draft_extra,
                scheduler.max_positions(scheduler.session_len))
    for seq in members:
        seq.fork.leader = None
        if len(scheduler.running) >= scheduler.max_batch_size or not bm.can_fork(leader, whole):
            continue                          # it prefills on its own
        block_copy = bm.fork(seq, leader)
        bm.grow(seq, whole)
        seq.fork.copy = (leader.state_slot, block_copy)
        seq.num_computed = leader.num_computed
        scheduler.waiting.remove(seq)
        seq.status = SeqStatus.RUNNING
        scheduler.running.append(seq)
        seqs.append(seq)
        q_lens.append(1)


def add_fork_copies(batch):
    """The copies of this step's forks (members still in the batch)."""
    if batch is None:
        return batch
    for seq in batch.seqs:
        if seq.fork.copy is None:
            continue
        slot, block_copy = seq.fork.copy
        seq.fork.copy = None
        batch.state_copies.append((slot, seq.state_slot))
        if block_copy is not None:
            batch.block_copies.append(block_copy)
    return batch


def release(seq: Sequence):
    """`seq` is gone: it no longer waits on a leader, and its own members prefill alone."""
    if seq.fork.leader is not None:
        seq.fork.leader.fork.members.remove(seq)
        seq.fork.leader = None
    for member in seq.fork.members:
        member.fork.leader = None
    seq.fork.members = []
