"""The draft's own DistConfig (SpeculativeConfig.tp / .ep; issue 19 item 2).

Multi-process runs (gloo, the embedded model, whose MTP drafts are accepted: tests/helpers/
accepting) of layouts tests/pytorch/test_distributed.py does not already run (it has tp=2 with
the draft at the target's tp and at tp=1 without EP, and dp=2 ep=2 with the draft at the target's
ep): a tp=2 ep=2 target with a draft tp=1 that keeps EP (each rank dispatches all its tokens) and
a draft tp=2 ep=1 (experts replicated, TP-split); a dp=2 ep=2 target with a draft ep=1 (no
all-to-all in the draft). Each asserts real acceptance first, then whole sequences equal to the
single process's plain greedy output and per-request draft counts equal to its. A 4-rank run
checks the 'draft_tp' sub-groups (draft tp=2 of tp=4), which the embedded model cannot be split
into (2 KV heads). The rest are fast checks without processes: validation errors, the layout
the draft resolves to, what plan_cache charges for it, the CLI flags.
"""
import multiprocessing
import os
import tempfile
import threading
import time

import pytest
import torch

from lmdeploy_lite import PytorchEngineConfig, SpeculativeConfig, pipeline
from lmdeploy_lite.cli.main import build_parser, speculative_config
from lmdeploy_lite.pytorch.config import DistConfig, ModelConfig
from lmdeploy_lite.pytorch.distributed import DistContext, DraftDistContext
from lmdeploy_lite.pytorch.cache_engine import CacheEngine
from lmdeploy_lite.pytorch.engine.cache_plan import plan_cache
from lmdeploy_lite.pytorch.engine.executor.mp import rank_context
from lmdeploy_lite.pytorch.models.loader import load_mtp_state_dict
from lmdeploy_lite.pytorch.spec_decode.build import (check_speculative_config, draft_dist_config,
                                                     draft_footprint)
from tests.helpers import accepting
from tests.helpers.accepting import assert_matches_reference


@pytest.fixture(autouse=True)
def strict_collectives(monkeypatch):
    monkeypatch.setenv('LMDEPLOY_LITE_CHECK_COLLECTIVES', '1')
    monkeypatch.setenv('LMDEPLOY_LITE_DIST_TIMEOUT', '20')


# ---- multi-process runs against the single process --------------------------------------------
@pytest.mark.timeout(200)
@pytest.mark.parametrize('layout, draft, k', [
    (dict(tp=2, ep=2), dict(tp=1), 2),
    (dict(tp=2, ep=2), dict(tp=2, ep=1), 2),
    (dict(dp=2, ep=2), dict(ep=1), 3),
], ids=['tp2ep2_draft_tp1', 'tp2ep2_draft_ep1', 'dp2ep2_draft_ep1'])
def test_draft_layout_gives_single_process_greedy_and_acceptance(layout, draft, k):
    start = time.monotonic()
    spec = accepting.spec(k, **draft)
    with pipeline(accepting.model_dir(), PytorchEngineConfig(**layout, **accepting.BASE), spec,
                  progress=False) as pipe:
        responses = pipe([list(p) for p in accepting.prompts()], accepting.GREEDY)
    assert_matches_reference(responses, k)
    assert time.monotonic() - start < 150


def _sub_group_rank(rank: int, init_file: str, results):
    """One of 4 ranks (target tp=4): a SwiGLU MLP built on the draft's view with tp=2 (the
    'draft_tp' sub-groups {0, 1} and {2, 3}) against the whole MLP, then the step's traces."""
    torch.set_num_threads(1)
    from lmdeploy_lite.pytorch.nn.mlp import SwiGLUMLP
    ctx = DistContext.init(DistConfig(tp=4), rank, f'file://{init_file}')
    try:
        ctx.begin_step(1)
        view = ctx.draft_context(DistConfig(tp=2))
        torch.manual_seed(0)
        whole = SwiGLUMLP(8, 12, torch.float64, 'cpu')
        for p in whole.parameters():
            p.data.copy_(torch.randn_like(p))
        mlp = SwiGLUMLP(8, 12, torch.float64, 'cpu', dist_ctx=view)
        for name, p in mlp.named_parameters():
            p.data.copy_(p.shard.narrow(dict(whole.named_parameters())[name]))
        x = torch.randn(5, 8, dtype=torch.float64)
        out = mlp(x)
        ctx.compare_traces()
        results.put((rank, view.tp_rank, torch.allclose(out, whole(x), rtol=0, atol=1e-12),
                     [e[:2] for e in ctx.trace]))
    except BaseException as e:          # reported, not hung
        results.put((rank, repr(e)))
    finally:
        ctx.destroy()


