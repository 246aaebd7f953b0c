"""Prefill and mixed steps replayed from CUDA graphs (graph_runner.PrefillGraphRunner) change no
token: float32 on the GPU, the embedded model plain and with MTP k=3 (acceptance asserted),
prefix caching on, prompts arriving while others decode (mixed steps, prefix-cache hits) and
all at once. Whole sequences and draft counts equal the eager engine's (`eager_mode=True`: no
graph at all) and plain greedy's; the graphs' memory is within what the KV plan charged for it.
Skipped without CUDA."""
import pytest

from lmdeploy_lite.messages import PytorchEngineConfig
from lmdeploy_lite.pytorch.engine.build import build_engine
from lmdeploy_lite.pytorch.engine.cache_plan import prefill_graph_bytes
from tests.helpers import accepting
from tests.helpers.accepting import GREEDY, assert_real_acceptance, counts

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]


def _prompts() -> list[list[int]]:
    """The code prompts, a long one (~300 tokens: chunks past the captured sizes run eagerly)
    and two that share a prefix with earlier ones (prefix-cache hits once those are cached)."""
    short = [list(p) for p in accepting.prompts()]
    long = (short[0] + short[1] + short[2] + short[3]) * 10
    return short + [long, short[0] + short[2] * 5, long[:200] + short[1]]


ARRIVE = (0, 0, 0, 2, 4, 9, 14)


def _run(eager: bool, k: int, mixed: bool, cost: float = 0.0):
    cfg = PytorchEngineConfig(dtype='float32', device='cuda', block_size=16, session_len=512,
                              max_batch_size=8, eager_mode=eager, enable_prefix_caching=True,
                              max_prefill_token_num=256, max_mixed_token_num=96 if mixed else 0,
                              max_mixed_step_cost=cost if mixed else 0.0)
    engine = build_engine(accepting.model_dir(), cfg, accepting.spec(k), progress=False)
    prompts, seqs, step = _prompts(), {}, 0
    while engine.has_work or len(seqs) < len(prompts):
        for i, at in enumerate(ARRIVE):
            if at == step:
                seqs[i] = engine.add_request(prompts[i], GREEDY)
        engine.step()
        step += 1
    seqs = [seqs[i] for i in range(len(prompts))]
    agent = engine.agent.target if k else engine.agent
    replays = 0 if eager else agent.prefill_graph.num_replays
    if not eager:         # what the capture added to the reserved memory, as the KV plan charged
        assert agent.prefill_graph.reserved_bytes <= prefill_graph_bytes(
            engine.model_config, 256, engine.dtype)
    return [s.generated_ids for s in seqs], [counts(s.spec_stats) for s in seqs], replays, seqs


@pytest.mark.parametrize('mixed, cost', [(False, 0.0), (True, 0.0), (True, 2.0)],
                         ids=['prefill-first', 'mixed', 'mixed-adaptive'])
@pytest.mark.parametrize('k', [0, 3])
def test_prefill_graphs_change_no_token(k, mixed, cost):
    """`cost`: the mixed budget follows step times (engine/mixed_budget.py), so the two runs
    chunk the prompts differently: the tokens must not differ, the draft counts may (the draft's
    float32 hidden states follow the chunking)."""
    tokens, draft_counts, replays, seqs = _run(False, k, mixed, cost)
    eager_tokens, eager_counts, _, _ = _run(True, k, mixed, cost)
    assert replays >= 3, replays
    if k:
        assert_real_acceptance([s.spec_stats for s in seqs], k)
    assert tokens == eager_tokens
    assert cost or draft_counts == eager_counts
    assert tokens == _run(True, 0, mixed)[0]          # = plain greedy
