"""fuse_projections: the same hidden states as the separate GEMMs, for the target (GDN in_proj,
attention q/k/v, MLP and shared-expert gate/up; MoE router + shared gate + shared gate/up when
the parts are kept). On CUDA the parts are dropped; elsewhere (build_model's default off CUDA)
they stay as views of the fused weights, so names, state_dict and loading are unchanged."""
import pytest
import torch

from lmdeploy_lite.pytorch.models.loader import build_model, load_weights
from lmdeploy_lite.pytorch.nn.linear import FusedColumnLinear, fuse_projections
from tests.helpers.step_inputs import make_inputs, shuffled_block_tables


def _run(model):
    from lmdeploy_lite.pytorch.config import CacheConfig
    from lmdeploy_lite.pytorch.cache_engine import CacheEngine
    cache = CacheEngine(model.config, CacheConfig(num_blocks=16, block_size=4,
                                                  num_state_slots=4), torch.float64, 'cpu')
    tables = shuffled_block_tables(2, 6)
    prefill = make_inputs([[3, 4, 5, 6, 7], [8, 9, 10]], [0, 0], tables, [1, 2])
    decode = make_inputs([[11], [12]], [5, 3], tables, [1, 2], is_decoding=True)
    with torch.inference_mode():
        return torch.cat([model(prefill, cache), model(decode, cache)])


@pytest.mark.parametrize('moe', [False, True], ids=['dense', 'moe'])
def test_fused_model_gives_the_same_hidden_states(moe, tiny_ckpt):
    path = tiny_ckpt(moe)
    plain = build_model(path, torch.float64, progress=False, fuse=False)
    assert not any(isinstance(m, FusedColumnLinear) for m in plain.modules())
    dropped = fuse_projections(build_model(path, torch.float64, progress=False, fuse=False))
    assert any(isinstance(m, FusedColumnLinear) for m in dropped.modules())
    assert not any(n.endswith(('.q_proj.weight', '.in_proj_z.weight', '.up_proj.weight'))
                   for n, _ in dropped.named_parameters())
    kept = build_model(path, torch.float64, progress=False)          # CPU: parts kept
    fused = [m for m in kept.modules() if isinstance(m, FusedColumnLinear)]
    assert fused and (not moe or any(len(m.sizes) == 3 and m.sizes[1] == 1 for m in fused))
    assert kept.state_dict().keys() == plain.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(kept.state_dict().values(),
                                                 plain.state_dict().values()))
    fuse_projections(kept)                                             # already fused: no-op
    reference = _run(plain)
    for model in (dropped, kept):
        torch.testing.assert_close(_run(model), reference, rtol=1e-12, atol=1e-12)


def test_kept_parts_are_views_that_loading_updates(tiny_ckpt):
    """A load after fusing (in place, into the parts) reaches the fused GEMM."""
    path = tiny_ckpt(True)
    model = build_model(path, torch.float64, progress=False)
    reference = _run(build_model(path, torch.float64, progress=False))
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()
    load_weights(model, path, progress=False)
    torch.testing.assert_close(_run(model), reference, rtol=0, atol=0)
