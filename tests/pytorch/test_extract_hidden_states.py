"""extract_hidden_states (issue 23): each finished request's file holds transformers'
`output_hidden_states` at the chosen ids (float64, relative error < 1e-9) and the tokens fed,
on tiny random dense and MoE checkpoints: a batch of prompts of different lengths with chunked
prefill and mixed steps, preemption by a tiny block budget, tp=2, and dp=2 ep=2 with an idle
rank and with a batch (collective trace check on; extraction adds no collective), plus a planted
second DP metadata gather that is named within seconds. Bad configs fail before any process
starts; a failed write ends that request alone with 'error'.
"""
import errno
import multiprocessing
import os
import queue
import time
from dataclasses import dataclass, field

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from lmdeploy_lite import GenerationConfig, PytorchEngineConfig, SpeculativeConfig, pipeline
from lmdeploy_lite.pytorch.engine import hidden_states as hidden_states_module
from lmdeploy_lite.pytorch.engine.executor.mp import MPEngineLoop
from lmdeploy_lite.pytorch.engine.step_plan import FIELDS
from lmdeploy_lite.pytorch.spec_decode.build import spec_plan
from lmdeploy_lite.pytorch.config import DistConfig, ModelConfig
from tests.helpers.broken import second_metadata_gather
from tests.helpers.collective_log import COLLECTIVE_LOG_DIR, log_collectives, read_steps
from tests.helpers.reference import hf_hidden_states

NUM_LAYERS = 4                   # the tiny checkpoints' L
BASE = dict(dtype='float64', device='cpu', block_size=4, session_len=64)
PROMPTS = [[5, 6, 7, 8, 9], list(range(20, 49)), [10, 11, 12], [300, 301, 2, 450, 3, 3, 3, 17]]
GEN = GenerationConfig(max_new_tokens=6, ignore_eos=True)


def extract(directory, ids=(0, 2, NUM_LAYERS)) -> SpeculativeConfig:
    return SpeculativeConfig(method='extract_hidden_states', aux_hidden_state_layer_ids=ids,
                             hidden_states_dir=str(directory))


def assert_file_is_transformers(path: str, moe: bool, prompt: list[int], generated: list[int],
                                ids: tuple[int, ...]):
    """The file's token ids are the prompt and the generated tokens but the last; its hidden
    states transformers' at `ids` for those tokens (float64)."""
    assert os.path.dirname(path) and path.endswith('.safetensors'), path
    tensors = load_file(path)
    assert set(tensors) == {'hidden_states', 'token_ids'}
    with safe_open(path, 'pt') as f:
        assert f.metadata()['aux_hidden_state_layer_ids'] == ','.join(map(str, ids))
    fed = prompt + generated[:-1]
    assert tensors['token_ids'].dtype == torch.int64 and tensors['token_ids'].tolist() == fed
    got = tensors['hidden_states']
    want = hf_hidden_states(moe, fed, ids)
    assert got.dtype == torch.float64 and got.shape == (len(fed), len(ids), 64)
    error = ((got - want).abs().max() / want.abs().max()).item()
    assert error < 1e-9, error


@pytest.mark.parametrize('moe', [False, True], ids=['dense', 'moe'])
def test_a_chunked_mixed_batch_and_preemption_give_transformers_hidden_states(
        moe, tiny_ckpt, tmp_path, monkeypatch):
    """Four prompts of 3..29 tokens in chunks of at most 5 (decode rows ride with the chunks),
    in a block budget that preempts the later arrivals (recomputed: their rows replaced, not
    repeated); the ids in any order, 0 and L included."""
    ids = (0, 2, NUM_LAYERS) if not moe else (NUM_LAYERS, 1, 0)
    gen = GenerationConfig(max_new_tokens=16, ignore_eos=True)
    with pipeline(tiny_ckpt(moe), PytorchEngineConfig(**BASE, max_prefill_token_num=5,
                                                      max_mixed_token_num=5, num_gpu_blocks=17),
                  extract(tmp_path, ids), progress=False) as pipe:
        responses = pipe(PROMPTS, gen)
        preemptions = pipe.engine.scheduler.num_preemptions
    assert preemptions, 'the block budget forced no preemption'
    assert sum(r.num_preemptions for r in responses) == preemptions     # Response carries them
    assert len({r.hidden_states_path for r in responses}) == len(PROMPTS)
    for prompt, r in zip(PROMPTS, responses):
        assert r.finish_reason == "length" and len(r.token_ids) == 16
        assert_file_is_transformers(r.hidden_states_path, moe, prompt, r.token_ids, ids)
    assert sorted(os.listdir(tmp_path)) == sorted(os.path.basename(r.hidden_states_path)
                                                  for r in responses)       # no temporary left


