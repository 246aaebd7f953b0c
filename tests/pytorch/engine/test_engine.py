"""The engine end to end on tiny random checkpoints, against transformers in float64."""
import pytest

from lmdeploy_lite.messages import GenerationConfig, PytorchEngineConfig
from lmdeploy_lite.pytorch.engine.build import build_engine
from tests.helpers.reference import hf_generate

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], list(range(20, 57)), [300, 301, 2, 450, 3, 3, 3, 17]]
GREEDY_64 = GenerationConfig(max_new_tokens=64, ignore_eos=True)


def make_engine(path, **kw):
    cfg = dict(dtype='float64', device='cpu', block_size=4, session_len=256)
    cfg.update(kw)
    return build_engine(path, PytorchEngineConfig(**cfg), progress=False)


@pytest.fixture(scope='module')
def reference(tiny_ckpt):
    """Non-speculative greedy tokens of our engine for PROMPTS, per (moe)."""
    cache = {}

    def get(moe):
        if moe not in cache:
            engine = make_engine(tiny_ckpt(moe, layout='multimodal'))
            cache[moe] = [s.generated_ids for s in engine.generate(PROMPTS, GREEDY_64)]
        return cache[moe]
    return get


@pytest.mark.parametrize('moe', [False, True])
def test_greedy_equals_transformers_generate(moe, reference):
    assert reference(moe) == [hf_generate(moe, tuple(prompt), 64) for prompt in PROMPTS]


@pytest.mark.parametrize('moe', [False, True])
# the multimodal layout is not a case of its own here (strictly redundant): `reference` is the
# engine on the multimodal layout (batched), so the plain layout's alone, chunked and preempted
# runs equal to it show both layouts give the same tokens, and what follows the load does not
# depend on the layout (both layouts against transformers: tests/pytorch/models/test_qwen3_5.py)
@pytest.mark.parametrize('layout', ['plain'])
def test_same_tokens_alone_batched_chunked_preempted(moe, layout, tiny_ckpt, reference):
    path = tiny_ckpt(moe, layout=layout)
    expected = reference(moe)
    alone = [make_engine(path).generate([p], GREEDY_64)[0].generated_ids for p in PROMPTS[:2]]
    assert alone == expected[:2]
    chunked = make_engine(path, max_prefill_token_num=7).generate(PROMPTS, GREEDY_64)
    assert [s.generated_ids for s in chunked] == expected
    # 4 sequences of up to ~100 tokens in 4-token blocks; 40 usable blocks forces preemption
    small = make_engine(path, num_gpu_blocks=41, session_len=128)
    preempted = small.generate(PROMPTS, GREEDY_64)
    assert [s.generated_ids for s in preempted] == expected
    assert small.scheduler.bm.num_free_blocks == small.scheduler.bm.num_usable_blocks


def test_preemption_really_happens(tiny_ckpt):
    engine = make_engine(tiny_ckpt(False, layout='plain'), num_gpu_blocks=41, session_len=128)
    seqs = [engine.add_request(p, GREEDY_64) for p in PROMPTS]
    recomputed = 0
    while engine.has_work:
        before = {s.seq_id: s.num_computed for s in seqs}
        engine.step()
        recomputed += sum(1 for s in seqs if s.num_computed < before[s.seq_id])
    assert recomputed > 0


def test_stop_token_ids_and_eos(tiny_ckpt, reference):
    expected = reference(False)[0]
    engine = make_engine(tiny_ckpt(False, layout='multimodal'))
    stop = expected[10]
    first = expected.index(stop)
    seq = engine.generate([PROMPTS[0]], GenerationConfig(max_new_tokens=64,
                                                         stop_token_ids=[stop]))[0]
    assert seq.generated_ids == expected[:first + 1] and seq.finish_reason == 'stop'


@pytest.mark.parametrize('make_bad, match', [
    (lambda e: e.add_request([], GenerationConfig()), 'prompt: empty'),
    (lambda e: e.add_request([1] * 300, GenerationConfig()), 'session_len=256'),
    (lambda e: e.add_request([100000], GenerationConfig()), 'outside'),
    (lambda e: GenerationConfig(max_new_tokens=0), 'max_new_tokens=0'),
    (lambda e: GenerationConfig(temperature=-1), 'temperature=-1'),
])
def test_bad_input_is_a_value_error_and_others_are_unaffected(make_bad, match, tiny_ckpt,
                                                              reference):
    engine = make_engine(tiny_ckpt(False, layout='multimodal'))
    good = engine.add_request(PROMPTS[1], GREEDY_64)
    engine.step()
    with pytest.raises(ValueError, match=match):
        make_bad(engine)
    while engine.has_work:
        engine.step()
    assert good.generated_ids == reference(False)[1]


