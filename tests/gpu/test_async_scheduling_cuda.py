"""Async scheduling on a GPU (real non-blocking copies, events and CUDA graphs): float32 tokens
and accepted counts equal the synchronous engine's. Skipped without CUDA."""
import pytest

from lmdeploy_lite.messages import GenerationConfig, PytorchEngineConfig, SpeculativeConfig
from lmdeploy_lite.pytorch.engine.build import build_engine

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], list(range(20, 49)), [3] * 40]
GEN = GenerationConfig(max_new_tokens=40, ignore_eos=True)


@pytest.mark.parametrize('k', [0, 1, 3])
def test_async_on_cuda_changes_nothing(k, tiny_ckpt):
    path = tiny_ckpt(True, layout='multimodal')
    results = {}
    for async_scheduling in (False, True):
        cfg = PytorchEngineConfig(dtype='float32', device='cuda', block_size=16, session_len=256,
                                  max_batch_size=8, async_scheduling=async_scheduling)
        # fixed k: the accepted counts are compared (a dynamic k follows the step times)
        engine = build_engine(path, cfg, SpeculativeConfig(num_speculative_tokens=k, dynamic=False)
                        if k else None, progress=False)
        seqs = engine.generate(PROMPTS, GEN)
        stats = engine.spec_stats
        results[async_scheduling] = ([s.generated_ids for s in seqs],
                                     (stats.num_drafts, stats.num_accepted_tokens))
        if async_scheduling:
            assert engine.num_continued_steps > 0
    assert results[True] == results[False]