def test_one_token_request_and_a_failed_write_ends_that_request_alone(tiny_ckpt, tmp_path,
                                                                       monkeypatch):
    """max_new_tokens=1: the file holds the prompt alone. A write that fails (disk full) ends
    its request with 'error' and the reason; the engine goes on, the next request's file is
    written, and no temporary file is left."""
    with pipeline(tiny_ckpt(False), PytorchEngineConfig(**BASE), extract(tmp_path),
                  progress=False) as pipe:
        one = pipe(PROMPTS[0], GenerationConfig(max_new_tokens=1))
        assert one.finish_reason == 'length'
        assert_file_is_transformers(one.hidden_states_path, False, PROMPTS[0], one.token_ids,
                                    (0, 2, NUM_LAYERS))
        real = hidden_states_module.save_file

        def disk_full(tensors, path, metadata=None):
            with open(path, 'wb') as f:
                f.write(b'partial')
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        monkeypatch.setattr(hidden_states_module, 'save_file', disk_full)
        failed = pipe(PROMPTS[1], GEN)
        assert failed.finish_reason == 'error' and failed.hidden_states_path is None
        assert 'No space left on device' in failed.error and 'hidden_states_dir' in failed.error
        monkeypatch.setattr(hidden_states_module, 'save_file', real)
        after = pipe(PROMPTS[2], GEN)
        assert after.finish_reason == 'length'
        assert_file_is_transformers(after.hidden_states_path, False, PROMPTS[2], after.token_ids,
                                    (0, 2, NUM_LAYERS))
    assert sorted(os.listdir(tmp_path)) == sorted(
        os.path.basename(r.hidden_states_path) for r in (one, after))


def test_bad_configs_fail_before_any_process_starts(tiny_ckpt, tmp_path):
    cases = [(dict(aux_hidden_state_layer_ids=()), 'aux_hidden_state_layer_ids=()'),
             (dict(aux_hidden_state_layer_ids=[1, 1]), 'distinct layer ids in 0..'),
             (dict(aux_hidden_state_layer_ids=[-1]), 'aux_hidden_state_layer_ids=[-1]'),
             (dict(aux_hidden_state_layer_ids=['2']), 'aux_hidden_state_layer_ids'),
             (dict(hidden_states_dir=None), 'hidden_states_dir=None: must be given')]
    for change, match in cases:
        kw = dict(method='extract_hidden_states', aux_hidden_state_layer_ids=(0,),
                  hidden_states_dir=str(tmp_path))
        with pytest.raises(ValueError, match=match.replace('(', r'\(').replace(')', r'\)')
                           .replace('[', r'\[').replace(']', r'\]')):
            SpeculativeConfig(**dict(kw, **change))
    with pytest.raises(ValueError, match=r"aux_hidden_state_layer_ids=\(1,\): must be None "
                                         r"with method='qwen3_5_mtp'"):
        SpeculativeConfig(aux_hidden_state_layer_ids=(1,))
    path = tiny_ckpt(True)
    blocker = tmp_path / 'a_file'
    blocker.write_text('')
    layouts = [dict(), dict(dp=2, ep=2)]
    for layout in layouts:
        before = multiprocessing.active_children()
        with pytest.raises(ValueError, match=r'aux_hidden_state_layer_ids=\[0, 5\]: \[5\] '
                                             r'outside 0\.\.4'):
            pipeline(path, PytorchEngineConfig(**BASE, **layout),
                     extract(tmp_path, (0, 5)), progress=False)
        with pytest.raises(ValueError, match=r'hidden_states_dir=.*a_file/sub.*: must be a '
                                             r'directory this process can create and write'):
            pipeline(path, PytorchEngineConfig(**BASE, **layout),
                     extract(blocker / 'sub'), progress=False)
        assert multiprocessing.active_children() == before


