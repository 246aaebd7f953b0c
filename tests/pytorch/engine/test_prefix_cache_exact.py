"""Prefix caching never changes a token, and hits where the rule says (issue 21, acceptance).

Multi-turn prompt sets run one request after another through one engine (so each finds the
blocks and state snapshots of those before it): a chat turn extends an earlier prompt and its
answer, a prompt shares part of an earlier one and diverges mid-block, a prompt repeats an
earlier one or adds one token to it, a prompt is shorter than a block; then some run together
in one batch. Greedy float64 output with the cache on equals the cache off and transformers, on
tiny random dense and MoE checkpoints, plain and under MTP k=3, with chunked prefill, async
scheduling, preemption forced by a tiny block budget, and dp=2 ep=2 (the DP front-end routes a
request to the rank holding its prefix). Every request's num_cached_tokens equals what
tests/helpers/prefix_rule.py computes from the tokens alone. The tiny random MTP heads accept
almost nothing, so the embedded model (whose MTP head does accept) checks that a cached prefix
leaves the draft's KV exactly as a fresh prefill writes it: the same tokens AND the same
per-request accepted counts with the cache on and off.
"""
import random
import time

import pytest

from lmdeploy_lite import GenerationConfig, PytorchEngineConfig, SpeculativeConfig, pipeline
from lmdeploy_lite.pytorch.engine.build import build_engine
from lmdeploy_lite.pytorch.engine.engine import Engine
from tests.helpers import accepting
from tests.helpers.prefix_rule import PrefixRule
from tests.helpers.reference import hf_generate

BASE = dict(dtype='float64', device='cpu', block_size=4, session_len=96)
GEN = GenerationConfig(max_new_tokens=8, ignore_eos=True)
MTP3 = SpeculativeConfig(method='qwen3_5_mtp', num_speculative_tokens=3, dynamic=False)
# the embedded model's runs: 16 new tokens (accepting.GREEDY's 24 less a third of the steps);
# the prompts below take at most 13 tokens of an answer, and MTP k=3 still accepts well above
# accepting's floor on them (mean accepted length ~2.9)
EMBEDDED_GEN = GenerationConfig(max_new_tokens=16, ignore_eos=True)


def scenario(answer_of, seed: int = 21) -> tuple[list[list[int]], list[list[int]]]:
    """(prompts run one after another, prompts then run together in one batch), block size 4.
    `answer_of(prompt)`: its greedy answer, which a chat turn extends."""
    rng = random.Random(seed)

    def fresh(n: int) -> list[int]:
        return [rng.randrange(3, 500) for _ in range(n)]
    first = fresh(18)                                  # prompt end point 16
    chat = first + answer_of(first) + fresh(5)         # a chat turn: prompt + answer + more
    fork = first[:10] + fresh(8)                       # shares 10 tokens, diverges mid-block
    aligned = fresh(16)                                # a whole number of blocks
    long = fresh(30)                                   # prompt end point 28
    sequential = [
        first,
        chat,
        fork,                                  # no snapshot inside its 10 shared tokens: 0
        first[:10] + fresh(9),                 # fork's branch point (8) kept a snapshot
        list(chat),                            # an exact repeat
        chat + fresh(1),                       # an earlier prompt plus one token
        fresh(3),                              # shorter than one block
        first[:16] + fresh(4),                 # first's 16 tokens: under MTP the next differs
        aligned,
        aligned + fresh(1),                    # its 16 tokens are cached, its snapshot is at 12
        list(aligned),
        long,
        long[:26] + fresh(3),                  # 0; chunked: a chunk of `long` ended at 24
    ]
    second = chat + answer_of(chat) + fresh(6)     # the second turn of the conversation
    sequential.append(second)
    batch = [second + answer_of(second) + fresh(2), first[:10] + fresh(7), fresh(3), list(fork),
             aligned + fresh(5)]
    return sequential, batch


def hf_answer(moe: bool):
    return lambda prompt: hf_generate(moe, tuple(prompt), GEN.max_new_tokens)


def run_scenario(engine: Engine, sequential, batch, gen=GEN):
    """Each of `sequential` alone, in order, then `batch` together: the Sequences."""
    seqs = [engine.generate([p], gen)[0] for p in sequential]
    return seqs + engine.generate(batch, gen)


