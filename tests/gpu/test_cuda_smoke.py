"""The engine on a CUDA device with the default (pure PyTorch) backend: same tokens as on CPU,
with and without MTP speculation. Skipped without CUDA (conftest marks `gpu` tests)."""
import pytest
import torch

from lmdeploy_lite.messages import GenerationConfig, PytorchEngineConfig, SpeculativeConfig
from lmdeploy_lite.pytorch.engine.build import build_engine

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], list(range(20, 49))]
GEN = GenerationConfig(max_new_tokens=32, ignore_eos=True)


@pytest.mark.parametrize('moe', [False, True])
def test_cuda_matches_cpu_with_and_without_speculation(moe, tiny_ckpt):
    path = tiny_ckpt(moe, layout='multimodal')
    results = {}
    for device in ('cpu', 'cuda'):
        for spec in (None, SpeculativeConfig(num_speculative_tokens=3)):
            cfg = PytorchEngineConfig(dtype='float64', device=device, block_size=16,
                                      session_len=128, max_batch_size=8)
            engine = build_engine(path, cfg, spec, progress=False)
            results[device, spec is not None] = [s.generated_ids
                                                 for s in engine.generate(PROMPTS, GEN)]
    assert len({str(v) for v in results.values()}) == 1, results
    assert torch.cuda.is_available()
