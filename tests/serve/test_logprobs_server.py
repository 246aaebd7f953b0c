"""Logprobs through the official `openai` client against the real server (the shared speculative
server of tests/serve/conftest.py: the embedded model, MTP k=3, float64): chat's `logprobs` +
`top_logprobs` and the completions' legacy `logprobs` are well-formed, streamed chunks carry
what the whole response does, drafts really get accepted and the logprobs equal plain decoding's
(in this process, float32: within 1e-4), and out-of-range values are 400s naming the field."""
import pytest

for _module in ('fastapi', 'uvicorn', 'prometheus_client'):
    pytest.importorskip(_module, reason="needs the 'serve' extra")
openai = pytest.importorskip('openai')

from lmdeploy_lite.messages import (GenerationConfig, PytorchEngineConfig,  # noqa: E402
                                    SpecDecodeStats)
from tests.helpers import accepting  # noqa: E402
from tests.helpers.accepting import assert_real_acceptance  # noqa: E402
from tests.serve.live_server import SESSION_LEN, SPEC_K, chat  # noqa: E402

MAX_TOKENS = 20
GREEDY = dict(model='embedded', temperature=0, max_tokens=MAX_TOKENS,
              extra_body={'ignore_eos': True})


@pytest.fixture(scope='module')
def plain_logprobs() -> list:
    """Plain decoding (no speculation) of accepting.TEXTS with logprobs=5, in this process,
    float32: Responses."""
    from lmdeploy_lite import pipeline
    config = PytorchEngineConfig(**{**accepting.BASE, 'dtype': 'float32',
                                    'session_len': SESSION_LEN})
    with pipeline(None, config, progress=False) as pipe:
        return pipe(list(accepting.TEXTS),
                    GenerationConfig(max_new_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5))


def spec_stats(usage) -> SpecDecodeStats:
    spec = usage.spec_decode                                 # the server's `usage` extension
    return SpecDecodeStats(spec['num_drafts'], spec['num_draft_tokens'],
                           spec['num_accepted_tokens'], spec['accepted_per_position'])


def assert_sorted(values):
    assert all(a >= b for a, b in zip(values, values[1:])), values


def chat_entries(response) -> list:
    return response.choices[0].logprobs.content


@pytest.mark.timeout(120)
def test_chat_and_completion_logprobs_are_well_formed_streamed_or_not(spec_client):
    text = accepting.TEXTS[0]
    done = spec_client.chat.completions.create(messages=chat(text), logprobs=True,
                                               top_logprobs=5, **GREEDY)
    entries = chat_entries(done)
    assert len(entries) == done.usage.completion_tokens == MAX_TOKENS
    for entry in entries:
        top = entry.top_logprobs
        assert len(top) == 5
        assert_sorted([t.logprob for t in top])
        # greedy: the chosen token is the most likely one
        assert (entry.token, entry.logprob) == (top[0].token, top[0].logprob)
        assert entry.logprob <= 0 and entry.bytes == list(entry.token.encode())
    assert ''.join(e.token for e in entries) == done.choices[0].message.content
    streamed = list(spec_client.chat.completions.create(
        messages=chat(text), logprobs=True, top_logprobs=5, stream=True, **GREEDY))
    joined = [e for c in streamed if c.choices and c.choices[0].logprobs
              for e in c.choices[0].logprobs.content]
    assert [e.model_dump() for e in joined] == [e.model_dump() for e in entries]
    plain = spec_client.chat.completions.create(messages=chat(text), logprobs=True, **GREEDY)
    assert [(e.token, e.logprob, e.top_logprobs) for e in chat_entries(plain)] == \
        [(e.token, e.logprob, []) for e in entries]           # top_logprobs 0: none
    assert spec_client.chat.completions.create(messages=chat(text),
                                               **GREEDY).choices[0].logprobs is None

    completion = spec_client.completions.create(prompt=text, logprobs=3, **GREEDY)
    choice = completion.choices[0]
    logprobs = choice.logprobs
    n = completion.usage.completion_tokens
    assert n == MAX_TOKENS
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) \
        == len(logprobs.text_offset) == n
    assert ''.join(logprobs.tokens) == choice.text                # ASCII code: one char each
    assert logprobs.text_offset == [len(''.join(logprobs.tokens[:i])) for i in range(n)]
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs,
                                   logprobs.top_logprobs):
        assert 3 <= len(top) <= 4                                  # top 3 and the chosen
        assert_sorted(list(top.values()))
        assert next(iter(top.items())) == (token, logprob)
    chunks = list(spec_client.completions.create(prompt=text, logprobs=3, stream=True, **GREEDY))
    parts = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [t for part in parts for t in part.tokens] == logprobs.tokens
    assert [t for part in parts for t in part.token_logprobs] == logprobs.token_logprobs
    assert [t for part in parts for t in part.top_logprobs] == logprobs.top_logprobs
    assert [t for part in parts for t in part.text_offset] == logprobs.text_offset


