"""backends/cuda argmax, greedy_accept and rotary_cos_sin against backends/default: ties, NaN,
-inf rows, signed zeros, 16-bit logits, strided rows; every draft/placeholder pattern of a greedy
verify; RoPE rows over long positions (torch's bits on a GPU, where libdevice's cosf/sinf are the
ones torch calls; numpy's under the interpreter)."""
from __future__ import annotations

import importlib

import pytest
import torch

from lmdeploy_lite.pytorch.backends.default import greedy as reference
from lmdeploy_lite.pytorch.backends.default.rotary import rotary_cos_sin


def cuda_module(name: str):
    return importlib.import_module(f'lmdeploy_lite.pytorch.backends.cuda.{name}')


def _check_argmax(logits: torch.Tensor):
    out = cuda_module('greedy').argmax(logits)
    expected = logits.float().cpu().argmax(-1)
    assert out.dtype == torch.long and out.shape == logits.shape[:-1]
    assert torch.equal(out.cpu(), expected), (out, expected)


@pytest.mark.parametrize('shape', [(1, 32768), (3, 70001), (2, 4, 5000), (5, 7), (0, 64)])
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
def test_argmax_random(kernel_device, shape, dtype):
    gen = torch.Generator().manual_seed(sum(shape))
    _check_argmax(torch.randn(*shape, generator=gen).to(kernel_device, dtype))


def test_argmax_ties_and_special_values(kernel_device):
    gen = torch.Generator().manual_seed(0)
    ties = torch.randint(0, 4, (6, 9000), generator=gen).float()      # many equal maxima
    ties[1, 8999] = 10.0                                                # the last element wins
    ties[2] = float('-inf')                                             # all -inf: index 0
    ties[3, 5000], ties[3, 7000] = float('nan'), float('nan')           # first NaN wins
    ties[4] = 0.0
    ties[4, :3000] = -0.0                                               # -0.0 == +0.0: index 0
    ties[5, 4321] = float('inf')
    _check_argmax(ties.to(kernel_device))
    _check_argmax(ties.to(kernel_device)[:, ::3])                       # strided rows


def test_argmax_float64_is_torchs(kernel_device):
    logits = torch.randn(3, 100, dtype=torch.float64).to(kernel_device)
    _check_argmax(logits)


@pytest.mark.parametrize('with_counts', [False, True])
def test_greedy_accept(kernel_device, with_counts):
    gen = torch.Generator().manual_seed(1)
    for k in (0, 1, 3, 5):
        batch = 64
        target = torch.randint(0, 3, (batch, k + 1), generator=gen)
        drafts = torch.randint(-1, 3, (batch, k), generator=gen)    # -1: a placeholder
        counts = torch.randint(0, k + 1, (batch,), generator=gen) if with_counts else None
        expected = reference.greedy_accept(target.clone(), drafts, counts)
        dev = [t if t is None else t.to(kernel_device) for t in (target, drafts, counts)]
        out, accepted = cuda_module('greedy').greedy_accept(*dev)
        assert torch.equal(out.cpu(), expected[0]) and torch.equal(accepted.cpu(), expected[1])
        if k:
            assert 0 < int(expected[1].sum()) < batch * k       # accepted prefixes of every length


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
@pytest.mark.parametrize('rotary_dim,theta', [(64, 1e7), (32, 1e4), (6, 1e6)])
def test_rotary_cos_sin(kernel_device, dtype, rotary_dim, theta):
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim
    inv_freq = (1.0 / theta ** exponent).to(kernel_device)
    last = 262144 if kernel_device == 'cuda' else 4096
    positions = torch.cat([torch.arange(0, last, 7), torch.tensor([last - 1])]).to(kernel_device)
    cos, sin = cuda_module('rotary').rotary_cos_sin(positions, inv_freq, dtype)
    ref_cos, ref_sin = rotary_cos_sin(positions, inv_freq, dtype)
    assert cos.shape == sin.shape == (positions.numel(), rotary_dim) and cos.dtype == dtype
    if kernel_device == 'cuda':        # libdevice = torch's own cosf/sinf: the same bits
        assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)
    else:                              # numpy's functions: within a unit of the last place
        tol = dict(atol=1e-6, rtol=0) if dtype == torch.float32 else dict(atol=8e-3, rtol=0)
        torch.testing.assert_close(cos, ref_cos, **tol)
        torch.testing.assert_close(sin, ref_sin, **tol)
