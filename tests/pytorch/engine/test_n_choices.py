"""n choices per prompt share one prefill (issue 22, part 2).

The leader (choice 0) prefills the prompt but its last token; the members fork from it (shared
full blocks, a copy of the partial block and of the linear-attention state) and every choice
feeds the last prompt token itself. Each choice must be exactly the request run alone with its
derived seed (greedy: the single greedy output), float64 on CPU, with the prefix cache on and
off, under MTP k=3 (the embedded model, whose drafts get accepted), when a member is preempted,
aborted or stops early; the engine's prefill token counter shows (P - 1) + n tokens for a
fresh prompt of P tokens; dp=2 (mp) puts a group on one rank.
"""
import queue
import random
import time

import pytest
import torch

from lmdeploy_lite import GenerationConfig, PytorchEngineConfig, pipeline
from lmdeploy_lite.pytorch.engine.build import build_engine
from lmdeploy_lite.pytorch.engine.engine import Engine
from tests.helpers import accepting

BASE = dict(dtype='float64', device='cpu', block_size=4, session_len=64)
SAMPLED = dict(do_sample=True, temperature=0.9, ignore_eos=True)
RNG = random.Random(22)


def fresh(n: int) -> list[int]:
    """A prompt of n tokens no other test uses (no prefix cache hits)."""
    return [RNG.randrange(3, 500) for _ in range(n)]


@pytest.fixture(scope='module')
def dense(tiny_ckpt) -> str:
    return tiny_ckpt(False)


@pytest.fixture(scope='module')
def alone(dense):
    """alone(prompt, gen) -> the generated ids of the request run by itself (cache off)."""
    engine = build_engine(dense, PytorchEngineConfig(**BASE, enable_prefix_caching=False),
                    progress=False)

    def run(prompt: list[int], gen: GenerationConfig) -> list[int]:
        return engine.generate([prompt], gen)[0].generated_ids
    return run


def choice_gen(gen: GenerationConfig, i: int) -> GenerationConfig:
    """Choice i of `gen` as a request of its own (n=1, its derived seed)."""
    seed = None if gen.random_seed is None else (gen.random_seed + i) % 2**64
    return GenerationConfig(**{**gen.__dict__, 'n': 1, 'random_seed': seed})


def finish(engine: Engine, seqs) -> list[list[int]]:
    while engine.has_work:
        engine.step()
    engine.scheduler.bm.check()
    return [s.generated_ids for s in seqs]


@pytest.mark.parametrize('caching', [True, False], ids=['cache', 'no-cache'])
def test_choices_are_the_requests_alone_and_the_prompt_is_prefilled_once(dense, alone, caching):
    """Greedy: n equal choices, the single greedy output. Sampled with a seed: choice i is the
    request alone with seed + i (mod 2**64), the same on a repeat. The prompt's last block
    partial (18 tokens), full (17: its first 16 are shared whole), short (2) and of one token
    (nothing to share): (P - 1) + n prefill tokens each time."""
    engine = build_engine(dense, PytorchEngineConfig(**BASE, enable_prefix_caching=caching),
                    progress=False)
    greedy = GenerationConfig(max_new_tokens=6, ignore_eos=True, n=3)
    for length in (18, 17, 2, 1):
        prompt = fresh(length)
        before = engine.num_prefill_tokens
        seqs = engine.add_group(prompt, greedy)
        outputs = finish(engine, seqs)
        assert engine.num_prefill_tokens - before == length - 1 + 3, length
        assert outputs == [alone(prompt, choice_gen(greedy, 0))] * 3, length
    prompt = fresh(18)
    for seed in (11, 2**64 - 2):                 # choice 2 of the second wraps to seed 0
        sampled = GenerationConfig(max_new_tokens=6, n=3, random_seed=seed, **SAMPLED)
        first = finish(engine, engine.add_group(prompt, sampled))
        assert first == [alone(prompt, choice_gen(sampled, i)) for i in range(3)]
        assert len({tuple(o) for o in first}) == 3, 'the choices are not independent'
        assert finish(engine, engine.add_group(prompt, sampled)) == first