def expected_cached(rule: PrefixRule, sequential, batch, answers) -> list[int]:
    n = len(sequential)
    hits = [rule.run(p, a) for p, a in zip(sequential, answers[:n])]
    return hits + rule.batch(batch, answers[n:])


# scenario()'s hits as the rule gives them (the prompts' comments say why), by (MTP, chunked):
# under MTP a block key names the token after the block, so `first[:16] + ...` and
# `aligned + ...` (another 17th token) cannot take the snapshot at 16; chunks of 6 keep
# snapshots at 12 and 24 as well
HITS = {
    (False, False): [0, 16, 0, 8, 28, 28, 0, 16, 0, 12, 12, 0, 0, 28] + [44, 8, 0, 16, 16],
    (False, True): [0, 16, 0, 8, 28, 28, 0, 16, 0, 12, 12, 0, 24, 28] + [44, 8, 0, 16, 16],
    (True, False): [0, 16, 0, 8, 28, 28, 0, 8, 0, 12, 12, 0, 0, 28] + [44, 8, 0, 16, 12],
    (True, True): [0, 16, 0, 8, 28, 28, 0, 12, 0, 12, 12, 0, 24, 28] + [44, 8, 0, 16, 12],
}
VARIANTS = {
    'plain': (dict(), None),
    'chunked': (dict(max_prefill_token_num=6), None),      # chunk ends on and off blocks
    'async': (dict(async_scheduling=True), None),
    'mtp3': (dict(), MTP3),
    'mtp3_chunked_async': (dict(max_prefill_token_num=6, async_scheduling=True), MTP3),
}


# every variant on the dense checkpoint; the MoE one without the single-feature variants that
# mtp3_chunked_async covers together (the suite's time)
CASES = [(False, v) for v in VARIANTS] + [(True, v) for v in ('plain', 'chunked',
                                                              'mtp3_chunked_async')]


@pytest.mark.parametrize('moe, variant', CASES,
                         ids=[f"{'moe' if m else 'dense'}-{v}" for m, v in CASES])
def test_multi_turn_output_is_exact_and_cached_tokens_follow_the_rule(moe, variant, tiny_ckpt):
    overrides, spec = VARIANTS[variant]
    path = tiny_ckpt(moe, layout='plain')
    sequential, batch = scenario(hf_answer(moe))
    prompts = sequential + batch
    want = [hf_answer(moe)(p) for p in prompts]
    cached = build_engine(path, PytorchEngineConfig(**BASE, **overrides), spec, progress=False)
    uncached = build_engine(path, PytorchEngineConfig(**BASE, **overrides, enable_prefix_caching=False),
                      spec, progress=False)
    on = run_scenario(cached, sequential, batch)
    off = run_scenario(uncached, sequential, batch)
    assert [s.generated_ids for s in on] == want
    assert [s.generated_ids for s in off] == want
    chunk = overrides.get('max_prefill_token_num')
    expected = expected_cached(PrefixRule(4, lookahead=spec is not None, chunk=chunk),
                               sequential, batch, want)
    assert expected == HITS[spec is not None, chunk is not None]
    assert [s.num_cached_tokens for s in on] == expected
    assert all(s.num_cached_tokens == 0 for s in off)
    if overrides.get('async_scheduling'):
        assert cached.num_continued_steps > 0, 'no step was launched ahead of the host'
    bm = cached.scheduler.bm
    bm.check()
    assert bm.num_free_blocks == bm.num_usable_blocks and len(bm.snapshots) < bm.snapshots.size


