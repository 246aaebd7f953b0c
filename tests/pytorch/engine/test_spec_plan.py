"""SpecPlan: all the engine and executors know of speculative decoding, as plain data from
`spec_decode.build.spec_plan` (issue 19 item 3). The package holds no method-name check outside
spec_decode/ and strategies/ar_spec/ (tests/test_package_structure.py)."""
import torch

from lmdeploy_lite import GenerationConfig, PytorchEngineConfig, SpeculativeConfig
from lmdeploy_lite.messages import SpecDecodeStats
from lmdeploy_lite.pytorch.config import DistConfig, ModelConfig
from lmdeploy_lite.pytorch.engine.build import build_engine
from lmdeploy_lite.pytorch.spec_decode.build import SpecPlan, spec_plan
from tests.helpers import accepting


def test_plan_of_each_method():
    model = ModelConfig.from_pretrained(accepting.model_dir())
    target = DistConfig(tp=2)
    none = spec_plan(None, model, torch.float32, target)
    assert none == SpecPlan(draft=none.draft) and not none.enabled
    assert (none.draft.num_kv_layers, none.draft.tp) == (0, 2)
    mtp = spec_plan(SpeculativeConfig(num_speculative_tokens=3, tp=1), model, torch.float32,
                    target)
    assert (mtp.num_spec_tokens, mtp.num_draft_extra, mtp.needs_host_tokens) == (3, 2, False)
    assert (mtp.draft.num_kv_layers, mtp.draft.tp) == (1, 1) and mtp.draft.weight_bytes > 0
    assert mtp.draft_probs_bytes_per_slot == 3 * model.vocab_size * 4
    ngram = spec_plan(SpeculativeConfig(method='ngram', num_speculative_tokens=2), model,
                      torch.float32, target)
    assert (ngram.num_spec_tokens, ngram.num_draft_extra, ngram.needs_host_tokens) == (2, 0, True)
    assert (ngram.draft.num_kv_layers, ngram.draft_probs_bytes_per_slot) == (0, 0)


def test_engine_takes_sizes_from_the_plan_and_stats_from_the_strategy():
    k = 3
    engine = build_engine(accepting.model_dir(), PytorchEngineConfig(max_batch_size=4, **accepting.BASE),
                    accepting.spec(k), progress=False)
    plan = engine.spec_plan
    assert engine.scheduler.num_draft_extra == plan.num_draft_extra == k - 1
    assert engine.num_spec_tokens == plan.num_spec_tokens == k
    assert engine.spec_stats is engine.strategy.stats
    seqs = engine.generate([list(p) for p in accepting.prompts()], accepting.GREEDY)
    accepting.assert_real_acceptance([s.spec_stats for s in seqs], k)
    assert [s.generated_ids for s in seqs] == accepting.reference(0).token_ids
    assert accepting.counts(engine.spec_stats) == accepting.counts(
        accepting.total([s.spec_stats for s in seqs]))
    engine.spec_stats = SpecDecodeStats()           # a benchmark's reset after its warm-up
    assert engine.strategy.stats.num_drafts == 0
    plain = build_engine(accepting.model_dir(), PytorchEngineConfig(max_batch_size=4, **accepting.BASE),
                   progress=False)
    plain.generate([list(accepting.prompts()[0])], GenerationConfig(max_new_tokens=4))
    assert plain.spec_stats.num_drafts == 0 and plain.scheduler.num_draft_extra == 0
