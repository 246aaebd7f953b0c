"""tools/distill_mtp_head.py on the CPU: the draft chain's attention mask, and a few steps on the
embedded model that write the head's tensors (names, shapes, dtype as the checkpoint's)."""
import json
import os
import sys

import torch
from safetensors import safe_open

from lmdeploy_lite.api import EMBEDDED_MODEL_DIR

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), 'tools'))
from distill_mtp_head import chain_mask, main  # noqa: E402
from train_mtp_head import two_step_mask  # noqa: E402


def test_two_steps_are_train_mtp_heads_mask():
    assert torch.equal(chain_mask(5, 2), two_step_mask(5))


def test_a_draft_step_sees_the_first_steps_prefix_and_its_own_chain():
    n, depth = 4, 3
    mask = chain_mask(n, depth)
    for s in range(depth):
        for j in range(n):
            row = mask[s * n + j].view(depth, n)
            assert row[0].tolist() == [i <= j for i in range(n)]        # first step: causal
            for r in range(1, depth):                                   # the chain: row j, r <= s
                assert row[r].tolist() == [r <= s and i == j for i in range(n)]


def test_a_few_steps_write_the_checkpoints_head(tmp_path):
    generator = torch.Generator().manual_seed(0)
    stream = {'train': torch.randint(3, 4096, (4 * 48,), generator=generator).to(torch.int16),
              'held': torch.randint(3, 4096, (2 * 48,), generator=generator).to(torch.int16)}
    torch.save(stream, tmp_path / 'stream.pt')
    out = tmp_path / 'out'
    main(['--model', EMBEDDED_MODEL_DIR, '--stream', str(tmp_path / 'stream.pt'), '--out',
          str(out), '--device', 'cpu', '--depth', '3', '--seq-len', '48', '--batch-size', '2',
          '--steps', '3'])
    with open(os.path.join(EMBEDDED_MODEL_DIR, 'model.safetensors.index.json')) as f:
        weight_map = json.load(f)['weight_map']
    expected = {}
    for name, shard in weight_map.items():
        if name.startswith('mtp.'):
            with safe_open(os.path.join(EMBEDDED_MODEL_DIR, shard), 'pt') as f:
                expected[name] = (tuple(f.get_slice(name).get_shape()),
                                  f.get_slice(name).get_dtype())
    with safe_open(out / 'mtp_head.safetensors', 'pt') as f:
        written = {n: (tuple(f.get_slice(n).get_shape()), f.get_slice(n).get_dtype())
                   for n in f.keys()}
    assert written == expected and len(written) == 19
    metrics = json.loads((out / 'distill_metrics.json').read_text())
    assert metrics['steps'] == 3 and len(metrics['agreement_after']) == 3
    assert all(0 <= a <= 1 for a in metrics['agreement_before'] + metrics['agreement_after'])