@pytest.mark.parametrize('spec', [None, MTP3], ids=['plain', 'mtp3'])
@pytest.mark.parametrize('moe', [False, True], ids=['dense', 'moe'])
def test_preemption_by_a_tiny_block_budget(moe, spec, tiny_ckpt, monkeypatch):
    """A first request alone, then four sharing its prefix at once in 20 usable blocks of 4
    tokens: every one of the four takes the first's 16 cached tokens at admission, their growth
    preempts the later arrivals (recomputed from what the cache then holds), and every output
    is still transformers' (a preempted request's recompute takes what the cache holds of it)."""
    rng = random.Random(5)
    first = [rng.randrange(3, 500) for _ in range(18)]
    sharing = [first[:17] + [rng.randrange(3, 500) for _ in range(3 + i)] for i in range(4)]
    gen = GenerationConfig(max_new_tokens=24, ignore_eos=True)
    engine = build_engine(tiny_ckpt(moe, layout='plain'),
                    PytorchEngineConfig(**dict(BASE, session_len=48), num_gpu_blocks=21),
                    spec, progress=False)
    seqs = engine.generate([first], gen) + engine.generate(sharing, gen)
    assert engine.scheduler.num_preemptions, 'the block budget forced no preemption'
    want = [hf_generate(moe, tuple(p), 24) for p in [first] + sharing]
    assert [s.generated_ids for s in seqs] == want
    rule = PrefixRule(4, lookahead=spec is not None)
    assert [s.num_cached_tokens for s in seqs] == [rule.run(first, want[0])] + rule.batch(
        sharing, want[1:])
    assert [s.num_cached_tokens for s in seqs] == [0, 16, 16, 16, 16]
    bm = engine.scheduler.bm
    assert bm.stats.hit_tokens > sum(s.num_cached_tokens for s in seqs), \
        'no preempted request was re-admitted from the cache'
    bm.check()
    assert bm.num_free_blocks == bm.num_usable_blocks


def test_embedded_mtp_draft_kv_from_the_cache_is_a_fresh_prefills():
    """The embedded model, whose MTP head accepts: with k=3 the multi-turn set gives plain
    greedy tokens and the same accepted counts per request with the cache on as off (float64:
    a cached block's draft KV and a restored state are exactly what a fresh prefill writes)."""
    cfg = dict(accepting.BASE, block_size=4)
    plain = build_engine(accepting.model_dir(), PytorchEngineConfig(**cfg, enable_prefix_caching=False),
                   progress=False)

    answers = {}

    def answer_of(*prompts):
        """Plain greedy answers, the prompts not yet answered run together in one batch (the
        tokens a prompt gets alone: test_engine.py's alone-vs-batched check)."""
        todo = list(dict.fromkeys(tuple(p) for p in prompts if tuple(p) not in answers))
        if todo:
            seqs = plain.generate([list(p) for p in todo], EMBEDDED_GEN)
            answers.update((p, s.generated_ids) for p, s in zip(todo, seqs))
        return [answers[tuple(p)] for p in prompts]
    p0, p1, p2, p3 = (list(p) for p in accepting.prompts())
    a0, a3 = answer_of(p0, p3)
    chat = p0 + a0 + p1                                     # 32 tokens, prompt end point 28
    sequential = [
        p0, chat, p0 + a0[:13] + p2, list(chat),
        chat[:28] + p2, chat[:28] + p3,         # its 28 tokens, another next token: not at 28
        p3, p3 + a3[:6],
        # 12 tokens of the one before, then another: a block key without the next token would
        # reuse a draft KV entry computed from a3[4] (and its accepted counts would differ)
        p3 + a3[:4] + p0,
    ]
    batch = [p0 + a0[:13] + p3, list(chat), p3 + a3[:6] + p1, p0[:8] + p1]
    answer_of(*sequential, *batch)
    sequential.append(chat + answer_of(chat)[0][:9])
    want = answer_of(*sequential, *batch)
    runs = {}
    for caching in (True, False):
        engine = build_engine(accepting.model_dir(),
                        PytorchEngineConfig(**cfg, enable_prefix_caching=caching),
                        accepting.spec(3), progress=False)
        runs[caching] = run_scenario(engine, sequential, batch, EMBEDDED_GEN)
    on, off = runs[True], runs[False]
    accepting.assert_real_acceptance([s.spec_stats for s in on], 3)
    accepting.assert_real_acceptance([s.spec_stats for s in off], 3)
    assert [s.generated_ids for s in on] == want
    assert [s.generated_ids for s in off] == want
    assert [accepting.counts(s.spec_stats) for s in on] == [
        accepting.counts(s.spec_stats) for s in off]
    rule = PrefixRule(4, lookahead=True)
    assert [s.num_cached_tokens for s in on] == expected_cached(rule, sequential, batch, want)
    assert sum(s.num_cached_tokens > 0 for s in on) > len(on) // 2