def test_unknown_directory_and_foreign_architecture(tmp_path):
    with pytest.raises(ValueError, match='no such directory'):
        make_engine(str(tmp_path / 'nope'))
    (tmp_path / 'config.json').write_text('{"model_type": "llama", "architectures": ["LlamaForCausalLM"]}')
    with pytest.raises(ValueError, match="model_type='llama'"):
        make_engine(str(tmp_path))


def test_no_block_leak_after_400_requests_with_aborts(tiny_ckpt):
    """400 requests through 33 state slots and the blocks of 32 sequences: every slot and
    block is reused many times and 24 requests are aborted (seeded); at the end every
    block and slot is free."""
    import random
    rng = random.Random(0)
    engine = make_engine(tiny_ckpt(True, layout='plain'), dtype='float32', max_batch_size=32,
                         session_len=64)
    seqs = []
    for i in range(400):
        prompt = [rng.randrange(2, 500) for _ in range(rng.randint(1, 12))]
        seqs.append(engine.add_request(prompt, GenerationConfig(max_new_tokens=rng.randint(1, 4),
                                                                ignore_eos=True)))
        if i % 16 == 15:
            engine.step()
        if rng.random() < 0.1:
            engine.abort(rng.choice(seqs))
    while engine.has_work:
        engine.step()
    assert all(s.is_finished for s in seqs)
    assert any(s.finish_reason == 'abort' for s in seqs)
    bm = engine.scheduler.bm
    assert bm.num_free_blocks == bm.num_usable_blocks
    assert len(bm.free_slots) == bm.num_state_slots - 1


@pytest.mark.parametrize('spec', [None, 2])
def test_seeded_sampling_does_not_depend_on_chunking_or_batch(spec, tiny_ckpt):
    from lmdeploy_lite.messages import SpeculativeConfig
    path = tiny_ckpt(True, layout='multimodal')
    # fixed k: with a dynamic k the random stream a step consumes depends on its draft count
    spec = SpeculativeConfig(num_speculative_tokens=spec, dynamic=False) if spec else None
    cfg = GenerationConfig(max_new_tokens=16, do_sample=True, temperature=1.0, random_seed=7,
                           ignore_eos=True)
    other = GenerationConfig(max_new_tokens=16, do_sample=True, temperature=0.8, random_seed=3,
                             ignore_eos=True)
    alone = build_engine(path, PytorchEngineConfig(dtype='float64', device='cpu', block_size=4,
                                             session_len=256), spec, progress=False)
    want = alone.generate([PROMPTS[2]], cfg)[0].generated_ids
    chunked = build_engine(path, PytorchEngineConfig(dtype='float64', device='cpu', block_size=4,
                                               session_len=256, max_prefill_token_num=5),
                     spec, progress=False)
    seqs = [chunked.add_request(PROMPTS[0], other), chunked.add_request(PROMPTS[2], cfg)]
    while chunked.has_work:
        chunked.step()
    assert seqs[1].generated_ids == want


def test_step_outputs_cross_a_pickle_whole_and_without_their_sequence(tiny_ckpt):
    """What a rank sends the front-end each step: every field as it stood, the live Sequence
    left behind."""
    import pickle
    engine = build_engine(tiny_ckpt(True), PytorchEngineConfig(dtype='float32', device='cpu'),
                          progress=False)
    engine.add_request(list(range(3, 11)), GenerationConfig(max_new_tokens=3, ignore_eos=True,
                                                            logprobs=1))
    outputs = []
    while engine.has_work:
        outputs += engine.step()
    assert outputs and outputs[-1].finished
    for out in outputs:
        back = pickle.loads(pickle.dumps(out))
        assert back.seq is None and out.seq is not None
        assert all(getattr(back, name) == getattr(out, name)
                   for name in type(out).__slots__ if name != 'seq')
