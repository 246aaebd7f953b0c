"""fuse_projections (done on CUDA after loading): the same hidden states as the separate GEMMs,
for the target (GDN in_proj, attention q/k/v, MLP and shared-expert gate/up) and the MTP head."""
import pytest
import torch

from lmdeploy_lite.pytorch.models.loader import build_model
from lmdeploy_lite.pytorch.nn.linear import FusedColumnLinear, fuse_projections
from tests.helpers.step_inputs import make_inputs, shuffled_block_tables


@pytest.mark.parametrize('moe', [False, True], ids=['dense', 'moe'])
def test_fused_model_gives_the_same_hidden_states(moe, tiny_ckpt):
    from lmdeploy_lite.pytorch.config import CacheConfig
    from lmdeploy_lite.pytorch.engine.cache_engine import CacheEngine
    path = tiny_ckpt(moe)
    outputs = []
    for fused in (False, True):
        model = build_model(path, torch.float64, progress=False)
        if fused:
            fuse_projections(model)
            assert any(isinstance(m, FusedColumnLinear) for m in model.modules())
            assert not any(n.endswith(('.q_proj.weight', '.in_proj_z.weight', '.up_proj.weight'))
                           for n, _ in model.named_parameters())
        cache = CacheEngine(model.config, CacheConfig(num_blocks=16, block_size=4,
                                                      num_state_slots=4), torch.float64, 'cpu')
        tables = shuffled_block_tables(2, 6)
        prefill = make_inputs([[3, 4, 5, 6, 7], [8, 9, 10]], [0, 0], tables, [1, 2])
        decode = make_inputs([[11], [12]], [5, 3], tables, [1, 2], is_decoding=True)
        with torch.inference_mode():
            outputs.append(torch.cat([model(prefill, cache), model(decode, cache)]))
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-12, atol=1e-12)