@pytest.fixture
def strict_collectives(monkeypatch):
    monkeypatch.setenv('LMDEPLOY_LITE_CHECK_COLLECTIVES', '1')     # always on in tests
    monkeypatch.setenv('LMDEPLOY_LITE_DIST_TIMEOUT', '20')


@pytest.mark.timeout(240)
def test_dp2_ep2_sends_a_shared_prefix_to_the_rank_that_holds_it(tiny_ckpt, strict_collectives):
    """dp=2 ep=2 (MoE, mp executor, collective trace check on): two first requests land one on
    each rank (the least loaded); then requests sharing either one's prefix go to the rank
    holding it, which their num_cached_tokens shows (the other rank has none of it)."""
    rng = random.Random(9)

    def fresh(n: int) -> list[int]:
        return [rng.randrange(3, 500) for _ in range(n)]
    left, right = fresh(14), fresh(18)
    sharing = [right[:17] + fresh(3), left[:13] + fresh(6), right[:17] + fresh(5),
               right + fresh(2), left[:13] + fresh(4)]
    start = time.monotonic()
    config = PytorchEngineConfig(**BASE, dp=2, ep=2)
    with pipeline(tiny_ckpt(True, layout='plain'), config, progress=False) as pipe:
        first = pipe([left, right], GEN)
        then = pipe(sharing, GEN)
    assert time.monotonic() - start < 200
    want = [hf_generate(True, tuple(p), GEN.max_new_tokens) for p in [left, right] + sharing]
    assert [list(r.token_ids) for r in first + then] == want
    rule = PrefixRule(4)
    expected = rule.batch([left, right], want[:2]) + rule.batch(sharing, want[2:])
    assert expected == [0, 0, 16, 12, 16, 16, 12]
    assert [r.num_cached_tokens for r in first + then] == expected


@pytest.mark.timeout(240)
def test_dp2_ep2_mtp3_embedded_hits_change_neither_tokens_nor_acceptance(strict_collectives):
    """The same routing with the embedded model's MTP k=3 (drafts accepted): the requests that
    take a cached prefix on their rank give plain greedy tokens and the accepted counts of a
    single process without the cache, and hit what the rule (with the next token) says."""
    cfg = dict(accepting.BASE, block_size=4)
    p0, p1, p2, p3 = (list(p) for p in accepting.prompts())
    a0, a3 = accepting.reference(0, [p0, p3], EMBEDDED_GEN, block_size=4).token_ids
    # requests sharing p0 (prompt end point 8) diverge from each other within 12 tokens, those
    # sharing p3 (4) within 8, so no request's hit depends on when its peers ran
    sharing = [p0 + a0[:13] + p1, p3 + a3[:9] + p2, p0 + a0[:2] + p2, p3 + p1, p0 + p3]
    start = time.monotonic()
    with pipeline(accepting.model_dir(), PytorchEngineConfig(**cfg, dp=2, ep=2),
                  accepting.spec(3), progress=False) as pipe:
        first = pipe([p0, p3], EMBEDDED_GEN)
        then = pipe(sharing, EMBEDDED_GEN)
    assert time.monotonic() - start < 200
    accepting.assert_real_acceptance([r.spec_stats for r in first + then], 3)
    plain = accepting.reference(0, sharing, EMBEDDED_GEN, block_size=4, enable_prefix_caching=False)
    fresh = accepting.reference(3, sharing, EMBEDDED_GEN, block_size=4, enable_prefix_caching=False)
    assert [list(r.token_ids) for r in first] == [a0, a3]
    assert [list(r.token_ids) for r in then] == plain.token_ids
    assert [accepting.counts(r.spec_stats) for r in then] == fresh.counts
    rule = PrefixRule(4, lookahead=True)
    expected = rule.batch([p0, p3], [a0, a3]) + rule.batch(sharing, plain.token_ids)
    assert all(hit > 0 for hit in expected[2:])
    assert [r.num_cached_tokens for r in first + then] == expected