def test_the_plan_drafts_nothing(tiny_ckpt, tmp_path):
    """k = 0: the engine's plain path, no draft model and no proposer, whatever
    num_speculative_tokens says; prefix caching is off (a cached prefix is never fed)."""
    spec = SpeculativeConfig(method='extract_hidden_states', num_speculative_tokens=5,
                             aux_hidden_state_layer_ids=[3], hidden_states_dir=str(tmp_path))
    plan = spec_plan(spec, ModelConfig.from_pretrained(tiny_ckpt(True)), torch.float64,
                     DistConfig())
    assert not plan.enabled and plan.num_spec_tokens == 0 and plan.draft.num_kv_layers == 0
    assert plan.aux_hidden_state_layer_ids == (3,)


# ---- ranks in processes ---------------------------------------------------------------------
@pytest.fixture
def strict_collectives(monkeypatch):
    monkeypatch.setenv('LMDEPLOY_LITE_CHECK_COLLECTIVES', '1')
    monkeypatch.setenv('LMDEPLOY_LITE_DIST_TIMEOUT', '5')


@dataclass
class Done:
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    hidden_states_path: str | None = None
    dp_rank: int | None = None


def run(loop, prompts: list[list[int]], gen: GenerationConfig, timeout_s: float = 90
        ) -> list[Done]:
    """Submit every prompt to an engine loop, wait for all (at most `timeout_s`); raises the
    first error a request's sink receives."""
    results: queue.Queue = queue.Queue()
    handles = [loop.submit(prompt, gen, lambda item, i=i: results.put((i, item)))
               for i, prompt in enumerate(prompts)]
    done = [Done() for _ in prompts]
    remaining, deadline = len(prompts), time.monotonic() + timeout_s
    while remaining:
        i, item = results.get(timeout=max(0.0, deadline - time.monotonic()))
        if isinstance(item, BaseException):
            raise item
        done[i].token_ids += item.new_token_ids
        done[i].dp_rank = handles[i].dp_rank
        if item.finished:
            done[i].finish_reason = item.finish_reason
            done[i].hidden_states_path = item.hidden_states_path
            remaining -= 1
    return done


@pytest.mark.timeout(180)
def test_tp2_files_are_whole_and_written_once(tiny_ckpt, tmp_path, strict_collectives):
    """tp=2 MoE: the rows are whole after the all-reduces; TP rank 0 alone writes each file."""
    start = time.monotonic()
    with pipeline(tiny_ckpt(True), PytorchEngineConfig(**BASE, tp=2, max_prefill_token_num=8),
                  extract(tmp_path), progress=False) as pipe:
        responses = pipe(PROMPTS, GEN)
    for prompt, r in zip(PROMPTS, responses):
        assert_file_is_transformers(r.hidden_states_path, True, prompt, r.token_ids,
                                    (0, 2, NUM_LAYERS))
    assert len(os.listdir(tmp_path)) == len(PROMPTS)
    assert time.monotonic() - start < 150


@pytest.mark.timeout(180)
def test_dp2_ep2_an_idle_rank_then_a_batch_and_no_new_collective(tiny_ckpt, tmp_path,
                                                                  strict_collectives):
    """dp=2 ep=2 MoE: one request (the other rank runs dummy forwards through the same plan),
    then a batch over both ranks. Each file is written by the rank that ran the request, and
    every step of every rank runs exactly the collectives of plain decoding: the one plan
    gather, then the MoE all-to-alls."""
    start = time.monotonic()
    files, logs = tmp_path / 'files', tmp_path / 'logs'
    logs.mkdir()
    loop = MPEngineLoop(tiny_ckpt(True), PytorchEngineConfig(**BASE, dp=2, ep=2),
                        extract(files), env={COLLECTIVE_LOG_DIR: str(logs)},
                        worker_hook=log_collectives)
    try:
        alone = run(loop, PROMPTS[1:2], GEN)
        steps_alone = [len(read_steps(str(logs), r)) for r in range(2)]
        batch = run(loop, PROMPTS, GEN)
        steps = [read_steps(str(logs), r) for r in range(2)]
    finally:
        loop.close()
    assert time.monotonic() - start < 150
    assert steps_alone[0] == steps_alone[1] > 0             # the idle rank stepped alongside
    assert sorted(r.dp_rank for r in batch) == [0, 0, 1, 1]
    for prompt, r in zip(PROMPTS[1:2] + PROMPTS, alone + batch):
        assert r.finish_reason == 'length'
        assert_file_is_transformers(r.hidden_states_path, True, prompt, r.token_ids,
                                    (0, 2, NUM_LAYERS))
    assert len(os.listdir(files)) == 5
    for rank_steps in steps:
        for trace in rank_steps:
            assert trace[0] == ('all_gather', 'world', (len(FIELDS),), 'int64'), trace
            assert {op for op, group, _, _ in trace[1:]} == {'all_to_all'}, trace