@pytest.mark.timeout(90)
def test_draft_tp_sub_groups_of_a_tp4_group():
    start = time.monotonic()
    # the mp executor's fork server (torch imported once): a spawned rank spends seconds
    # importing torch, four of them on two cores most of this test's time
    mp = rank_context()
    results = mp.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, 'init')
        procs = [mp.Process(target=_sub_group_rank, args=(r, init_file, results))
                 for r in range(4)]
        for p in procs:
            p.start()
        got = sorted(results.get(timeout=60) for _ in procs)
        for p in procs:
            p.join(timeout=10)
    assert not any(p.is_alive() for p in procs)
    assert got == [(r, r % 2, True, [('all_reduce', 'draft_tp')]) for r in range(4)], got
    assert time.monotonic() - start < 60


# ---- fast checks: no processes -----------------------------------------------------------
def test_speculative_config_ranges_name_the_field():
    cases = [(dict(tp=0), 'tp=0: must be an integer in 1..'),
             (dict(ep=True), 'ep=True: must be an integer in 1..'),
             (dict(tp=1.5), 'tp=1.5: must be an integer'),
             (dict(method='ngram', tp=1), "tp=1: must be None with method='ngram'"),
             (dict(method='ngram', ep=1), "ep=1: must be None with method='ngram'")]
    for kwargs, match in cases:
        with pytest.raises(ValueError) as error:
            SpeculativeConfig(**kwargs)
        assert str(error.value).startswith(match)


def test_draft_layout_checked_against_the_target(tiny_ckpt):
    moe, dense = tiny_ckpt(True, layout='plain'), tiny_ckpt(False, layout='plain')
    cases = [(dict(tp=3), moe, DistConfig(tp=4),
              "SpeculativeConfig.tp=3: must divide the target's tp=4 (one of [1, 2, 4]"),
             (dict(tp=2), moe, DistConfig(dp=2, ep=2),
              "SpeculativeConfig.tp=2: must divide the target's tp=1"),
             (dict(ep=2), moe, DistConfig(dp=4, ep=4),
              "SpeculativeConfig.ep=2: must be 1 (the MTP layer's experts replicated on every "
              "rank), the target's ep=4, or None"),
             (dict(ep=2), dense, DistConfig(tp=2), 'the model is dense')]
    for kwargs, path, target, match in cases:
        with pytest.raises(ValueError) as error:
            check_speculative_config(SpeculativeConfig(**kwargs), path, target)
        assert match in str(error.value)
    for kwargs, target in [(dict(tp=2), DistConfig(tp=4)), (dict(tp=1, ep=1), DistConfig(tp=2)),
                           (dict(ep=4), DistConfig(dp=4, ep=4)), (dict(ep=1), DistConfig())]:
        check_speculative_config(SpeculativeConfig(**kwargs), moe, target)


def test_bad_draft_layout_fails_before_any_process_starts(tiny_ckpt):
    path = tiny_ckpt(True, layout='plain')
    before = threading.active_count()
    with pytest.raises(ValueError, match=r"SpeculativeConfig\.ep=4: must be 1"):
        pipeline(path, PytorchEngineConfig(dp=2, ep=2, device='cpu', dtype='float64'),
                 SpeculativeConfig(ep=4), progress=False)
    assert threading.active_count() == before
    assert multiprocessing.active_children() == []


def test_draft_layout_resolves_from_the_target():
    target = DistConfig(tp=4, dp=2, ep=8)
    assert draft_dist_config(SpeculativeConfig(), target) == target
    assert draft_dist_config(SpeculativeConfig(tp=2), target) == DistConfig(tp=2, dp=2, ep=8)
    assert draft_dist_config(SpeculativeConfig(ep=1), target) == DistConfig(tp=4, dp=2, ep=1)
    # the target's own layout, given or defaulted, is the target's context itself: the draft's
    # layers then run exactly what test_distributed's default-layout runs check
    ctx = DistContext(DistConfig(dp=2, ep=2), rank=1)
    assert ctx.draft_context(draft_dist_config(SpeculativeConfig(ep=2), ctx.config)) is ctx
    view = ctx.draft_context(draft_dist_config(SpeculativeConfig(ep=1), ctx.config))
    assert isinstance(view, DraftDistContext)
    assert (view.config.ep, view.ep_rank, view.ep.size, view.rank) == (1, 0, 1, 1)
    assert view.ep.gloo is None                         # a group of one: no collective runs


