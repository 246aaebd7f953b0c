"""Structured output (response_format through xgrammar) on the embedded model: every completed
output parses and validates against its schema, greedy and sampled, with MTP k=3 on (drafts
accepted) and off; greedy outputs with and without MTP are equal (float64). Also the masks of a
verify (position j masked by the grammar after drafts 1..j) and the refusals."""
import json

import pytest
import torch

xgr = pytest.importorskip('xgrammar', reason="needs the 'structured' extra")
jsonschema = pytest.importorskip('jsonschema')

from lmdeploy_lite.api import EMBEDDED_MODEL_DIR  # noqa: E402
from lmdeploy_lite.messages import (GenerationConfig, PytorchEngineConfig,  # noqa: E402
                                    SpeculativeConfig)
from lmdeploy_lite.pytorch.engine.build import build_engine  # noqa: E402
from lmdeploy_lite.pytorch.grammar import Grammars, TokenMasks  # noqa: E402
from lmdeploy_lite.tokenizer import load_tokenizer  # noqa: E402

torch.set_num_threads(1)
NAME = {'type': 'string', 'maxLength': 8}
SCHEMAS = [
    {'type': 'object', 'properties': {'kind': {'enum': ['cat', 'dog', 'fish']}},
     'required': ['kind']},
    {'type': 'object', 'properties': {'age': {'type': 'integer', 'minimum': 0, 'maximum': 120}},
     'required': ['age']},
    {'type': 'object', 'properties': {'n': {'type': 'integer', 'minimum': -5, 'maximum': 5},
                                      'ok': {'type': 'boolean'}}, 'required': ['n', 'ok']},
    {'type': 'object', 'properties': {'user': {'type': 'object', 'properties': {
        'name': NAME, 'id': {'type': 'integer', 'minimum': 1, 'maximum': 999}},
        'required': ['name', 'id']}}, 'required': ['user']},
    {'type': 'object', 'properties': {'tags': {'type': 'array', 'items': {'enum': ['a', 'b']},
                                               'minItems': 1, 'maxItems': 3}},
     'required': ['tags']},
    {'type': 'object', 'properties': {'xs': {'type': 'array', 'maxItems': 2, 'items': {
        'type': 'integer', 'minimum': 0, 'maximum': 9}}}, 'required': ['xs']},
    {'type': 'object', 'properties': {'name': NAME, 'level': {'enum': [1, 2, 3]}},
     'required': ['name', 'level']},
    {'type': 'object', 'properties': {'point': {'type': 'object', 'properties': {
        'x': {'type': 'integer', 'minimum': 0, 'maximum': 9},
        'y': {'type': 'integer', 'minimum': 0, 'maximum': 9}}, 'required': ['x', 'y']},
        'label': {'const': 'p'}}, 'required': ['point', 'label']},
    {'type': 'array', 'items': {'type': 'boolean'}, 'minItems': 2, 'maxItems': 2},
    {'type': 'object', 'properties': {'mode': {'enum': ['r', 'w']}, 'size': {
        'type': 'integer', 'minimum': 1, 'maximum': 64}, 'path': NAME},
     'required': ['mode', 'size']},
]
PROMPT = 'def to_json(value):\n    return '
K = 3


def new_matcher(grammars, fmt, prompt_ids, stop_ids):
    return grammars.matcher(grammars.compile(fmt, prompt_ids), stop_ids)


def formats():
    return [{'type': 'json_schema', 'json_schema': {'name': f's{i}', 'schema': s}}
            for i, s in enumerate(SCHEMAS)] + [{'type': 'json_object'}]


@pytest.fixture(scope='module')
def engines():
    tokenizer = load_tokenizer(EMBEDDED_MODEL_DIR)
    cfg = PytorchEngineConfig(dtype='float64', device='cpu', block_size=16, session_len=256)
    spec = SpeculativeConfig(num_speculative_tokens=K, dynamic=False)
    return tokenizer, {k: build_engine(EMBEDDED_MODEL_DIR, cfg, s, tokenizer=tokenizer,
                                       progress=False)
                       for k, s in ((0, None), (K, spec))}


