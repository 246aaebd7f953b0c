"""Issue 7 acceptance on one GPU: the CUDA backend (Triton kernels + CUDA graphs).

float32: CUDA graphs on and off give identical tokens, speculative and plain greedy give identical
tokens, and both equal the default (pure PyTorch) backend's. Through pipeline() on the embedded
model: float32 speculative output equals plain output; bf16 prints identical sequences and the
share of tokens before the first divergence. Skipped without CUDA (conftest marks `gpu` tests).
"""
import inspect
import json
import os

import pytest
import torch

from lmdeploy_lite.api import EMBEDDED_MODEL_DIR
from lmdeploy_lite.messages import GenerationConfig, PytorchEngineConfig, SpeculativeConfig
from lmdeploy_lite.pytorch.engine.build import build_engine

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], list(range(20, 49)), [3] * 40]
GEN = GenerationConfig(max_new_tokens=40, ignore_eos=True)


def _run(path, dtype, spec=None, eager=False, prompts=PROMPTS, gen=GEN, backend=None):
    if backend:
        os.environ['LMDEPLOY_LITE_BACKEND'] = backend
    try:
        cfg = PytorchEngineConfig(dtype=dtype, device='cuda', block_size=16, session_len=512,
                                  max_batch_size=32, eager_mode=eager)
        engine = build_engine(path, cfg, spec, progress=False)
        if not eager and backend is None:
            agent = engine.agent if spec is None else engine.agent.target
            assert agent.graph is not None and agent.graph.use_graphs
        seqs = engine.generate(prompts, gen)
        return [s.generated_ids for s in seqs], engine
    finally:
        os.environ.pop('LMDEPLOY_LITE_BACKEND', None)


@pytest.mark.parametrize('moe', [False, True], ids=['dense', 'moe'])
def test_float32_graphs_and_speculation_change_no_token(moe, tiny_ckpt):
    path = tiny_ckpt(moe, layout='multimodal')
    spec = SpeculativeConfig(num_speculative_tokens=3)
    reference, _ = _run(path, 'float32', eager=True, backend='default')
    results = {
        'graphs': _run(path, 'float32')[0],
        'eager': _run(path, 'float32', eager=True)[0],
        'spec graphs': _run(path, 'float32', spec)[0],
        'spec eager': _run(path, 'float32', spec, eager=True)[0],
    }
    for name, tokens in results.items():
        assert tokens == reference, f'{name}: differs from the default backend'
    _, engine = _run(path, 'float32', spec)
    assert engine.agent.step_graphs[3].num_replays > 0   # greedy: whole steps in one replay


@pytest.mark.parametrize('whole', [True, False], ids=['whole', 'parts'])
@pytest.mark.parametrize('moe', [False, True], ids=['dense', 'moe'])
def test_float32_graphs_for_every_draft_count(moe, whole, tiny_ckpt, monkeypatch):
    """Dynamic k through CUDA graphs: each step's k from the cycle (every switch, plain steps
    included), so every whole-step graph (`whole`), or every verify width, greedy draft chain
    and the KV-only pass (`parts`, what sampled batches replay) replay; the tokens equal the
    eager default backend's plain output."""
    from tests.helpers import accepting
    accepting.cycle_draft_counts(monkeypatch)
    if not whole:
        monkeypatch.setattr('lmdeploy_lite.pytorch.spec_decode.spec_agent.STEP_GRAPH_MAX_BATCH', 0)
    path = tiny_ckpt(moe, layout='multimodal')
    reference, _ = _run(path, 'float32', eager=True, backend='default')
    tokens, engine = _run(path, 'float32', SpeculativeConfig(num_speculative_tokens=3))
    assert tokens == reference
    proposer, target = engine.agent.proposer, engine.agent.target
    assert engine.agent.plain_graph.num_replays > 0       # greedy plain steps: one replay
    if whole:
        assert all(engine.agent.step_graphs[k].num_replays > 0 for k in (1, 2, 3))
        return
    assert sorted(target.graphs) == [1, 2, 3, 4]
    assert all(target.graphs[q].num_replays > 0 for q in (2, 3, 4))   # verify widths
    assert all(proposer.chain_graphs[k].num_replays > 0 for k in (1, 2, 3))


def _snippet_prompts(tokenizer, count: int) -> list[list[int]]:
    import collections
    import json as json_module
    text = ''.join(inspect.getsource(m) for m in (collections, json_module.decoder, inspect))
    lines = [ln for ln in text.splitlines() if len(ln.strip()) > 20]
    step = max(1, len(lines) // count)
    return [tokenizer.encode('\n'.join(lines[i * step:i * step + 3]) + '\n')
            for i in range(count)]


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
def test_speculative_pipeline_against_plain(dtype):
    """Through pipeline() (async scheduling on, the CUDA default), 32 prompts x 128 tokens of the
    embedded model: every Response has all its tokens (len(token_ids) == generate_token_len ==
    max_new_tokens, whole sequences compared); float32 speculative output equals plain output
    exactly; bf16 reports identical sequences and the tokens agreeing before the first
    divergence (a position-by-position rate would count tokens after a divergence, and would
    not see a truncated answer)."""
    from transformers import AutoTokenizer

    from lmdeploy_lite import pipeline
    tokenizer = AutoTokenizer.from_pretrained(EMBEDDED_MODEL_DIR)
    prompts = _snippet_prompts(tokenizer, 32)
    gen = GenerationConfig(max_new_tokens=128, ignore_eos=True)
    cfg = PytorchEngineConfig(dtype=dtype, device='cuda', block_size=16, session_len=512,
                              max_batch_size=32)
    results = {}
    for k in (0, 3):
        spec = SpeculativeConfig(num_speculative_tokens=k) if k else None
        with pipeline(None, cfg, spec, progress=False) as pipe:
            assert pipe.engine.async_scheduling
            responses = pipe(prompts, gen)
            stats = pipe.engine.spec_stats
        for r in responses:
            assert len(r.token_ids) == r.generate_token_len == gen.max_new_tokens, \
                (k, r.index, len(r.token_ids), r.generate_token_len)
        results[k] = [r.token_ids for r in responses]
    plain, spec_tokens = results[0], results[3]
    # drafts really accepted, whatever k the dynamic policy ran: on an H100 in float32 k=1 is
    # the fastest here (a k=3 step 1.9x a k=1 step, for 1.7x its tokens), and a run this short
    # (~60 steps) may stay at the k its first timings favoured (benchmarks/diag_accept.py)
    assert stats.num_accepted_tokens > 0.5 * stats.num_draft_tokens, stats
    agreeing = sum(_common_prefix(p, s) for p, s in zip(plain, spec_tokens, strict=True))
    report = {'dtype': dtype, 'identical_sequences': sum(p == s for p, s in zip(plain, spec_tokens)),
              'num_sequences': len(prompts),
              'tokens_before_first_divergence': agreeing / sum(len(p) for p in plain),
              'mean_accepted_length': stats.mean_accepted_length}
    print(f'\n{dtype} speculative vs plain greedy through pipeline():', json.dumps(report))
    out = os.environ.get('OUT')
    if out:
        with open(os.path.join(out, f'{dtype}_spec_vs_plain.json'), 'w') as f:
            json.dump(report, f)
    if dtype == 'float32':
        assert spec_tokens == plain
    else:       # not guaranteed exact (near-ties); measured 1.0 on an H100 (BENCHMARKS.md)
        assert report['tokens_before_first_divergence'] > 0.9, report
    assert torch.cuda.is_available()
