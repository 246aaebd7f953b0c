"""Prefill rides with decode (PytorchEngineConfig.max_mixed_token_num): a prompt that arrives
while others decode is prefilled in chunks that share steps with the running sequences' decode
rows (plain decoding), or in chunk steps alternating with decode steps (speculation). It must
change no token: requests arriving at different steps, prompts prefilled in small chunks, give
the whole sequences (and, under speculation, the per-request draft counts) of the run that
prefilled them all at once, in float64 on the embedded model; mixed steps really happen; and a
running stream is never left out of more than one step while the long prompt is prefilled."""
import pytest

from lmdeploy_lite.messages import PytorchEngineConfig
from lmdeploy_lite.pytorch.engine.build import build_engine
from tests.helpers import accepting
from tests.helpers.accepting import GREEDY, assert_real_acceptance, counts, reference

CFG = dict(session_len=256, max_prefill_token_num=16)
ARRIVE_AT_STEP = (0, 0, 3, 6, 6)     # per prompt (the long one third): the step it is added before


def _prompts() -> list[list[int]]:
    """The four code prompts and, third, a long one (~60 tokens): two prompts with their greedy
    continuations, which the MTP head drafts well."""
    short = [list(p) for p in accepting.prompts()]
    plain = reference(0).token_ids
    long = short[0] + plain[0] + short[1] + plain[1]
    return short[:2] + [long] + short[2:]


def _run(k: int, graphs: dict | None = None, **cfg):
    """Add the prompts at ARRIVE_AT_STEP and run to the end. Returns the sequences, and per step
    (rows that had finished their prefill, rows) as scheduled and the sequences that emitted.
    `graphs`: the agent's graph runners are enabled with these arguments (CPU: static buffers)."""
    config = PytorchEngineConfig(**{**accepting.BASE, **CFG, **cfg})
    engine = build_engine(accepting.model_dir(), config, accepting.spec(k), progress=False)
    if graphs is not None:
        engine.agent.enable_graphs([2, 4, 8], **graphs)
    _run.engine = engine
    scheduled, schedule = [], engine.scheduler.schedule

    def recording():
        batch = schedule()
        if batch is not None:
            scheduled.append((batch.num_decode_rows, len(batch.seqs)))
        return batch
    engine.scheduler.schedule = recording
    prompts, seqs, emitted, step = _prompts(), {}, [], 0
    while engine.has_work or len(seqs) < len(prompts):
        for i, at in enumerate(ARRIVE_AT_STEP):
            if at == step:
                seqs[i] = engine.add_request(prompts[i], GREEDY)
        emitted.append({out.seq.seq_id for out in engine.step() if out.new_token_ids})
        step += 1
    return [seqs[i] for i in range(len(prompts))], scheduled, emitted


def _assert_no_stall(seqs, emitted, max_gap: int):
    """Each sequence emits at least once every `max_gap` steps from its first token to its last."""
    for seq in seqs:
        steps = [i for i, ids in enumerate(emitted) if seq.seq_id in ids]
        gaps = [b - a for a, b in zip(steps, steps[1:])]
        assert max(gaps) <= max_gap, f'sequence {seq.seq_id} waited {max(gaps)} steps: {steps}'


@pytest.mark.parametrize('k', [0, 3])
def test_mixed_steps_change_no_token(k):
    mixed, scheduled, emitted = _run(k, max_mixed_token_num=12)
    if k:
        assert_real_acceptance([s.spec_stats for s in mixed], k)
    everything_at_once = reference(k, _prompts(), **CFG)       # one batch, prefilled together
    assert everything_at_once.token_ids == reference(0, _prompts(), **CFG).token_ids
    assert [s.generated_ids for s in mixed] == everything_at_once.token_ids
    assert all(s.num_generated == GREEDY.max_new_tokens for s in mixed)
    if k:
        assert [counts(s.spec_stats) for s in mixed] == everything_at_once.counts
    if k == 0:      # steps carried decode rows and prefill chunks together
        assert sum(0 < d < n for d, n in scheduled) >= 4, scheduled
    else:           # chunk steps while sequences decode (between decode steps)
        chunk_steps = [d == 0 for d, _ in scheduled]
        assert sum(chunk_steps[3:]) >= 4, scheduled
    # the long prompt (60 tokens, chunks of at most 12 less the decode rows) took several steps
    # while the first two decoded; neither waited more than one step for a token
    _assert_no_stall(mixed[:2], emitted, max_gap=1 if k == 0 else 2)
    _assert_no_stall(mixed[2:], emitted, max_gap=1 if k == 0 else 2)