def test_waiting_members_hold_up_no_other_request(dense, alone):
    """While the leader's chunked prefill runs, a later request is admitted past its waiting
    members; the outputs are unchanged."""
    engine = build_engine(dense, PytorchEngineConfig(**BASE, max_prefill_token_num=12,
                                               max_mixed_token_num=0), progress=False)
    gen = GenerationConfig(max_new_tokens=4, n=3, random_seed=5, **SAMPLED)
    prompt, other = fresh(30), fresh(5)
    group = engine.add_group(prompt, gen)
    later = engine.add_request(other, choice_gen(gen, 0))
    overtaken = False
    while engine.has_work:
        engine.step()
        overtaken |= later.num_computed > 0 and group[1].fork.leader is not None
    assert overtaken, 'the later request waited for the group'
    engine.scheduler.bm.check()
    assert [s.generated_ids for s in group] == [alone(prompt, choice_gen(gen, i))
                                                for i in range(3)]
    assert later.generated_ids == alone(other, choice_gen(gen, 0))


def test_members_past_the_batch_limit_prefill_on_their_own(dense, alone):
    """max_batch_size=2: the leader forks one member; the other two prefill as ordinary
    requests once there is room (cache off: their whole prompt), and every choice is still
    the request alone."""
    engine = build_engine(dense, PytorchEngineConfig(**BASE, max_batch_size=2,
                                               enable_prefix_caching=False), progress=False)
    gen = GenerationConfig(max_new_tokens=4, n=4, random_seed=8, **SAMPLED)
    prompt = fresh(10)
    outputs = finish(engine, engine.add_group(prompt, gen))
    assert engine.num_prefill_tokens == (10 - 1 + 2) + 2 * 10
    assert outputs == [alone(prompt, choice_gen(gen, i)) for i in range(4)]


def test_closing_the_stream_aborts_every_choice(dense):
    """`Pipeline.generate` (the server's path) closed after its first responses: every choice
    ends 'abort' in the engine, none runs to its length, and no block leaks."""
    import asyncio
    import contextlib

    async def first_responses(pipe):
        gen = GenerationConfig(max_new_tokens=200, n=3, ignore_eos=True)
        async with contextlib.aclosing(pipe.generate(fresh(6), gen)) as responses:
            async for _ in responses:
                return list(pipe.engine.scheduler.running)
    with pipeline(dense, PytorchEngineConfig(**dict(BASE, session_len=256)),
                  progress=False) as pipe:
        seqs = asyncio.run(first_responses(pipe))
        for _ in range(200):
            if all(s.is_finished for s in seqs):
                break
            time.sleep(0.02)
        assert len(seqs) == 3 and [s.finish_reason for s in seqs] == ['abort'] * 3
        assert all(s.num_generated < 200 for s in seqs)
        pipe.engine.scheduler.bm.check()


def test_preempted_aborted_and_early_stopping_members(dense, alone, monkeypatch):
    """A tiny block budget preempts forked members (they prefill again on their own); an
    aborted member, a member aborted before its fork and a leader aborted before it (its members
    then prefill alone) leave the others exactly right; a member that stops early frees only
    its own blocks. BlockManager.check() holds throughout."""
    engine = build_engine(dense, PytorchEngineConfig(**dict(BASE, session_len=32), num_gpu_blocks=17),
                    progress=False)
    gen = GenerationConfig(max_new_tokens=14, n=4, random_seed=3, **SAMPLED)
    prompt = fresh(10)
    group = engine.add_group(prompt, gen)
    outputs = finish(engine, group)
    assert any(s.num_preemptions for s in group[1:]), 'no forked member was preempted'
    assert outputs == [alone(prompt, choice_gen(gen, i)) for i in range(4)]

    # aborts: member 1 after its fork, member 2 before it; then a leader before its fork
    gen = GenerationConfig(max_new_tokens=8, n=3, random_seed=9, **SAMPLED)
    prompt = fresh(9)
    group = engine.add_group(prompt, gen)
    engine.abort(group[2])
    while group[1].num_generated < 2:
        engine.step()
        engine.scheduler.bm.check()
    engine.abort(group[1])
    outputs = finish(engine, group)
    assert [s.finish_reason for s in group] == ['length', 'abort', 'abort']
    assert outputs[0] == alone(prompt, choice_gen(gen, 0))
    group = engine.add_group(fresh(9), gen)
    engine.step()
    assert group[0].num_computed and group[1].fork.leader is group[0]
    engine.abort(group[0])
    outputs = finish(engine, group)
    assert outputs[1:] == [alone(group[0].token_ids, choice_gen(gen, i)) for i in (1, 2)]

    # a stop token that ends choice 1 early (one of its tokens 1..3, not among the others' first 5)
    prompt = fresh(11)
    free = [alone(prompt, choice_gen(gen, i)) for i in range(3)]
    stop = next(t for t in free[1][1:4] if t not in free[0][:5] + free[2][:5])
    gen = GenerationConfig(**{**gen.__dict__, 'stop_token_ids': [stop]})
    outputs = finish(engine, engine.add_group(prompt, gen))
    assert outputs == [alone(prompt, choice_gen(gen, i)) for i in range(3)]
    assert len(outputs[1]) < max(len(outputs[0]), len(outputs[2]))


