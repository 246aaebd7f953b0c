"""Prefill and mixed steps replayed from CUDA graphs (graph_runner.PrefillGraphRunner) change no
token: float32 on the GPU, the embedded model plain and with MTP k=3 (acceptance asserted),
prefix caching on, prompts arriving while others decode (mixed steps, prefix-cache hits) and
all at once, chunks of up to 1,024 tokens. Whole sequences and draft counts equal the eager engine's (`eager_mode=True`: no
graph at all) and plain greedy's; the graphs' memory is within what the KV plan charged for it.
Skipped without CUDA."""
import pytest

from lmdeploy_lite.messages import PytorchEngineConfig
from lmdeploy_lite.pytorch.engine.build import build_engine
from lmdeploy_lite.pytorch.engine.cache_plan import prefill_graph_bytes
from tests.helpers import accepting
from tests.helpers.accepting import GREEDY, assert_real_acceptance, counts

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]


def _prompts(long_chunks: bool) -> list[list[int]]:
    """The code prompts, a long one (~300 tokens), two that share a prefix with earlier ones
    (prefix-cache hits once those are cached) and, with `long_chunks`, two of ~900 and ~1,600
    tokens whose chunks of over 512 tokens replay as a step's long row (fla over the bucket)."""
    short = [list(p) for p in accepting.prompts()]
    long = (short[0] + short[1] + short[2] + short[3]) * 10
    prompts = short + [long, short[0] + short[2] * 5, long[:200] + short[1]]
    return prompts + ([long * 3, long[:100] + long * 5] if long_chunks else [])


ARRIVE = (0, 0, 0, 2, 4, 9, 14, 5, 18)


def _run(eager: bool, k: int, mixed: bool, cost: float = 0.0, long_chunks: bool = False):
    budget = 1024 if long_chunks else 256
    cfg = PytorchEngineConfig(dtype='float32', device='cuda', block_size=16,
                              session_len=2048 if long_chunks else 512, max_batch_size=8,
                              eager_mode=eager, enable_prefix_caching=True,
                              max_prefill_token_num=budget,
                              max_mixed_token_num=(700 if long_chunks else 96) if mixed else 0,
                              max_mixed_step_cost=cost if mixed else 0.0)
    engine = build_engine(accepting.model_dir(), cfg, accepting.spec(k), progress=False)
    prompts, seqs, step = _prompts(long_chunks), {}, 0
    agent = engine.agent.target if k else engine.agent
    buckets = []
    if not eager:
        replay = agent.prefill_graph._replay
        agent.prefill_graph._replay = lambda key, rows: (buckets.append(key[0]),   # (bucket,
                                                         replay(key, rows))[1]     # long row)
    while engine.has_work or len(seqs) < len(prompts):
        for i, at in enumerate(ARRIVE[:len(prompts)]):
            if at == step:
                seqs[i] = engine.add_request(prompts[i], GREEDY)
        engine.step()
        step += 1
    seqs = [seqs[i] for i in range(len(prompts))]
    if not eager:         # what the capture added to the reserved memory, as the KV plan charged
        assert agent.prefill_graph.reserved_bytes <= prefill_graph_bytes(
            engine.model_config, budget, engine.dtype)
    return [s.generated_ids for s in seqs], [counts(s.spec_stats) for s in seqs], buckets, seqs


@pytest.mark.parametrize('mixed, cost, long_chunks', [
    (False, 0.0, False), (True, 0.0, False), (True, 2.0, False), (False, 0.0, True),
    (True, 0.0, True)], ids=['prefill-first', 'mixed', 'mixed-adaptive', 'long-prefill-first',
                             'long-mixed'])
@pytest.mark.parametrize('k', [0, 3])
def test_prefill_graphs_change_no_token(k, mixed, cost, long_chunks):
    """`cost`: the mixed budget follows step times (engine/mixed_budget.py), so the two runs
    chunk the prompts differently: the tokens must not differ, the draft counts may (the draft's
    float32 hidden states follow the chunking). `long_chunks`: steps with a chunk of over 512
    tokens replay too (buckets 768 and 1024)."""
    tokens, draft_counts, buckets, seqs = _run(False, k, mixed, cost, long_chunks)
    eager_tokens, eager_counts, _, _ = _run(True, k, mixed, cost, long_chunks)
    assert len(buckets) >= 3, buckets
    assert not long_chunks or max(buckets) > 512, buckets
    if k:
        assert_real_acceptance([s.spec_stats for s in seqs], k)
    assert tokens == eager_tokens
    assert cost or draft_counts == eager_counts
    assert tokens == _run(True, 0, mixed, long_chunks=long_chunks)[0]      # = plain greedy
