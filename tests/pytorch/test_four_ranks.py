"""Four ranks on CPU processes (what the CPU allows of the four-GPU issue): dp=4 ep=4 and tp=2
dp=2 ep=4 with the MTP draft (k=3), first ONE request (three ranks idle for the whole run, running
dummy target and draft forwards), then 64 concurrent requests; float64 tokens equal a single
process's, with the per-step collective check on. Hard timeouts: a hang fails with a message."""
import time

import pytest

from lmdeploy_lite import GenerationConfig, PytorchEngineConfig, SpeculativeConfig, pipeline
from lmdeploy_lite.pytorch.engine.engine import Engine

BASE = dict(dtype='float64', device='cpu', block_size=8, session_len=64, max_batch_size=64)
SPEC = SpeculativeConfig(num_speculative_tokens=3)
GEN = GenerationConfig(max_new_tokens=8, ignore_eos=True)
PROMPTS = [[(7 * i + 3 * j) % 500 + 2 for j in range(3 + i % 11)] for i in range(64)]


@pytest.fixture(autouse=True)
def strict_collectives(monkeypatch):
    monkeypatch.setenv('LMDEPLOY_LITE_CHECK_COLLECTIVES', '1')
    monkeypatch.setenv('LMDEPLOY_LITE_DIST_TIMEOUT', '60')


@pytest.mark.timeout(600)
@pytest.mark.parametrize('layout', [dict(dp=4, ep=4), dict(tp=2, dp=2, ep=4)],
                         ids=['dp4_ep4', 'tp2_dp2_ep4'])
def test_four_ranks_one_request_then_64(layout, tiny_ckpt):
    path = tiny_ckpt(True, layout='plain')
    single = Engine(path, PytorchEngineConfig(**BASE), SPEC, progress=False)
    want = [s.generated_ids for s in single.generate(PROMPTS, GEN)]
    start = time.monotonic()
    with pipeline(path, PytorchEngineConfig(**layout, **BASE), SPEC, progress=False) as pipe:
        one = pipe(PROMPTS[:1], GEN)
        assert [r.token_ids for r in one] == want[:1]
        many = pipe(PROMPTS, GEN)
    assert [r.token_ids for r in many] == want
    assert all(r.finish_reason == 'length' for r in many)
    assert time.monotonic() - start < 500
