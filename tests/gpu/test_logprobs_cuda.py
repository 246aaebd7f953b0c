"""Logprobs on a GPU (issue 22, part 1): a batch that asks for them never replays the greedy
plain-step CUDA graph (`SpecAgent.plain_graph`: it returns tokens only), their pinned
non-blocking copies arrive with the tokens under async scheduling, and through CUDA graphs, async
scheduling and MTP with every draft count (the K_CYCLE hook: plain steps included) the tokens and
logprobs equal eager plain decoding's on the same GPU (float32: within 1e-4). The embedded model
in float32 (CUDA graphs need it). Skipped without CUDA."""
import pytest

from lmdeploy_lite.messages import GenerationConfig, PytorchEngineConfig
from lmdeploy_lite.pytorch.engine.build import build_engine
from tests.helpers import accepting

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

GEN = GenerationConfig(max_new_tokens=48, ignore_eos=True, logprobs=5)


def _run(k: int, eager: bool, configs, prompts):
    cfg = PytorchEngineConfig(dtype='float32', device='cuda', block_size=16, session_len=256,
                              max_batch_size=32, eager_mode=eager)
    engine = build_engine(accepting.model_dir(), cfg, accepting.spec(k, dynamic=True) if k else None,
                    progress=False)
    seqs = [engine.add_request(list(p), c) for p, c in zip(prompts, configs, strict=True)]
    logprobs = {s.seq_id: [] for s in seqs}
    while engine.has_work:
        for out in engine.step():
            logprobs[out.seq.seq_id] += out.logprobs or []
    return seqs, [logprobs[s.seq_id] for s in seqs], engine


def test_logprobs_through_graphs_async_and_mtp_equal_eager_plain(monkeypatch):
    accepting.cycle_draft_counts(monkeypatch)
    prompts = list(accepting.prompts())
    configs = [GEN] * len(prompts)
    reference, want, _ = _run(0, True, configs, prompts)
    seqs, got, engine = _run(3, False, configs, prompts)
    assert engine.async_scheduling and engine.agent.plain_graph is not None
    assert sum(s.spec_stats.num_accepted_tokens for s in seqs) > 0, 'no draft accepted'
    assert engine.agent.plain_graph.num_replays == 0    # logprobs asked: never that graph
    assert [s.generated_ids for s in seqs] == [s.generated_ids for s in reference]
    for g, w, seq in zip(got, want, seqs):
        assert len(g) == len(w) == GEN.max_new_tokens
        assert [e[1][0] for e in g] == seq.generated_ids          # greedy: the top one
        assert [e[0] for e in g] == pytest.approx([e[0] for e in w], abs=1e-4)
        # values, not ids: near-ties among the top 5 may swap places in float32
        assert [v for e in g for v in e[2]] == pytest.approx([v for e in w for v in e[2]],
                                                             abs=1e-4)
    # one row asking is enough to keep the batch off the graph; without any it replays
    mixed = [GEN] + [accepting.GREEDY] * (len(prompts) - 1)
    _, got, engine = _run(3, False, mixed, prompts)
    assert engine.agent.plain_graph.num_replays == 0
    assert [len(g) for g in got] == [GEN.max_new_tokens] + [0] * (len(prompts) - 1)
    _, _, engine = _run(3, False, [accepting.GREEDY] * len(prompts), prompts)
    assert engine.agent.plain_graph.num_replays > 0
