"""Forking: the n choices of one prompt of P tokens share one prefill, (P - 1) + n tokens instead of
n * P. The leader (choice 0) prefills all but the last prompt token while its members wait
(admission passes them over). The step that schedules that token forks the members that fit (a state
slot and blocks for P positions): each shares the leader's full blocks, gets copies of the partial
block past them and of the leader's state after P - 1 tokens (on the device before the forward,
target and draft: `ScheduledBatch.block_copies` / `state_copies`) and feeds the last prompt token as
an ordinary final chunk, sampling from its own generator. Members that do not fit then, or whose
leader went away, prefill alone; a forked member is an ordinary sequence after."""
from __future__ import annotations

from lmdeploy_lite.pytorch.engine.sequence import SeqStatus, Sequence


def link_group(seqs: list[Sequence]):
    """Choice 0 leads, the others wait for its prefill (a one-token prompt shares nothing)."""
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
    """`leader` was just scheduled: at its last prompt token, its waiting members that fit join
    the step (`seqs`, `q_lens`) from its cache, each with that token as its chunk."""
    if not leader.fork.members or leader.num_computed != leader.num_prompt - 1:
        return
    members, leader.fork.members = leader.fork.members, []
    bm = scheduler.bm
    whole = min(leader.num_prompt + scheduler.num_draft_extra, scheduler.max_positions)
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