@pytest.mark.timeout(120)
def test_a_second_metadata_gather_of_another_shape_is_named_within_seconds(
        tiny_ckpt, tmp_path, strict_collectives):
    """The bug class of vllm-ascend #9689 planted: the busy rank's step posts a second DP
    metadata gather of another shape than the plan's; with the trace check on, the ranks fail
    within seconds (the collective timeout, 5 s here) naming it, instead of crossing it with
    the idle rank's next plan gather (gloo: "8 vs 7", or a hang)."""
    loop = MPEngineLoop(tiny_ckpt(True), PytorchEngineConfig(**BASE, dp=2, ep=2),
                        extract(tmp_path), worker_hook=second_metadata_gather)
    try:
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"collective sequences differ at collective "
                                               r"#\d+: rank \d: \('all_gather', 'world'"):
            run(loop, PROMPTS[1:2], GEN)
        assert time.monotonic() - start < 30
    finally:
        loop.close()


def test_generate_cli_flags(tmp_path, capsys):
    """`lmdeploy_lite generate` on the embedded model (8 layers): the flags make the config, the
    file's path is printed; bad ids and flags without the method exit 2 naming the flag."""
    from lmdeploy_lite.cli.main import main
    flags = ['--device', 'cpu', '--speculative-algorithm', 'extract_hidden_states',
             '--hidden-states-dir', str(tmp_path)]
    assert main(['generate', '--prompt', 'def f(', '--max-new-tokens', '2', *flags,
                 '--speculative-aux-hidden-state-layer-ids', '8,0']) == 0
    path = capsys.readouterr().err.split('[hidden states: ')[1].split(']')[0]
    with safe_open(path, 'pt') as f:
        assert f.get_slice('hidden_states').get_shape()[1:] == [2, 256]
        assert f.metadata()['aux_hidden_state_layer_ids'] == '8,0'
    assert main(['generate', '--prompt', 'x', *flags,
                 '--speculative-aux-hidden-state-layer-ids', '2,x']) == 2
    assert "--speculative-aux-hidden-state-layer-ids='2,x': must be comma-separated" in \
        capsys.readouterr().err
    assert main(['generate', '--prompt', 'x', '--hidden-states-dir', str(tmp_path)]) == 2
    assert '--hidden-states-dir=' in capsys.readouterr().err
    assert main(['generate', '--prompt', 'x', *flags,
                 '--speculative-aux-hidden-state-layer-ids', '0,9']) == 2
    assert '[9] outside 0..8' in capsys.readouterr().err


def test_train_mtp_head_from_the_files_alone(tiny_ckpt, tmp_path):
    """tools/train_mtp_head.py DIR --model MODEL --out OUT on a tiny MoE checkpoint's files:
    OUT is MODEL with new mtp.* tensors (the same names and shapes) that the engine drafts with
    (and speculation never changes the answer)."""
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), '..', '..', 'tools'))
    from train_mtp_head import main
    model = tiny_ckpt(True)
    with pipeline(model, PytorchEngineConfig(**BASE), extract(tmp_path / 'files', (NUM_LAYERS,)),
                  progress=False) as pipe:
        pipe(PROMPTS, GEN)
    out = tmp_path / 'out'
    main([str(tmp_path / 'files'), '--model', model, '--out', str(out), '--steps', '2',
          '--batch-size', '2', '--seq-len', '16', '--val-fraction', '0.25', '--threads', '1'])
    new, old = load_file(str(out / 'model.safetensors')), load_file(
        os.path.join(model, 'model.safetensors'))
    assert {n: t.shape for n, t in new.items()} == {n: t.shape for n, t in old.items()}
    assert not new['mtp.fc.weight'].equal(old['mtp.fc.weight'])
    assert all(new[n].equal(t) for n, t in old.items() if not n.startswith('mtp.'))
    with pipeline(str(out), PytorchEngineConfig(**BASE), SpeculativeConfig(
            num_speculative_tokens=2), progress=False) as pipe:
        drafted = pipe(PROMPTS, GEN)
    assert [r.token_ids for r in drafted] == plain_tokens(model)


def plain_tokens(model: str) -> list[list[int]]:
    with pipeline(model, PytorchEngineConfig(**BASE), progress=False) as pipe:
        return [r.token_ids for r in pipe(PROMPTS, GEN)]
