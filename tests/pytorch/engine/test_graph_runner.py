"""GraphRunner's static buffers and batch padding, on CPU (static-buffer mode: the same copies
and padding as with CUDA graphs, the forward run eagerly). CUDA graphs themselves: tests/gpu."""
import pytest

from lmdeploy_lite.messages import GenerationConfig, PytorchEngineConfig, SpeculativeConfig
from lmdeploy_lite.pytorch.backends.cuda.graph_runner import batch_buckets
from lmdeploy_lite.pytorch.engine.engine import Engine

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], list(range(20, 45))]
GEN = GenerationConfig(max_new_tokens=12, ignore_eos=True)


def test_batch_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert batch_buckets(64)[-3:] == [32, 48, 64]


def _generate(path, spec, graphs: bool, padded: int = 0):
    cfg = PytorchEngineConfig(dtype='float64', device='cpu', block_size=8, session_len=96,
                              max_batch_size=8)
    engine = Engine(path, cfg, spec, progress=False)
    if graphs:
        engine.agent.enable_graphs([2, 4, 8], max_blocks=16)
        if padded:     # as if another DP rank had a bigger batch: pad to its bucket
            step = engine.agent.step

            def padded_step(inputs, sampling):
                inputs.padded_batch_size = padded
                return step(inputs, sampling)
            engine.agent.step = padded_step
    tokens = [s.generated_ids for s in engine.generate(PROMPTS, GEN)]
    if graphs:
        agent = engine.agent if spec is None else engine.agent.target
        assert agent.graph.num_replays > 0
        if spec is not None:
            assert all(r.num_replays > 0 for r in engine.agent.proposer.graphs.values())
    return tokens


@pytest.mark.parametrize('spec', [None, SpeculativeConfig(num_speculative_tokens=2)],
                         ids=['ar', 'mtp'])
def test_padded_static_buffers_give_the_eager_tokens(spec, tiny_ckpt):
    path = tiny_ckpt(True)
    eager = _generate(path, spec, graphs=False)
    assert _generate(path, spec, graphs=True) == eager
    assert _generate(path, spec, graphs=True, padded=7) == eager
