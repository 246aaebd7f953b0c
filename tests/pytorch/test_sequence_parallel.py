"""Sequence parallelism (issue 24) through the engine on CPU processes (gloo), collective trace
check on: greedy tokens with `sequence_parallel=True` equal the single process's (plain and MTP
k=3, draft counts included: tests/helpers/accepting, whose MTP head drafts well; the acceptance
exercised is asserted first) and transformers' (a tiny random MoE checkpoint, plain decoding), over
odd prompt lengths and chunked prefill; tp=2 dp=2 ep=4 with one request (three ranks idle,
running dummy target and draft forwards) then 64 concurrent ones; the draft sharded like the
target or at tp=1 (on the gathered rows); a planted second metadata gather named within
seconds; bad configs refused before any process starts. The model-level checks (every rank's
logits equal the single process's, padding rows included) are in test_tensor_parallel.py.
Hard timeouts; each run asserts it finished.
"""
import multiprocessing
import threading
import time

import pytest

from lmdeploy_lite import GenerationConfig, PytorchEngineConfig, SpeculativeConfig, pipeline
from lmdeploy_lite.pytorch.config import DistConfig
from lmdeploy_lite.pytorch.engine.executor.mp import MPEngineLoop
from tests.helpers import accepting
from tests.helpers.accepting import assert_matches_reference
from tests.helpers.broken import run_requests, second_metadata_gather
from tests.helpers.reference import hf_generate

K = 3
TINY = dict(dtype='float64', device='cpu', block_size=4, session_len=64)
ODD_PROMPTS = [[5, 6, 7, 8, 9], list(range(20, 41)), [10, 11, 12], [300, 301, 2, 450, 3, 3, 17]]


@pytest.fixture(autouse=True)
def strict_collectives(monkeypatch):
    monkeypatch.setenv('LMDEPLOY_LITE_CHECK_COLLECTIVES', '1')
    monkeypatch.setenv('LMDEPLOY_LITE_DIST_TIMEOUT', '30')


@pytest.mark.timeout(300)
def test_tp2_ep2_plain_greedy_equals_transformers(tiny_ckpt):
    """Tiny random MoE checkpoint, tp=2 ep=2 (each TP rank dispatching its own token shard),
    odd prompt lengths in prefill chunks of at most 5 tokens riding with decode rows. (The
    dense model's sequence-parallel logits equal the single process's in
    test_tensor_parallel.py.)"""
    gen = GenerationConfig(max_new_tokens=8, ignore_eos=True)
    start = time.monotonic()
    config = PytorchEngineConfig(tp=2, ep=2, **TINY, sequence_parallel=True,
                                 max_prefill_token_num=5, max_mixed_token_num=5)
    with pipeline(tiny_ckpt(True), config, progress=False) as pipe:
        responses = pipe(ODD_PROMPTS, gen)
    assert time.monotonic() - start < 240
    assert [r.token_ids for r in responses] == [hf_generate(True, tuple(p), 8)
                                                for p in ODD_PROMPTS]


@pytest.mark.timeout(300)
def test_tp2_mtp_k3_draft_tp1_chunked_prefill():
    """The embedded model's prompts (3..10 tokens, odd ones among them) in chunks of at most
    4 tokens; the draft at tp=1 runs on the rows the target gathers."""
    start = time.monotonic()
    config = PytorchEngineConfig(tp=2, sequence_parallel=True, max_prefill_token_num=4,
                                 max_mixed_token_num=4, **accepting.BASE)
    with pipeline(accepting.model_dir(), config, accepting.spec(K, tp=1),
                  progress=False) as pipe:
        responses = pipe([list(p) for p in accepting.prompts()], accepting.GREEDY)
    assert time.monotonic() - start < 240
    assert_matches_reference(responses, K)