def run(engine, tokenizer, **sampling):
    """One batch: every format on the same prompt -> [(ids, text, finish_reason)]."""
    prompt = tokenizer.encode(PROMPT)
    seqs = [engine.add_request(prompt, GenerationConfig(max_new_tokens=48, response_format=f,
                                                        **sampling))
            for f in formats()]
    while engine.has_work:
        engine.step()
    return [(s.generated_ids, tokenizer.decode(s.generated_ids, skip_special_tokens=True),
             s.finish_reason) for s in seqs]


def check_valid(outputs):
    done = [(text, fmt) for (_, text, reason), fmt in zip(outputs, formats())
            if reason == 'stop']
    assert len(done) >= len(outputs) - 2, outputs          # most finish within 48 tokens
    for text, fmt in done:
        value = json.loads(text)
        schema = fmt['json_schema']['schema'] if 'json_schema' in fmt else {'type': 'object'}
        jsonschema.validate(value, schema)


def test_greedy_outputs_follow_their_schemas_and_mtp_changes_nothing(engines):
    tokenizer, by_k = engines
    plain = run(by_k[0], tokenizer)
    check_valid(plain)
    by_k[K].spec_stats = type(by_k[K].spec_stats)()
    spec = run(by_k[K], tokenizer)
    assert [o[0] for o in spec] == [o[0] for o in plain]
    stats = by_k[K].spec_stats
    assert stats.num_accepted_tokens > 0 and stats.mean_accepted_length > 1.2, stats


@pytest.mark.parametrize('k', [0, K])
def test_sampled_outputs_follow_their_schemas(engines, k):
    tokenizer, by_k = engines
    by_k[k].spec_stats = type(by_k[k].spec_stats)()
    check_valid(run(by_k[k], tokenizer, do_sample=True, temperature=1.0, random_seed=5))
    assert k == 0 or by_k[k].spec_stats.num_accepted_tokens > 0, by_k[k].spec_stats