@pytest.mark.parametrize('prefix_caching', [False, True])
def test_async_mixed_steps_change_no_token(prefix_caching, monkeypatch):
    """Async scheduling holds a mixed step and schedules the next one before its results
    (Scheduler.continue_mixed: the decode rows' tokens read on the device, the chunks'
    bookkeeping applied at once): the whole sequences equal the reference's, no stream stalls,
    and continued mixed steps really ran. With the prefix cache (blocks of 8), chunks end at
    block boundaries and their states are saved as they go."""
    from lmdeploy_lite.pytorch.engine.scheduler import Scheduler
    continued, continue_mixed = [], Scheduler.continue_mixed

    def spy(scheduler, batch):
        nxt = continue_mixed(scheduler, batch)
        continued.append(nxt is not None and 0 < nxt.decoding < len(nxt.seqs))
        return nxt
    monkeypatch.setattr(Scheduler, 'continue_mixed', spy)
    cache = dict(block_size=8, enable_prefix_caching=True) if prefix_caching else {}
    seqs, scheduled, emitted = _run(0, max_mixed_token_num=8, async_scheduling=True, **cache)
    assert [s.generated_ids for s in seqs] == reference(0, _prompts(), **CFG).token_ids
    assert sum(continued) >= 3, continued
    # a held step's tokens come one step late: two steps apart where a synchronous step
    # (a prompt's last chunk, a new arrival) hands over to a held one
    _assert_no_stall(seqs, emitted, max_gap=2)


@pytest.mark.parametrize('budget, graphs', [(8, False), (64, False), (12, True)])
def test_arrivals_and_prompt_ends_never_wait_for_the_host(budget, graphs, monkeypatch):
    """Async scheduling, prompts arriving while streams decode: the in-flight decode step is
    continued into a mixed step that takes them in (its rows' tokens read on the device), a
    mixed step whose chunk ends a prompt is held like any other, and the step after it decodes
    that prompt's first token from the device before the host has seen it. Whole sequences equal
    the reference's; each path really ran; with `graphs`, through the graph runners' static
    buffers (CPU), which both replayed."""
    from lmdeploy_lite.pytorch.engine.scheduler import Scheduler
    seen = {'into_mixed': 0, 'held_ends': 0, 'to_decode': 0}
    into, holds, cont = (Scheduler._continue_into_mixed, Scheduler.holds_mixed,
                         Scheduler.continue_mixed)

    def into_spy(scheduler, batch):
        nxt = into(scheduler, batch)
        seen['into_mixed'] += nxt is not None
        return nxt

    def holds_spy(scheduler, batch):
        held = holds(scheduler, batch)
        seen['held_ends'] += held and any(batch.sample_mask[batch.decoding:])
        return held

    def cont_spy(scheduler, batch):
        nxt = cont(scheduler, batch)
        seen['to_decode'] += nxt is not None and nxt.is_decoding
        return nxt
    monkeypatch.setattr(Scheduler, '_continue_into_mixed', into_spy)
    monkeypatch.setattr(Scheduler, 'holds_mixed', holds_spy)
    monkeypatch.setattr(Scheduler, 'continue_mixed', cont_spy)
    buffers = dict(max_blocks=20, prefill_buckets=[8, 16], max_prefill_q_len=8)
    seqs, _, emitted = _run(0, buffers if graphs else None, max_mixed_token_num=budget,
                            async_scheduling=True)
    assert [s.generated_ids for s in seqs] == reference(0, _prompts(), **CFG).token_ids
    assert all(seen.values()), seen
    _assert_no_stall(seqs, emitted, max_gap=2)
    if graphs:
        agent = _run.engine.agent
        assert agent.prefill_graph.num_replays > 0 and agent.graphs[1].num_replays > 0


