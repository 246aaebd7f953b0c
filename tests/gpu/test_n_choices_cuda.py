"""n choices on a GPU (issue 22, part 2): a fork copies KV blocks (the target's and the MTP
draft's) and the linear-attention state by device indexing before the prefill forward, then the
choices decode through CUDA graphs and async scheduling. The embedded model in float32, MTP k=3
and plain: each prompt is prefilled once ((P - 1) + n tokens), and every choice equals the same
request sent separately in a batch of the same shape (n requests of the prompt, submitted
together; sampled ones with seed + i), greedy and sampled. Skipped without CUDA."""
import pytest

from lmdeploy_lite.messages import GenerationConfig, PytorchEngineConfig
from lmdeploy_lite.pytorch.engine.build import build_engine
from lmdeploy_lite.pytorch.engine.engine import Engine
from tests.helpers import accepting

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]


def _run(k: int, gen: GenerationConfig, grouped: bool) -> tuple[list[list[int]], Engine, list]:
    cfg = PytorchEngineConfig(dtype='float32', device='cuda', block_size=16, session_len=256,
                              max_batch_size=32)
    engine = build_engine(accepting.model_dir(), cfg, accepting.spec(k), progress=False)
    seqs = []
    for prompt in accepting.prompts():
        if grouped:
            seqs += engine.add_group(list(prompt), gen)
            continue
        for i in range(gen.n):
            seed = None if gen.random_seed is None else gen.random_seed + i
            seqs.append(engine.add_request(list(prompt), GenerationConfig(
                **{**gen.__dict__, 'n': 1, 'random_seed': seed})))
    while engine.has_work:
        engine.step()
    engine.scheduler.bm.check()
    return [s.generated_ids for s in seqs], engine, seqs


@pytest.mark.parametrize('k', [0, 3])
@pytest.mark.parametrize('sampled', [False, True], ids=['greedy', 'sampled'])
def test_forked_choices_through_graphs_and_async_equal_separate_requests(k, sampled):
    gen = GenerationConfig(max_new_tokens=48, ignore_eos=True, n=4,
                           **(dict(do_sample=True, temperature=0.9, random_seed=7) if sampled
                              else {}))
    outputs, engine, seqs = _run(k, gen, grouped=True)
    assert engine.async_scheduling
    if k:
        assert sum(s.spec_stats.num_accepted_tokens for s in seqs) > 0, 'no draft accepted'
    assert engine.num_prefill_tokens == sum(len(p) - 1 + 4 for p in accepting.prompts())
    separate, _, _ = _run(k, gen, grouped=False)
    assert outputs == separate
    if not sampled:
        assert all(len({tuple(o) for o in outputs[i:i + 4]}) == 1 for i in range(0, 16, 4))
