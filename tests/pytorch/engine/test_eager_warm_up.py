"""The eager warm-up at start-up (ModelAgent/SpecAgent.warm_eager, graph_runner.eager_step_lens)
and the aligned packing of a step's inputs: what keeps Triton from compiling a kernel variant in
the middle of a served step on the GPU (measured there: 1-2.5 s per variant, 40 s for fla's
varlen form). The compiles themselves need CUDA (benchmarks/bench_first_shapes.py); here, on the
CPU, the shapes the warm-up runs, the alignment of every packed part, and that the warm-up
writes the reserved block 0 and state slot 0 and nothing else, the engine's output unchanged."""
import torch

from lmdeploy_lite.api import EMBEDDED_MODEL_DIR
from lmdeploy_lite.messages import PytorchEngineConfig
from lmdeploy_lite.pytorch.backends.cuda.graph_runner import eager_step_lens
from lmdeploy_lite.pytorch.backends.cuda.paged_attention import prefill_num_splits
from lmdeploy_lite.pytorch.engine.build import build_engine
from lmdeploy_lite.pytorch.strategies.base import pack_model_inputs
from tests.helpers import accepting
from tests.helpers.accepting import SHORT


def test_packed_parts_start_aligned_whatever_their_sizes():
    chunks = [[5, 6, 7], [8], [9, 10, 11, 12, 13]]                # 9 tokens, 3 sequences
    inputs = pack_model_inputs(chunks, [0, 4, 2], [[1], [2, 3, 4], [5]], [1, 2, 3], False, 'cpu')
    for name in ('input_ids', 'q_lens', 'history_lens', 'state_slots', 'state_index',
                 'block_tables'):
        assert getattr(inputs, name).data_ptr() % 16 == 0, name
    assert inputs.input_ids.tolist() == [5, 6, 7, 8, 9, 10, 11, 12, 13]
    assert inputs.q_lens.tolist() == [3, 1, 5] and inputs.history_lens.tolist() == [0, 4, 2]
    assert inputs.state_slots.tolist() == [1, 2, 3] and inputs.state_index.tolist() == [0, 0, 0]
    assert inputs.block_tables.tolist() == [[1, 0, 0], [2, 3, 4], [5, 0, 0]]
    assert inputs.positions.tolist() == [0, 1, 2, 4, 2, 3, 4, 5, 6]


def test_eager_step_lens_cover_each_split_class_at_both_parities():
    shapes = eager_step_lens(4096, 512)
    assert all(sum(lens) <= 4096 for lens in shapes)
    varlen = [lens for lens in shapes if sum(n > 512 for n in lens) >= 2]      # fla's varlen form
    assert varlen and any(1 in lens for lens in varlen)
    q = lambda tokens: torch.empty(tokens, 1, 8, dtype=torch.bfloat16)         # noqa: E731
    for splits in (8, 4, 2, 1):
        group = [lens for lens in shapes if prefill_num_splits(q(sum(lens))) == splits]
        assert any(sum(lens) % 16 == 0 for lens in group), splits
        assert any(sum(lens) % 2 and 1 in lens for lens in group), splits
    assert not [s for s in eager_step_lens(1024, 512) if sum(n > 512 for n in s) >= 2]
    assert max(sum(s) for s in eager_step_lens(1024, 512)) == 1024


def _spec_engine():
    cfg = PytorchEngineConfig(**{**accepting.BASE, 'session_len': 512})
    return build_engine(EMBEDDED_MODEL_DIR, cfg, accepting.spec(3), progress=False)


def _cache_tensors(engine) -> dict[str, tuple[torch.Tensor, int]]:
    """name -> (tensor, its dim of blocks or state slots)."""
    target, draft = engine.agent.target.caches, engine.agent.proposer.caches
    tensors = {f'kv{i}': (t, 1) for i, t in enumerate(target.kv)}
    tensors.update({f'state{i}': (t, 1) for i, t in enumerate(target.states)})
    tensors.update({f'draft_kv{i}': (t, 1) for i, t in enumerate(draft.kv)})
    return tensors


def test_warm_up_writes_the_reserved_rows_only_and_changes_no_token():
    engine = _spec_engine()
    before = {name: t.clone() for name, (t, _) in _cache_tensors(engine).items()}
    engine.agent.warm_eager(eager_step_lens(300, 64), engine.cache_config.block_size)
    for name, (t, dim) in _cache_tensors(engine).items():
        reserved, rest = t.narrow(dim, 0, 1), t.narrow(dim, 1, t.shape[dim] - 1)
        assert torch.equal(rest, before[name].narrow(dim, 1, t.shape[dim] - 1)), name
        assert not torch.equal(reserved, before[name].narrow(dim, 0, 1)), name   # it ran
    prompts = [list(p) for p in accepting.prompts()]
    warmed = [s.generated_ids for s in engine.generate(prompts, SHORT)]
    assert warmed == [s.generated_ids for s in _spec_engine().generate(prompts, SHORT)]