def test_async_arrivals_of_every_kind_give_the_sync_tokens():
    """Prompts arriving beside two greedy streams under async scheduling, each kind its own:
    seeded sampling with logprobs (taken in by a continued step), one new token (it ends at
    its first token, which a held step's successor has already fed), n = 2 sharing a prefill
    and a penalised one (the host waits for those): every request's tokens and logprobs equal
    the synchronous engine's."""
    import dataclasses

    prompts = _prompts()
    arrivals = [(0, prompts[0], GREEDY), (0, prompts[1], GREEDY),
                (2, prompts[3], dataclasses.replace(GREEDY, do_sample=True, random_seed=7,
                                                    logprobs=2)),
                (3, prompts[4], dataclasses.replace(GREEDY, max_new_tokens=1)),
                (4, prompts[0], dataclasses.replace(GREEDY, n=2)),
                (6, prompts[1], dataclasses.replace(GREEDY, repetition_penalty=1.3))]

    def run(async_scheduling: bool):
        config = PytorchEngineConfig(**{**accepting.BASE, **CFG}, max_mixed_token_num=24,
                                     async_scheduling=async_scheduling)
        engine = build_engine(accepting.model_dir(), config, None, progress=False)
        seqs, outs, step = [], {}, 0
        while engine.has_work or step <= arrivals[-1][0]:
            for at, prompt, gen in arrivals:
                if at == step:
                    seqs += engine.add_group(prompt, gen)
            for out in engine.step():
                outs.setdefault(out.seq.seq_id, []).append((out.new_token_ids, out.logprobs))
            step += 1
        tokens = [s.generated_ids for s in seqs]
        return tokens, [[o for o in outs[s.seq_id] if o[0]] for s in seqs], engine
    sync_tokens, sync_outs, _ = run(False)
    tokens, outs, engine = run(True)
    assert tokens == sync_tokens and len(tokens[3]) == 1
    # the same logprobs and top ids; values to float64 rounding (prompts may be chunked
    # differently: the async engine takes a prompt in while the sync one is still applying)
    entries = [[lp for seq_outs in o for _, lps in seq_outs if lps for lp in lps]
               for o in (outs, sync_outs)]
    assert len(entries[0]) == len(entries[1]) > 0
    assert [e[1] for e in entries[0]] == [e[1] for e in entries[1]]
    values = [[x for e in es for x in (e[0], *e[2])] for es in entries]
    assert values[0] == pytest.approx(values[1], abs=1e-9)
    assert engine.num_continued_steps > 0


def test_a_continued_step_feeds_each_decode_row_its_rows_token():
    """`make_next_mixed_inputs`: the decode rows of a step scheduled before the results of the
    one it follows read the tokens of their rows there (`prev_rows`, in any order: a prompt
    that ended behind a chunk that did not), at one past the host's count for a row that
    decoded there and at the prompt's end for one whose prompt ended; chunks from the host."""
    from types import SimpleNamespace

    import torch

    from lmdeploy_lite.pytorch.engine.scheduler import ScheduledBatch
    from lmdeploy_lite.pytorch.strategies.base import Strategy

    def seq(computed, prefilled, slot):
        return SimpleNamespace(token_ids=list(range(100, 110)), num_computed=computed,
                               prefilled=prefilled, blocks=[slot], state_slot=slot)
    streaming, ended, chunked = seq(7, True, 1), seq(10, False, 2), seq(4, False, 3)
    batch = ScheduledBatch([streaming, ended, chunked], [1, 1, 3], is_decoding=False,
                           decoding=2, prev_rows=[0, 2])
    result = SimpleNamespace(output_tokens=torch.tensor([[11], [12], [13]]))
    inputs = Strategy().make_next_mixed_inputs(batch, result, 'cpu')
    assert inputs.input_ids.tolist() == [11, 13, 104, 105, 106]
    assert inputs.positions.tolist() == [8, 10, 4, 5, 6]


def test_the_step_that_hands_out_tokens_launches_a_held_mixed_step():
    """Async scheduling, a prompt arriving while two streams decode: the step that applies the
    in-flight decode step (it cannot be continued: a request waits) hands out its tokens and
    launches the first mixed step, which it holds (Engine.next_batch: only a step the host
    waits for runs a step later), so the device does not idle through a step of host work."""
    config = PytorchEngineConfig(**{**accepting.BASE, **CFG}, max_mixed_token_num=8,
                                 async_scheduling=True)
    engine = build_engine(accepting.model_dir(), config, None, progress=False)
    prompts = _prompts()
    streams = [engine.add_request(p, GREEDY) for p in prompts[:2]]
    while engine.in_flight is None or not engine.in_flight.batch.is_decoding:
        engine.step()
    engine.add_request(prompts[2], GREEDY)
    outputs = engine.step()
    assert {o.seq.seq_id for o in outputs if o.new_token_ids} == {s.seq_id for s in streams}
    held = engine.in_flight.batch
    assert 0 < held.num_decode_rows < len(held.seqs) and engine.next_batch is None


