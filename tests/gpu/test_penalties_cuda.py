"""Penalties on a GPU (issue 22, part 3): a penalised greedy batch must not take the CUDA fast
paths that end in a bare argmax (`SpecAgent.plain_graph`, the cached greedy tables), and its
output through CUDA graphs, async scheduling and MTP with every draft count (the K_CYCLE hook:
plain steps included) equals eager plain decoding on the same GPU. The embedded model in
float32 (CUDA graphs need it; its float32 speculative output equals plain output, as
test_cuda_backend.py checks without penalties). Skipped without CUDA."""
import pytest

from lmdeploy_lite.messages import GenerationConfig, PytorchEngineConfig
from lmdeploy_lite.pytorch.engine.build import build_engine
from tests.helpers import accepting

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

PENALTIES = [dict(repetition_penalty=1.3), dict(presence_penalty=0.8), dict(frequency_penalty=0.6),
             dict(repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.3)]


def _run(k: int, eager: bool, configs, prompts):
    cfg = PytorchEngineConfig(dtype='float32', device='cuda', block_size=16, session_len=256,
                              max_batch_size=32, eager_mode=eager)
    engine = build_engine(accepting.model_dir(), cfg, accepting.spec(k, dynamic=True) if k else None,
                    progress=False)
    seqs = [engine.add_request(list(p), c) for p, c in zip(prompts, configs, strict=True)]
    while engine.has_work:
        engine.step()
    return seqs, engine


def test_penalised_greedy_through_graphs_and_mtp_equals_eager_plain(monkeypatch):
    accepting.cycle_draft_counts(monkeypatch)
    prompts = [p for p in accepting.prompts() for _ in PENALTIES]
    configs = [GenerationConfig(max_new_tokens=48, ignore_eos=True, **c)
               for _ in accepting.prompts() for c in PENALTIES]
    reference, _ = _run(0, True, configs, prompts)
    seqs, engine = _run(3, False, configs, prompts)
    assert engine.async_scheduling and engine.agent.plain_graph is not None
    assert sum(s.spec_stats.num_accepted_tokens for s in seqs) > 0, 'no draft accepted'
    assert engine.agent.plain_graph.num_replays == 0    # every row penalised: never that graph
    assert [s.generated_ids for s in seqs] == [s.generated_ids for s in reference]
    _, engine = _run(3, False, [accepting.GREEDY] * len(prompts), prompts)
    assert engine.agent.plain_graph.num_replays > 0      # without penalties it still is