def test_a_verify_masks_each_position_after_the_drafts_before_it():
    """Position j's mask is the grammar's after drafts 1..j; a draft the grammar rejects leaves
    the later positions free; the matcher is back where it was."""
    tokenizer = load_tokenizer(EMBEDDED_MODEL_DIR)
    grammars = Grammars(tokenizer, 4096, [0])
    fmt = {'type': 'json_schema', 'json_schema': {'schema': SCHEMAS[0]}}
    matcher = new_matcher(grammars, fmt, tokenizer.encode(PROMPT), [0])
    valid = tokenizer.encode('{"kind"')
    drafts = torch.tensor([valid[:2] + [tokenizer.encode('}')[0]]])     # the third is refused
    masked = TokenMasks([matcher]).apply(torch.zeros(1, 4, 4096), drafts)[0]
    reference = new_matcher(grammars, fmt, tokenizer.encode(PROMPT), [0])
    for j in range(3):
        bitmask = xgr.allocate_token_bitmask(1, 4096)
        reference.fill_next_token_bitmask(bitmask)
        allowed = [t for t in range(4096) if bitmask[0, t // 32] >> (t % 32) & 1]
        assert (masked[j] == 0).nonzero().flatten().tolist() == allowed
        if j < 2:
            assert reference.accept_token(valid[j])
    assert not reference.accept_token(int(drafts[0, 2]))
    assert (masked[3] == 0).all()                              # never reached: left free
    assert matcher.accept_token(valid[0])                      # rolled back to the start


def test_a_drafted_stop_that_completes_the_output_leaves_the_later_positions_free():
    """Drafts that finish the JSON and then draft eos: the grammar accepts the stop and is done;
    the position after it is free (never emitted), and the matcher rolls back as usual."""
    tokenizer = load_tokenizer(EMBEDDED_MODEL_DIR)
    grammars = Grammars(tokenizer, 4096, [0, 2])
    ids = tokenizer.encode('{"kind": "cat"}')
    matcher = new_matcher(grammars, formats()[0], [], [0, 2])
    assert all(matcher.accept_token(t) for t in ids[:-2])
    masked = TokenMasks([matcher]).apply(torch.zeros(1, 4, 4096), torch.tensor([ids[-2:] + [0]]))
    assert masked[0, 2].isfinite().nonzero().flatten().tolist() == [0, 2]     # stop ids only
    assert masked[0, 3].isfinite().all() and not matcher.is_terminated()
    assert all(matcher.accept_token(t) for t in ids[-2:] + [0]) and matcher.is_terminated()


def test_a_complete_output_may_stop_even_when_min_tokens_blocks_its_stop_ids():
    """Once the JSON is complete the grammar allows only stop ids; min_tokens (-inf there) must
    not leave a row with nothing to sample (NaN) or a token the grammar refuses."""
    tokenizer = load_tokenizer(EMBEDDED_MODEL_DIR)
    matcher = new_matcher(Grammars(tokenizer, 4096, [0, 2]), formats()[0], [], [0, 2])
    assert matcher.accept_string('{"kind": "cat"}')
    logits = torch.randn(1, 4096, dtype=torch.float64)
    logits[0, [0, 2]] = float('-inf')                       # what min_tokens does to stop ids
    masked = TokenMasks([matcher]).apply(logits)[0]
    assert masked.isfinite().nonzero().flatten().tolist() == [0, 2]
    assert not masked.isnan().any() and int(masked.argmax()) == 0


def test_bad_response_formats_are_refused_naming_the_field():
    with pytest.raises(ValueError, match=r'^response_format.json_schema.schema: xgrammar cannot'):
        GenerationConfig(response_format={'type': 'json_schema',
                                          'json_schema': {'schema': {'type': 'nonsense'}}})
    with pytest.raises(ValueError, match=r'^response_format: must be an object whose type'):
        GenerationConfig(response_format={'type': 'xml'})
    assert GenerationConfig(response_format={'type': 'text'}).response_format is None


def test_a_prompt_that_opens_a_thought_gets_the_thought_first():
    """Qwen3.5's template opens `<think>` in the prompt when thinking: the reply thinks freely up
    to `</think>`, then follows the format; with a closed block the format starts at once. The
    thought holds no `<tool_call>`: the reasoning parser would end the thought there."""
    tokenizer = load_tokenizer(EMBEDDED_MODEL_DIR)
    grammars = Grammars(tokenizer, 4096, [0])
    fmt = {'type': 'json_schema', 'json_schema': {'schema': SCHEMAS[0]}}
    reply = '{"kind": "cat"}'
    for prompt, text, ok in (('<think>\n', 'hmm, a pet</think>\n\n' + reply, True),
                             ('<think>\n\n</think>\n\n', reply, True),
                             ('<think>\n', reply, False),
                             ('<think>\n', 'call <tool_call> later</think>\n\n' + reply, False)):
        ids = tokenizer.encode('user: hi\nassistant: ' + prompt)
        matcher = new_matcher(grammars, fmt, ids, [0])
        accepted = all(matcher.accept_token(t) for t in tokenizer.encode(text))
        assert (accepted and matcher.is_completed()) == ok, (prompt, text)   # a JSON in thought


def test_lmdeploys_regex_schema_constrains_the_output(engines):
    """lmdeploy's {"type": "regex_schema", "regex_schema": pattern} (its GenerationConfig
    documents it): every output, greedy and sampled, is a full match and ends with 'stop'."""
    import re
    tokenizer, by_k = engines
    pattern = 'call me [A-Za-z]{1,10}'
    fmt = {'type': 'regex_schema', 'regex_schema': pattern}
    prompt = tokenizer.encode(PROMPT)
    seqs = [by_k[0].add_request(prompt, GenerationConfig(max_new_tokens=24, response_format=fmt,
                                                         **kw))
            for kw in ({}, dict(do_sample=True, random_seed=1),
                       dict(do_sample=True, random_seed=2))]
    while by_k[0].has_work:
        by_k[0].step()
    for s in seqs:
        assert s.finish_reason == 'stop'
        assert re.fullmatch(pattern, tokenizer.decode(s.generated_ids, skip_special_tokens=True))
    with pytest.raises(ValueError, match='^response_format.regex_schema: '):
        GenerationConfig(response_format={'type': 'regex_schema', 'regex_schema': 5})