@pytest.mark.timeout(120)
def test_speculative_logprobs_equal_plain_decodings(spec_client, plain_logprobs):
    """MTP k=3 on the server (drafts accepted: asserted first) against plain decoding in this
    process: the same tokens, and logprobs (chosen and top 5) within 1e-4."""
    done = [spec_client.completions.create(prompt=text, logprobs=5, **GREEDY)
            for text in accepting.TEXTS]
    assert_real_acceptance([spec_stats(d.usage) for d in done], SPEC_K)
    for d, want in zip(done, plain_logprobs):
        logprobs = d.choices[0].logprobs
        assert d.choices[0].text == want.text
        assert len(logprobs.token_logprobs) == len(want.logprobs) == MAX_TOKENS
        assert logprobs.token_logprobs == pytest.approx([e.logprob for e in want.logprobs],
                                                        abs=1e-4)
        for top, entry in zip(logprobs.top_logprobs, want.logprobs):
            want_top = list(entry.top_logprobs.values())
            assert list(top.values())[:5] == pytest.approx(want_top, abs=1e-4)


@pytest.mark.timeout(60)
def test_out_of_range_logprobs_get_400_naming_the_field(spec_client):
    cases = [('chat', dict(logprobs=True, top_logprobs=21), 'top_logprobs',
              'top_logprobs=21: must be in [0, 20]'),
             ('chat', dict(top_logprobs=2), 'top_logprobs', 'needs "logprobs": true'),
             ('chat', dict(logprobs=False, top_logprobs=2), 'top_logprobs', 'needs "logprobs"'),
             ('chat', dict(logprobs=1), 'logprobs', 'logprobs=1: must be true or false'),
             ('completions', dict(logprobs=6), 'logprobs', 'logprobs=6: must be in [0, 5]'),
             ('completions', dict(logprobs=-1), 'logprobs', 'logprobs=-1: must be in [0, 5]'),
             ('completions', dict(logprobs=True), 'logprobs', 'must be an integer')]
    for endpoint, fields, param, message in cases:
        with pytest.raises(openai.BadRequestError) as e:
            if endpoint == 'chat':
                spec_client.chat.completions.create(messages=chat('hi'), **GREEDY, **fields)
            else:
                spec_client.completions.create(prompt='hi', **GREEDY, **fields)
        assert e.value.status_code == 400
        assert e.value.body['param'] == param and message in e.value.body['message'], \
            (fields, e.value.body)
    ok = spec_client.completions.create(prompt='hi', logprobs=0, **{**GREEDY, 'max_tokens': 2})
    assert len(ok.choices[0].logprobs.top_logprobs[0]) == 1          # the chosen token only


@pytest.mark.timeout(60)
def test_n_choices_each_carry_their_logprobs(spec_client):
    done = spec_client.chat.completions.create(messages=chat(accepting.TEXTS[1]), n=2,
                                               logprobs=True, top_logprobs=1, **GREEDY)
    assert len(done.choices) == 2
    entries = [[(e.token, e.logprob) for e in c.logprobs.content] for c in done.choices]
    assert [len(e) for e in entries] == [MAX_TOKENS] * 2
    assert done.usage.completion_tokens == 2 * MAX_TOKENS
    # greedy: the same choice twice (float64: rows of different steps agree to rounding)
    assert [t for t, _ in entries[0]] == [t for t, _ in entries[1]]
    assert [v for _, v in entries[0]] == pytest.approx([v for _, v in entries[1]], abs=1e-9)


