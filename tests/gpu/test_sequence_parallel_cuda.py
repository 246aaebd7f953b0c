"""Sequence parallelism on two GPUs (issue 24): tp=2 with `sequence_parallel=True` (NCCL
reduce-scatters and row all-gathers) gives the one-process CPU engine's greedy tokens in float64
(CUDA runs float64 eagerly; the CPU engine's equal transformers', tests/pytorch/
test_sequence_parallel.py: transformers itself cannot be the reference here, since with fla-core
installed it runs fla's Triton kernels, which take no CPU tensors), dense and MoE (tp=2 ep=2: each TP rank dispatches its own token shard), odd
prompt lengths in prefill chunks, with the collective trace check on.

Hard limits: pytest-timeout, and a short collective timeout so that a hang becomes an error.
"""
import time

import pytest
import torch

from lmdeploy_lite import GenerationConfig, PytorchEngineConfig, pipeline

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 6, 7, 8, 9], list(range(20, 41)), [10, 11, 12], [300, 301, 2, 450, 3, 3, 17]]
GEN = GenerationConfig(max_new_tokens=8, ignore_eos=True)


@pytest.mark.timeout(480)
@pytest.mark.parametrize('moe', [False, True], ids=['dense', 'moe'])
def test_tp2_sequence_parallel_gives_one_process_tokens(moe, tiny_ckpt, monkeypatch):
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count < 2:
        pytest.skip(f'needs 2 GPUs, this machine has {count}')
    monkeypatch.setenv('LMDEPLOY_LITE_CHECK_COLLECTIVES', '1')
    monkeypatch.setenv('LMDEPLOY_LITE_DIST_TIMEOUT', '60')
    layout = dict(tp=2, ep=2) if moe else dict(tp=2)
    config = PytorchEngineConfig(**layout, sequence_parallel=True, device='cuda',
                                 dtype='float64', block_size=16, session_len=64,
                                 max_prefill_token_num=5, max_mixed_token_num=5)
    start = time.monotonic()
    with pipeline(tiny_ckpt(moe), config, progress=False) as pipe:
        responses = pipe(PROMPTS, GEN)
    assert time.monotonic() - start < 400
    cpu = PytorchEngineConfig(device='cpu', dtype='float64', block_size=16, session_len=64)
    with pipeline(tiny_ckpt(moe), cpu, progress=False) as pipe:
        expected = pipe(PROMPTS, GEN)
    assert [r.token_ids for r in responses] == [r.token_ids for r in expected]
    assert all(len(r.token_ids) == GEN.max_new_tokens for r in expected)
