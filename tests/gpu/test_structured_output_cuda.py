"""Structured output on a GPU: a batch of constrained rows (tests/test_structured_output.py's
schemas) beside free ones through CUDA graphs, async scheduling and MTP with every draft count
(the K_CYCLE hook) equals eager plain decoding on the same GPU, every completed output validates,
and the constrained rows never take the greedy plain graph (the free rows still do). The embedded
model in float32 (its speculative output equals plain output there). Skipped without CUDA or
xgrammar."""
import json

import pytest

from lmdeploy_lite.api import EMBEDDED_MODEL_DIR
from lmdeploy_lite.messages import GenerationConfig, PytorchEngineConfig
from lmdeploy_lite.pytorch.engine.build import build_engine
from lmdeploy_lite.tokenizer import load_tokenizer
from tests.helpers import accepting
from tests.test_structured_output import PROMPT, SCHEMAS, formats

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]
jsonschema = pytest.importorskip('jsonschema')
pytest.importorskip('xgrammar')


def _run(k: int, eager: bool, configs, prompt, tokenizer):
    cfg = PytorchEngineConfig(dtype='float32', device='cuda', block_size=16, session_len=256,
                              max_batch_size=32, eager_mode=eager)
    spec = accepting.spec(k, dynamic=True) if k else None
    engine = build_engine(EMBEDDED_MODEL_DIR, cfg, spec, tokenizer=tokenizer, progress=False)
    seqs = [engine.add_request(list(prompt), c) for c in configs]
    while engine.has_work:
        engine.step()
    return seqs, engine


def test_constrained_rows_through_graphs_and_mtp_equal_eager_plain(monkeypatch):
    accepting.cycle_draft_counts(monkeypatch)
    tokenizer = load_tokenizer(EMBEDDED_MODEL_DIR)
    prompt = tokenizer.encode(PROMPT)
    configs = [GenerationConfig(max_new_tokens=48, response_format=f) for f in formats()]
    configs += [GenerationConfig(max_new_tokens=48, ignore_eos=True)] * 4        # free rows
    reference, _ = _run(0, True, configs, prompt, tokenizer)
    seqs, engine = _run(3, False, configs, prompt, tokenizer)
    assert engine.async_scheduling and engine.agent.plain_graph is not None
    assert sum(s.spec_stats.num_accepted_tokens for s in seqs) > 0, 'no draft accepted'
    assert [s.generated_ids for s in seqs] == [s.generated_ids for s in reference]
    done = 0
    for seq, fmt in zip(seqs, formats()):
        if seq.finish_reason == 'stop':
            value = json.loads(tokenizer.decode(seq.generated_ids, skip_special_tokens=True))
            jsonschema.validate(value, fmt['json_schema']['schema'] if 'json_schema' in fmt
                                else {'type': 'object'})
            done += 1
    assert done >= len(SCHEMAS) - 1
    assert engine.agent.plain_graph.num_replays > 0      # the free rows, once the others ended
