"""extract_hidden_states on CUDA (issue 23): async scheduling on (the rows come home with each
step's tokens through pinned, non-blocking copies) and CUDA graphs requested (float32: the engine
would capture them; extraction runs decode steps eagerly): the files equal the CPU's (tiny MoE:
the same tokens; hidden states within 1e-9 relative in float64, 1e-4 in float32). Skipped
without CUDA."""
import os

import pytest
import torch
from safetensors.torch import load_file

from lmdeploy_lite import GenerationConfig, PytorchEngineConfig, SpeculativeConfig, pipeline

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], list(range(20, 49))]
GEN = GenerationConfig(max_new_tokens=16, ignore_eos=True)


@pytest.mark.parametrize('dtype, tolerance', [('float64', 1e-9), ('float32', 1e-4)])
def test_cuda_files_equal_cpu_files(dtype, tolerance, tiny_ckpt, tmp_path):
    path = tiny_ckpt(True, layout='multimodal')
    files = {}
    for device in ('cpu', 'cuda'):
        spec = SpeculativeConfig(method='extract_hidden_states',
                                 aux_hidden_state_layer_ids=(0, 2, 4),
                                 hidden_states_dir=str(tmp_path / device))
        cfg = PytorchEngineConfig(dtype=dtype, device=device, block_size=16, session_len=128,
                                  max_batch_size=8, async_scheduling=device == 'cuda')
        with pipeline(path, cfg, spec, progress=False) as pipe:
            files[device] = [load_file(r.hidden_states_path) for r in pipe(PROMPTS, GEN)]
    for cpu, cuda in zip(files['cpu'], files['cuda']):
        assert cpu['token_ids'].equal(cuda['token_ids'])
        want, got = cpu['hidden_states'], cuda['hidden_states']
        assert got.dtype == getattr(torch, dtype) and got.shape == want.shape
        assert ((got - want).abs().max() / want.abs().max()).item() < tolerance
    assert all(len(os.listdir(tmp_path / d)) == len(PROMPTS) for d in files)