@pytest.mark.timeout(600)
def test_tp2_dp2_ep4_one_request_with_idle_ranks_then_64():
    """tp=2 dp=2 ep=4, the MTP draft at tp=1 on the rows the target gathers: one request (the
    other DP rank idle, its dummy target and draft forwards padded by the plan), then 64
    concurrent requests of 3..18 tokens. (The draft sharded like the target, sequence-parallel
    too: tests/pytorch/test_four_ranks.py's tp2 dp2 ep4 run, with dynamic k.)"""
    draft_tp = 1
    gen = GenerationConfig(max_new_tokens=8, ignore_eos=True)
    prompts = accepting.many_prompts(64)
    one = accepting.prompts()[1:2]
    start = time.monotonic()
    config = PytorchEngineConfig(tp=2, dp=2, ep=4, sequence_parallel=True, max_batch_size=64,
                                 **accepting.BASE)
    with pipeline(accepting.model_dir(), config, accepting.spec(K, tp=draft_tp),
                  progress=False) as pipe:
        alone = pipe([list(p) for p in one], accepting.GREEDY)
        many = pipe([list(p) for p in prompts], gen)
    assert time.monotonic() - start < 500
    assert_matches_reference(alone, K, one)
    assert_matches_reference(many, K, prompts, gen)
    assert all(r.finish_reason == 'length' for r in many)


@pytest.mark.timeout(120)
def test_a_second_metadata_gather_is_named_within_seconds(tiny_ckpt, monkeypatch):
    """vllm-ascend #9689's bug class planted under sequence parallelism (tp=2 dp=2 ep=4, one
    request: a busy and an idle DP rank): the busy ranks post a second DP metadata gather of
    another shape; the ranks fail within seconds naming the first differing collective."""
    monkeypatch.setenv('LMDEPLOY_LITE_DIST_TIMEOUT', '5')
    loop = MPEngineLoop(tiny_ckpt(True), PytorchEngineConfig(tp=2, dp=2, ep=4, **TINY,
                                                             sequence_parallel=True),
                        worker_hook=second_metadata_gather)
    try:
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"collective sequences differ at collective "
                                               r"#\d+: rank \d: \('all_gather', 'world'"):
            run_requests(loop, ODD_PROMPTS[1:2], GenerationConfig(max_new_tokens=4))
        assert time.monotonic() - start < 30
    finally:
        loop.close()


def test_bad_configs_fail_before_any_process_starts(tiny_ckpt, tmp_path):
    before = threading.active_count()
    with pytest.raises(ValueError, match=r'sequence_parallel=True: must be False with tp=1'):
        PytorchEngineConfig(sequence_parallel=True)
    with pytest.raises(ValueError, match=r'sequence_parallel=True: needs tp > 1 \(tp=1\)'):
        DistConfig(sequence_parallel=True).validate(None)
    extract = SpeculativeConfig(method='extract_hidden_states', aux_hidden_state_layer_ids=(0,),
                                hidden_states_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"extract_hidden_states.*sequence_parallel=True"):
        pipeline(tiny_ckpt(False), PytorchEngineConfig(tp=2, sequence_parallel=True, **TINY),
                 extract, progress=False)
    assert threading.active_count() <= before        # (earlier tests' threads may end now)
    assert multiprocessing.active_children() == []


def test_cli_flag_reaches_the_engine_config(monkeypatch, capsys):
    """`--sequence-parallel` on generate, chat and serve api_server (which takes --tp)."""
    import importlib.util

    import lmdeploy_lite
    from lmdeploy_lite.cli import main as cli
    built = []

    def fake_pipeline(model_path, backend_config, *args, **kwargs):
        built.append(backend_config)
        raise KeyboardInterrupt
    monkeypatch.setattr(lmdeploy_lite, 'pipeline', fake_pipeline)
    for command in (['generate', '--prompt', 'x'], ['chat']):
        assert cli.main(command + ['--device', 'cpu', '--sequence-parallel']) == 2
        assert 'sequence_parallel=True: must be False with tp=1' in capsys.readouterr().err
        with pytest.raises(KeyboardInterrupt):
            cli.main(command + ['--device', 'cpu'])
        assert built.pop().sequence_parallel is False
    if importlib.util.find_spec('fastapi') is not None:
        cli.main(['serve', 'api_server', '--device', 'cpu', '--tp', '2', '--sequence-parallel'])
        assert built.pop().sequence_parallel is True