def test_mtp3_choices_on_the_embedded_model():
    """MTP k=3 on the embedded model (its drafts get accepted: asserted first): greedy choices
    are the plain greedy output; sampled choice i is the request alone with its seed (MTP k=3
    too: rejection sampling draws from the same generator in the same order)."""
    from lmdeploy_lite.messages import SpecDecodeStats
    engine = build_engine(accepting.model_dir(), PytorchEngineConfig(**accepting.BASE),
                    accepting.spec(3), progress=False)
    prompt = list(accepting.prompts()[0])
    greedy = GenerationConfig(**{**accepting.SHORT.__dict__, 'n': 3})      # 16 tokens
    seqs = engine.add_group(prompt, greedy)
    before = engine.num_prefill_tokens
    outputs = finish(engine, seqs)
    stats = SpecDecodeStats()
    for s in seqs:
        stats.merge(s.spec_stats)
    assert stats.mean_accepted_length >= accepting.MIN_MEAN_ACCEPTED_LENGTH[3], stats
    assert engine.num_prefill_tokens - before == len(prompt) - 1 + 3
    assert outputs == [accepting.reference(0, gen=accepting.SHORT).token_ids[0]] * 3  # (shared)
    sampled = GenerationConfig(max_new_tokens=16, n=2, random_seed=4, **SAMPLED)
    outputs = finish(engine, engine.add_group(prompt, sampled))
    assert outputs == [finish(engine, [engine.add_request(prompt, choice_gen(sampled, i))])[0]
                       for i in range(2)]


@pytest.mark.timeout(180)
def test_dp2_puts_a_group_on_one_rank(dense, alone):
    """dp=2 (mp executor): each group goes to one DP rank, the least loaded (a group counts n),
    and is prefilled once there: the ranks' prefill counters add up to (P - 1) + n a group."""
    gen = GenerationConfig(max_new_tokens=4, n=3, random_seed=1, **SAMPLED)
    prompts = [fresh(9), fresh(13)]
    config = PytorchEngineConfig(**BASE, dp=2, enable_prefix_caching=False)
    with pipeline(dense, config, progress=False) as pipe:
        finished = queue.Queue()
        groups = [pipe._client.submit_group(p, gen, lambda out: out.finished and finished.put(1),
                                            [None] * 3) for p in prompts]
        assert sorted(group[0].dp_rank for group in groups) == [0, 1]
        assert all(len({h.dp_rank for h in group}) == 1 for group in groups)
        for _ in range(6):
            finished.get(timeout=120)
        assert pipe.stats().num_prefill_tokens == sum(len(p) - 1 + 3 for p in prompts)
        responses = pipe(prompts, gen)
    assert [r.index for r in responses] == list(range(6))
    assert [r.token_ids for r in responses] == [alone(p, choice_gen(gen, i))
                                                for p in prompts for i in range(3)]


def test_extracting_hidden_states_feeds_every_choice_its_prompt(dense, tmp_path):
    """extract_hidden_states files every fed token's rows, so its choices do not fork: each
    choice's file holds the whole prompt (the same rows in each, to rounding: two rows of one
    batch) and its own tokens."""
    from safetensors.torch import load_file

    from lmdeploy_lite import SpeculativeConfig
    config = SpeculativeConfig(method='extract_hidden_states', aux_hidden_state_layer_ids=(0, 2),
                               hidden_states_dir=str(tmp_path))
    prompt = fresh(7)
    gen = GenerationConfig(max_new_tokens=3, n=2, random_seed=6, **SAMPLED)
    with pipeline(dense, PytorchEngineConfig(**BASE), config, progress=False) as pipe:
        responses = pipe(prompt, gen)
        assert pipe.stats().num_prefill_tokens == 2 * len(prompt)
    files = [load_file(r.hidden_states_path) for r in responses]
    assert len({r.hidden_states_path for r in responses}) == 2
    for f, r in zip(files, responses):
        assert f['token_ids'].tolist() == prompt + r.token_ids[:-1]
    torch.testing.assert_close(files[0]['hidden_states'][:7], files[1]['hidden_states'][:7],
                               rtol=1e-12, atol=0)
