"""The sampled drafts' distribution `draft_probs` (issue 19 item 4): allocated at start-up from
the KV plan's state slots (and charged by plan_cache: tests/pytorch/engine/test_cache_plan.py),
never reallocated; under TP it travels from TP rank 0 to its peers only in a step the StepPlan
marks `any_sampled`, so a greedy step ships no [B, k, V] table, and sampled TP=2 speculation
still gives the single process's tokens and draft counts (embedded model, float64, gloo).
"""
import time

import pytest
import torch

from lmdeploy_lite import GenerationConfig, PytorchEngineConfig
from lmdeploy_lite.pytorch.config import ModelConfig
from lmdeploy_lite.pytorch.engine.build import build_engine
from lmdeploy_lite.pytorch.engine.executor.mp import MPEngineLoop
from tests.helpers import accepting
from tests.helpers.accepting import assert_matches_reference, assert_real_acceptance, counts
from tests.helpers.broken import run_requests
from tests.helpers.collective_log import COLLECTIVE_LOG_DIR, log_collectives, read_steps

SAMPLED = GenerationConfig(max_new_tokens=24, ignore_eos=True, do_sample=True, temperature=0.7,
                           top_k=20, random_seed=7)


@pytest.fixture(autouse=True)
def strict_collectives(monkeypatch):
    monkeypatch.setenv('LMDEPLOY_LITE_CHECK_COLLECTIVES', '1')
    monkeypatch.setenv('LMDEPLOY_LITE_DIST_TIMEOUT', '20')


def test_allocated_at_start_up_for_every_state_slot():
    k = 2
    engine = build_engine(accepting.model_dir(), PytorchEngineConfig(max_batch_size=4, **accepting.BASE),
                    accepting.spec(k), progress=False)
    vocab = ModelConfig.from_pretrained(accepting.model_dir()).vocab_size
    table = engine.agent.draft_probs
    assert table.shape == (engine.cache_config.num_state_slots, k, vocab) == (5, k, vocab)
    assert table.dtype == torch.float64                      # probs of float64 logits
    assert engine.spec_plan.draft_probs_bytes_per_slot == k * vocab * 8
    engine.generate([list(p) for p in accepting.prompts()[:2]], SAMPLED)
    assert engine.agent.draft_probs is table and table.abs().sum() > 0    # written in place


def _probs_broadcasts(step: list[tuple], k: int) -> list[tuple]:
    """The step's TP broadcasts of a [B, k, V] float table (draft_probs)."""
    return [e for e in step if e[0] == 'broadcast' and len(e[2]) == 3 and e[2][1] == k
            and e[3] == 'float64']


@pytest.mark.timeout(240)
def test_tp2_ships_draft_probs_only_in_sampled_steps(tmp_path):
    """One tp=2 engine: a seeded sampled batch (the single process's sampled tokens and counts,
    a draft_probs broadcast in every step), then a greedy batch (single-process greedy tokens
    and counts, no draft_probs broadcast in any step, though the table holds sampled drafts)."""
    k, start = 2, time.monotonic()
    prompts = [list(p) for p in accepting.prompts()]
    loop = MPEngineLoop(accepting.model_dir(), PytorchEngineConfig(tp=2, **accepting.BASE),
                        accepting.spec(k), env={COLLECTIVE_LOG_DIR: str(tmp_path)},
                        worker_hook=log_collectives)
    try:
        sampled = run_requests(loop, prompts, SAMPLED)
        sampled_steps = {r: read_steps(tmp_path, r) for r in (0, 1)}
        greedy = run_requests(loop, prompts, accepting.GREEDY)
        greedy_steps = {r: read_steps(tmp_path, r)[len(sampled_steps[r]):] for r in (0, 1)}
    finally:
        loop.close()
    assert time.monotonic() - start < 200
    assert_matches_reference(greedy, k)
    for rank in (0, 1):
        steps = greedy_steps[rank]
        assert steps and all(any(e[0] == 'broadcast' for e in s) for s in steps)   # drafts
        assert [s for s in steps if _probs_broadcasts(s, k)] == []
        assert sampled_steps[rank] and all(_probs_broadcasts(s, k)
                                           for s in sampled_steps[rank])
    reference = accepting.reference(k, gen=SAMPLED)
    assert_real_acceptance([r.spec_stats for r in sampled], k)
    assert [r.token_ids for r in sampled] == reference.token_ids
    assert [counts(r.spec_stats) for r in sampled] == reference.counts
    assert reference.token_ids != accepting.reference(k).token_ids       # it did sample
