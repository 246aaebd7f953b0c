"""Scheduler and block manager on their own: no weights, a fake 'model' that emits token 7."""
import random

import pytest

from lmdeploy_lite.messages import GenerationConfig
from lmdeploy_lite.pytorch.engine.block_manager import BlockManager
from lmdeploy_lite.pytorch.engine.scheduler import Scheduler
from lmdeploy_lite.pytorch.engine.sequence import SeqStatus, Sequence


def make_scheduler(num_blocks=64, block_size=4, max_batch=8, budget=32, session_len=64,
                   lookahead=0, extra=0):
    bm = BlockManager(num_blocks, block_size, max_batch + 1)
    return Scheduler(bm, max_batch, budget, session_len, num_spec_tokens=lookahead,
                     num_draft_extra=extra)


def add(sched, prompt_len, max_new=4, seq_id=[0]):
    seq_id[0] += 1
    seq = Sequence(seq_id[0], list(range(1, prompt_len + 1)), prompt_len,
                   GenerationConfig(max_new_tokens=max_new), arrival=0)
    sched.add(seq)
    return seq


def run_step(sched, token=7):
    batch = sched.schedule()
    assert batch is not None
    for seq, n, samples in zip(batch.seqs, batch.q_lens, batch.sample_mask):
        assert seq.num_computed + n <= len(seq.token_ids) + sched.num_spec_tokens
        sched.update(seq, n if not batch.is_decoding else 1, [token] if samples else [])
    return batch


def test_chunked_prefill_respects_budget():
    sched = make_scheduler(budget=5)
    seq = add(sched, 12)
    lens = []
    while not seq.is_decoding:
        lens.append(run_step(sched).q_lens[0])
    assert lens == [5, 5, 2]
    assert seq.num_generated == 1


def test_prefill_first_then_decode_and_finish_frees_blocks():
    sched = make_scheduler()
    seqs = [add(sched, n, max_new=3) for n in (3, 9, 5)]
    first = run_step(sched)
    assert not first.is_decoding and first.seqs == seqs
    while sched.has_work:
        run_step(sched)
    assert all(s.finish_reason == 'length' and s.num_generated == 3 for s in seqs)
    assert sched.bm.num_free_blocks == sched.bm.num_usable_blocks
    assert len(sched.bm.free_slots) == sched.bm.num_state_slots - 1


def test_preemption_by_recompute_when_blocks_run_out():
    # 2 blocks of 4 per sequence at most in the budget: the later arrival is preempted
    sched = make_scheduler(num_blocks=6, block_size=4, session_len=12)
    a, b = add(sched, 4, max_new=6), add(sched, 4, max_new=6)
    preempted = False
    while sched.has_work:
        run_step(sched)
        preempted |= b.status == SeqStatus.WAITING and b.num_generated > 0
    assert preempted
    assert a.num_generated == 6 and b.num_generated == 6
    assert sched.bm.num_free_blocks == sched.bm.num_usable_blocks


def test_max_batch_size_limits_running():
    sched = make_scheduler(max_batch=2)
    for _ in range(5):
        add(sched, 3)
    run_step(sched)
    assert len(sched.running) == 2 and len(sched.waiting) == 3


def test_stop_token_inside_a_run_truncates():
    sched = make_scheduler(lookahead=3)
    seq = Sequence(1, [1, 2, 3], 3, GenerationConfig(max_new_tokens=10, stop_token_ids=[9]), 0)
    sched.add(seq)
    run_step(sched)
    sched.schedule()
    emitted = sched.update(seq, 2, [5, 9, 6])
    assert emitted == [5, 9] and seq.finish_reason == 'stop'
    assert sched.bm.num_free_blocks == sched.bm.num_usable_blocks


def test_max_new_tokens_never_exceeded_by_multi_token_update():
    sched = make_scheduler(lookahead=3)
    seq = add(sched, 3, max_new=2)
    run_step(sched)
    sched.schedule()
    emitted = sched.update(seq, 4, [5, 6, 8, 9])
    assert emitted == [5] and seq.num_generated == 2 and seq.finish_reason == 'length'


def test_cache_too_small_for_session_len_is_an_error():
    with pytest.raises(ValueError, match='session_len=100'):
        make_scheduler(num_blocks=4, block_size=4, session_len=100)


def test_no_leak_after_many_requests_with_aborts():
    rng = random.Random(0)
    sched = make_scheduler(num_blocks=40, block_size=4, max_batch=6, budget=16, session_len=40)
    seqs = []
    for i in range(1000):
        seqs.append(add(sched, rng.randint(1, 20), max_new=rng.randint(1, 6)))
        if rng.random() < 0.3:
            run_step(sched)
        if rng.random() < 0.1:
            sched.abort(rng.choice(seqs))
    while sched.has_work:
        run_step(sched)
    assert all(s.is_finished for s in seqs)
    assert sched.bm.num_free_blocks == sched.bm.num_usable_blocks
    assert len(sched.bm.free_slots) == sched.bm.num_state_slots - 1


def test_every_decode_row_samples_and_only_final_prefill_chunks_do():
    sched = make_scheduler(budget=5, lookahead=3)
    long, short = add(sched, 12), add(sched, 3)
    first = sched.schedule()
    assert first.q_lens == [5] and first.sample_mask == [False]
    sched.update(long, 5, [])
    second = sched.schedule()
    assert second.q_lens == [5] and second.sample_mask == [False]
    sched.update(long, 5, [])
    third = sched.schedule()                     # the end of `long`, then the start of `short`
    assert third.q_lens == [2, 3] and third.sample_mask == [True, True]
    sched.update(long, 2, [7])
    sched.update(short, 3, [7])
    decode = sched.schedule()
    assert decode.is_decoding and decode.q_lens == [4, 4] and decode.sample_mask == [True, True]