def test_plan_cache_charges_the_drafts_kv_heads_and_weights_per_rank():
    model = ModelConfig.from_pretrained(accepting.model_dir())      # 2 KV heads, 8 experts
    dtype = torch.float64
    # the whole head's own weights are the checkpoint's mtp.* tensors, at the model dtype
    whole = sum(t.numel() for t in load_mtp_state_dict(accepting.model_dir()).values()) * 8
    assert draft_footprint(SpeculativeConfig(), model, dtype, DistConfig()).weight_bytes == whole
    sizes = {name: draft_footprint(SpeculativeConfig(**kw), model, dtype, target)
             for name, kw, target in [('tp2', {}, DistConfig(tp=2)),
                                      ('tp2_draft_tp1', dict(tp=1), DistConfig(tp=2)),
                                      ('ep2', {}, DistConfig(dp=2, ep=2)),
                                      ('ep2_draft_ep1', dict(ep=1), DistConfig(dp=2, ep=2))]}
    assert sizes['tp2_draft_tp1'].weight_bytes == sizes['ep2_draft_ep1'].weight_bytes == whole
    assert sizes['tp2'].weight_bytes < whole and sizes['ep2'].weight_bytes < whole
    assert (sizes['tp2'].tp, sizes['tp2_draft_tp1'].tp) == (2, 1)
    assert draft_footprint(SpeculativeConfig(method='ngram'), model, dtype,
                           DistConfig(tp=2)).num_kv_layers == 0
    # blocks: (available - draft weights) * 0.5 / bytes per block (target + draft KV)
    cfg = PytorchEngineConfig(block_size=16, max_batch_size=4, cache_max_entry_count=0.5,
                              dtype='float64', device='cpu', enable_prefix_caching=False)
    target_block = _kv_block_bytes(model, dtype, tp=2)
    available = 128 * 2**20
    for fp in (sizes['tp2'], sizes['tp2_draft_tp1']):
        draft_block = _kv_block_bytes(model, dtype, tp=fp.tp, draft=True)
        state = (cfg.max_batch_size + 1) * _state_slot_bytes(model, dtype, tp=2)
        plan = plan_cache(model, cfg, 8000, 3, fp.num_kv_layers, dtype, available, tp=2,
                          draft_tp=fp.tp, draft_weight_bytes=fp.weight_bytes)
        expected = int(((available - fp.weight_bytes) * 0.5 - state) // (target_block
                                                                          + draft_block))
        assert 500 < plan.num_blocks == expected < 2001     # a sequence fits; below the cap
    assert draft_block == 2 * 16 * 2 * model.head_dim * 8     # draft tp=1: both KV heads


def _kv_block_bytes(model, dtype, tp, draft=False):
    return CacheEngine.bytes_per_block(model, 16, dtype, ('full_attention',) if draft else None,
                                       tp=tp)


def _state_slot_bytes(model, dtype, tp):
    return CacheEngine.bytes_per_state_slot(model, 3, dtype, tp=tp)


def test_cli_flags_set_the_draft_layout():
    parser = build_parser()
    args = parser.parse_args(['generate', '--prompt', 'x', '--speculative-num-draft-tokens', '2',
                              '--speculative-tp', '1', '--speculative-ep', '1'])
    assert speculative_config(args) == SpeculativeConfig(num_speculative_tokens=2, tp=1, ep=1)
    args = parser.parse_args(['generate', '--prompt', 'x', '--speculative-num-draft-tokens', '2'])
    assert (speculative_config(args).tp, speculative_config(args).ep) == (None, None)
    args = parser.parse_args(['generate', '--prompt', 'x', '--speculative-tp', '1'])
    with pytest.raises(ValueError, match='--speculative-tp=1: speculative decoding is off'):
        speculative_config(args)