def test_without_mixing_the_long_prompt_stalls_the_streams():
    """The other side of the no-stall check: prefill first stalls the running streams for the
    long prompt's whole prefill (several chunks of max_prefill_token_num)."""
    seqs, scheduled, emitted = _run(0, max_mixed_token_num=0)
    assert [s.generated_ids for s in seqs] == reference(0, _prompts(), **CFG).token_ids
    assert not any(0 < d < n for d, n in scheduled)
    with pytest.raises(AssertionError, match='waited'):
        _assert_no_stall(seqs[:2], emitted, max_gap=1)


@pytest.mark.parametrize('k, long_rows', [(0, False), (3, False), (0, True)])
def test_prefill_graph_buffers_change_no_token(k, long_rows, monkeypatch):
    """Prefill and mixed steps through the prefill graph runner's static buffers (CPU: the same
    copies and padding as the CUDA graphs, run eagerly): token buckets 8 and 16, chunks of at
    most 8 or 10 tokens a sequence (longer ones run eagerly; with `long_rows`, one longer chunk
    a step replays, and the longest chunk over 4 tokens is the step's `long_row`), spare tokens
    on dummy sequences. Whole sequences and draft counts equal the reference's; both paths
    ran, buckets of both sizes in sequences (k = 0: 4 or 5 sequences a step)."""
    from lmdeploy_lite.pytorch.backends.cuda import graph_runner
    from lmdeploy_lite.pytorch.backends.cuda.graph_runner import PrefillGraphRunner
    monkeypatch.setattr(graph_runner, 'SMALL_BATCH', 4)        # buckets of 5 and of 9 sequences
    replayed, pad, replay, sizes = [], PrefillGraphRunner._pad, PrefillGraphRunner._replay, set()

    def padding(runner, bucket, seqs, tokens, batch):    # the real rows of the step replayed
        pad(runner, bucket, seqs, tokens, batch)
        replayed.append([runner.q_lens[:batch].tolist()])

    def replaying(runner, key, rows):                # with its long row, if it has one
        replayed[-1].append(int(runner.long_row) if key[2] else None)
        sizes.add(key[1])
        return replay(runner, key, rows)
    monkeypatch.setattr(PrefillGraphRunner, '_pad', padding)
    monkeypatch.setattr(PrefillGraphRunner, '_replay', replaying)
    # a cap that some chunks pass (k = 3: chunk steps carry no decode rows, so longer chunks)
    cap = 10 if k else 8
    seqs, scheduled, _ = _run(k, dict(max_blocks=20, prefill_buckets=[8, 16],
                                      max_prefill_q_len=cap, long_row_from=4 * long_rows),
                              max_mixed_token_num=12)
    agent = _run.engine.agent.target if k else _run.engine.agent
    runner = agent.prefill_graph
    decode = _run.engine.agent.step_graphs[k] if k else agent.graphs[1]   # greedy: whole steps
    assert runner.num_replays >= 3 and decode.num_replays > 0
    assert len(sizes) == (1 if k else 2), (sizes, runner.seqs)     # k = 3: 2 sequences a step
    prefill_steps = sum(d < n for d, n in scheduled)
    if long_rows:       # every step replayed (one chunk at most passes the cap), some as long rows
        assert prefill_steps == runner.num_replays, (prefill_steps, runner.num_replays)
        assert any(max(q) > cap for q, _ in replayed), replayed
        for q, row in replayed:       # the longest chunk where one passes 4, else none
            assert row == (q.index(max(q)) if max(q) > 4 else None), replayed
    else:
        assert prefill_steps > runner.num_replays, (prefill_steps, runner.num_replays)
    everything_at_once = reference(k, _prompts(), **CFG)
    assert [s.generated_ids for s in seqs] == everything_at_once.token_ids
    if k:
        assert_real_acceptance([s.spec_stats for s in seqs], k)
        assert [counts(s.spec_stats) for s in seqs] == everything_at_once.counts
    else:
        assert sum(0 < d < n for d, n in scheduled) >= 4, scheduled
