"""Scheduler and block manager on their own: no weights, a fake 'model' that emits token 7."""
import random

import pytest

from lmdeploy_lite.messages import GenerationConfig
from lmdeploy_lite.pytorch.engine.block_manager import BlockManager
from lmdeploy_lite.pytorch.engine.scheduler import Scheduler
from lmdeploy_lite.pytorch.engine.sequence import SeqStatus, Sequence


def make_scheduler(num_blocks=64, block_size=4, max_batch=8, budget=32, session_len=64,
                   lookahead=0, extra=0, mixed=0):
    bm = BlockManager(num_blocks, block_size, max_batch + 1)
    return Scheduler(bm, max_batch, budget, session_len, num_spec_tokens=lookahead,
                     num_draft_extra=extra, max_mixed_token_num=mixed)


def add(sched, prompt_len, max_new=4, seq_id=[0]):
    seq_id[0] += 1
    seq = Sequence(seq_id[0], list(range(1, prompt_len + 1)), prompt_len,
                   GenerationConfig(max_new_tokens=max_new), arrival=0)
    sched.add(seq)
    return seq


def run_step(sched, token=7, seen=None):
    """Schedule and apply one step; `seen` collects (seqs, q_lens, decode rows, sample mask) as
    scheduled (the mask changes once the step is applied)."""
    batch = sched.schedule()
    assert batch is not None
    if seen is not None:
        seen.append((batch.seqs, batch.q_lens, batch.num_decode_rows, batch.sample_mask))
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


def test_mixed_step_carries_decode_rows_and_a_chunk_under_the_budget():
    sched = make_scheduler(budget=32, mixed=8)
    a, b = add(sched, 3, max_new=20), add(sched, 4, max_new=20)
    first = run_step(sched)                           # nothing decodes: the whole budget
    assert first.q_lens == [3, 4] and not first.is_decoding
    long = add(sched, 20)
    steps = []
    while not long.prefilled:
        run_step(sched, seen=steps)
    # decode rows (1 token each, sampling) count against the budget of 8; the chunk takes 6
    assert steps == [([a, b, long], [1, 1, 6], 2, [True, True, False]),
                     ([a, b, long], [1, 1, 6], 2, [True, True, False]),
                     ([a, b, long], [1, 1, 6], 2, [True, True, False]),
                     ([a, b, long], [1, 1, 2], 2, [True, True, True])]
    decode = run_step(sched)
    assert decode.is_decoding and decode.seqs == [a, b, long]


def test_mixed_budget_never_exceeds_max_prefill_token_num():
    sched = make_scheduler(budget=4, mixed=100)
    a = add(sched, 3, max_new=20)
    run_step(sched)
    long = add(sched, 10)
    assert run_step(sched).q_lens == [1, 3]
    assert long.num_computed == 3


def test_mixing_off_runs_the_whole_prefill_first():
    sched = make_scheduler(budget=32, mixed=0)
    a = add(sched, 3, max_new=20)
    run_step(sched)
    long = add(sched, 20)
    batch = run_step(sched)
    assert batch.seqs == [long] and batch.q_lens == [20]


def test_speculation_alternates_decode_and_chunk_steps():
    sched = make_scheduler(budget=32, mixed=16, lookahead=3)
    a = add(sched, 3, max_new=40)
    run_step(sched)
    long = add(sched, 30)
    kinds = []
    while not long.prefilled:
        batch = run_step(sched)
        kinds.append(('decode', batch.seqs) if batch.is_decoding else ('chunk', batch.q_lens))
    # a chunk step carries at most 16 tokens
    assert kinds == [('decode', [a]), ('chunk', [16]), ('decode', [a]), ('chunk', [14])]
    assert run_step(sched).seqs == [a, long]


def test_mixed_steps_under_cache_pressure_repeat_no_row_and_free_everything():
    # a small cache: chunks riding with decode rows preempt later arrivals, decode rows included
    rng = random.Random(1)
    sched = make_scheduler(num_blocks=10, block_size=4, max_batch=4, budget=8, session_len=16,
                           mixed=6)
    seqs, mixed_steps = [], 0
    for i in range(300):
        if rng.random() < 0.4:
            seqs.append(add(sched, rng.randint(1, 12), max_new=rng.randint(1, 4)))
        if sched.has_work:
            seen = []
            run_step(sched, seen=seen)
            (rows, q_lens, num_decode_rows, _), = seen
            assert len({id(s) for s in rows}) == len(rows)
            assert sum(q_lens) <= 6 or num_decode_rows == 0
            mixed_steps += 0 < num_decode_rows < len(rows)
    while sched.has_work:
        run_step(sched)
    assert mixed_steps > 10
    assert all(s.is_finished for s in seqs)
    assert sched.bm.num_free_blocks == sched.bm.num_usable_blocks
    assert len(sched.bm.free_slots) == sched.bm.num_state_slots - 1