def test_token_strings_bytes_and_text_offsets_of_split_characters():
    """Byte-level BPE splits 'é' and '世界' over tokens: each token's bytes are its own piece
    (joined: the text's UTF-8), its string the tokenizer's decoding of it alone, and a
    character's offset is counted once it is complete."""
    from lmdeploy_lite.api import EMBEDDED_MODEL_DIR
    from lmdeploy_lite.messages import TokenLogprobs
    from lmdeploy_lite.serve.openai.logprobs import CompletionLogprobs, TokenStrings
    from lmdeploy_lite.tokenizer import load_tokenizer
    tokenizer = load_tokenizer(EMBEDDED_MODEL_DIR)
    strings = TokenStrings(tokenizer)
    text = 'héllo 世界 def'
    ids = tokenizer.encode(text)
    assert b''.join(strings.bytes(t) for t in ids) == text.encode()
    assert any(strings.text(t) == '\ufffd' for t in ids)          # a piece of a character
    assert [strings.text(t) for t in ids] == [tokenizer.decode([t]) for t in ids]
    entries = [TokenLogprobs(t, -1.0, {}) for t in ids]
    legacy = CompletionLogprobs(strings, skip_special_tokens=True)
    first, rest = legacy.add(entries[:3]), legacy.add(entries[3:])   # two stream chunks
    offsets = first['text_offset'] + rest['text_offset']
    assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[-1] < len(text)
    assert offsets[-1] == len(text) - len(strings.text(ids[-1]))
    special = tokenizer.convert_tokens_to_ids('<|im_end|>')
    assert strings.text(special) == '<|im_end|>'
    assert strings.bytes(special) == b'<|im_end|>'
    # chat's logprobs are written as JSON text: OpenAI's document (-inf: null)
    import json
    from lmdeploy_lite.serve.openai.logprobs import chat_logprobs_json
    entries = [TokenLogprobs(t, -0.5 * i, {u: -1e-7 * i for u in (special, *ids[:i])})
               for i, t in enumerate(ids)] + [TokenLogprobs(ids[0], float('-inf'), {})]

    def top(token_id, logprob):
        return {'token': strings.text(token_id), 'logprob': logprob,
                'bytes': list(strings.bytes(token_id))}
    assert json.loads(chat_logprobs_json(strings, entries)) == {'content': [
        {**top(e.token_id, e.logprob if e.logprob > float('-inf') else None),
         'top_logprobs': [top(t, lp) for t, lp in e.top_logprobs.items()]} for e in entries]}


@pytest.mark.timeout(120)
def test_a_huge_logprobs_response_stalls_no_stream_and_no_health_check(server):
    """The hold-out probe's 23 MB response (n=16, top_logprobs=20, 1,000 tokens: a 21 s stall
    of the event loop), scaled by tokens to 100 (~2 MB, ~2 s of stall before responses were
    built and serialized off the loop): meanwhile another client's streams keep every
    inter-chunk gap under 250 ms, and /health, asked every 20 ms, answers within 100 ms. (The
    tiny model's server: its steps take milliseconds, so a gap is the server's, not a step's.)"""
    import threading
    import time

    import httpx

    from tests.serve.live_server import headers
    url, auth = server.url, headers()
    done, out, gaps, health = threading.Event(), {}, [], []

    def big():
        out['big'] = httpx.post(url + '/v1/chat/completions', timeout=100, headers=auth, json={
            'messages': chat('tell me everything'), 'n': 16, 'logprobs': True,
            'top_logprobs': 20, 'max_tokens': 100, 'temperature': 1.0, 'ignore_eos': True})
        done.set()

    def streams():
        while not done.is_set():
            last = None
            with httpx.stream('POST', url + '/v1/completions', timeout=60, headers=auth, json={
                    'prompt': 'def main(', 'max_tokens': 40, 'temperature': 0, 'stream': True,
                    'ignore_eos': True}) as r:
                for line in r.iter_lines():
                    now = time.perf_counter()
                    if line.startswith('data: ') and line != 'data: [DONE]':
                        if last is not None:
                            gaps.append(now - last)
                        last = now

    def probe():
        with httpx.Client(base_url=url, timeout=10) as http:
            while not done.is_set():
                start = time.perf_counter()
                assert http.get('/health').status_code == 200
                health.append(time.perf_counter() - start)
                time.sleep(0.02)
    threads = [threading.Thread(target=f, daemon=True) for f in (streams, probe, big)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(100)
    assert out['big'].status_code == 200, out['big'].text[:300]
    size = len(out['big'].content)
    choices = out['big'].json()['choices']
    assert len(choices) == 16 and all(len(c['logprobs']['content']) == 100 for c in choices)
    assert size > 1_500_000, f'{size} bytes: not the response the test is about'
    assert gaps and health
    assert max(gaps) < 0.25, f'a stream stalled {max(gaps):.3f} s beside a {size}-byte response'
    assert max(health) < 0.1, f'/health took {max(health):.3f} s beside a {size}-byte response'
