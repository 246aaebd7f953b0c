"""`n` choices on /v1/completions and /v1/chat/completions (issue 22, part 2), through the
official `openai` client against the shared embedded-model server (MTP k=3 fixed, float64: a
seed's samples depend on the request alone, which a dynamic draft count breaks): choices carry
their index (a completion request's prompts numbered prompt_index * n + i), a seed makes them
reproducible, streams carry every index to its own finish_reason, usage counts each prompt once
and every choice's tokens, the prompt is prefilled once (the engine's prefill token counter on
/metrics), and n out of range is a 400 naming `n`."""
import random

import pytest

for _module in ('fastapi', 'uvicorn', 'prometheus_client'):
    pytest.importorskip(_module, reason="needs the 'serve' extra")
openai = pytest.importorskip('openai')
httpx = pytest.importorskip('httpx')

from tests.serve.live_server import chat, post, scrape  # noqa: E402

MODEL = 'embedded'
RNG = random.Random(2222)
SAMPLED = dict(temperature=0.9, extra_body={'ignore_eos': True})
GREEDY = dict(temperature=0, extra_body={'ignore_eos': True})
GREEDY_BODY = {'temperature': 0, 'ignore_eos': True}
PREFILL = 'lmdeploy_lite_prefill_tokens_total'


def fresh(n: int) -> list[int]:
    """A token-id prompt no other test sends (shorter than a block: no prefix cache hit)."""
    return [RNG.randrange(3, 500) for _ in range(n)]


def by_index(chunks, text_of) -> tuple[dict[int, str], dict[int, str]]:
    """Streamed chunks joined per choice index: (texts, finish reasons)."""
    texts, finishes = {}, {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, '') + (text_of(choice) or '')
            if choice.finish_reason is not None:
                assert choice.index not in finishes, 'a choice finished twice'
                finishes[choice.index] = choice.finish_reason
    return texts, finishes


@pytest.mark.timeout(120)
def test_seeded_choices_are_reproducible_and_prefilled_once(spec_server, spec_client):
    client = spec_client
    prompt = fresh(20)
    before = scrape(spec_server.url, key=None)[PREFILL]
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, n=3, seed=11,
                                      **SAMPLED)
    assert scrape(spec_server.url, key=None)[PREFILL] - before == 20 - 1 + 3   # one prefill
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert all(c.finish_reason == 'length' for c in first.choices)
    assert len({c.text for c in first.choices}) == 3, 'the choices are not independent'
    assert (first.usage.prompt_tokens, first.usage.completion_tokens) == (20, 24)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, n=3, seed=11,
                                      **SAMPLED)
    assert [c.text for c in again.choices] == [c.text for c in first.choices]
    alone = [client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, seed=11 + i,
                                       **SAMPLED).choices[0].text for i in range(3)]
    assert alone == [c.text for c in first.choices]

    messages = chat('tell me')
    chat_first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                                n=3, seed=5, **SAMPLED)
    chat_again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                                n=3, seed=5, **SAMPLED)
    assert [c.index for c in chat_first.choices] == [0, 1, 2]
    assert [c.message.content for c in chat_again.choices] == \
        [c.message.content for c in chat_first.choices]
    assert chat_first.usage.completion_tokens == 18

    greedy = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, n=3,
                                            **GREEDY)
    single = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                            **GREEDY)
    assert [c.message.content for c in greedy.choices] == [single.choices[0].message.content] * 3
    assert greedy.usage.prompt_tokens == single.usage.prompt_tokens


@pytest.mark.timeout(120)
def test_streamed_choices_each_end_with_their_finish_reason(spec_client):
    client = spec_client
    messages = chat('stream two')
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=7, n=2,
                                           seed=3, **SAMPLED)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=7,
                                                 n=2, seed=3, stream=True,
                                                 stream_options={'include_usage': True},
                                                 **SAMPLED))
    texts, finishes = by_index(chunks, lambda c: c.delta.content)
    assert finishes == {0: 'length', 1: 'length'}
    assert texts == {c.index: c.message.content for c in whole.choices}
    roles = [c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role]
    assert roles == [0, 1]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 14
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens

    prompts = [fresh(6), fresh(9)]         # two prompts: choice index = prompt_index * n + i
    done = client.completions.create(model=MODEL, prompt=prompts, max_tokens=5, n=2, **GREEDY)
    assert [c.index for c in done.choices] == [0, 1, 2, 3]
    singles = [client.completions.create(model=MODEL, prompt=p, max_tokens=5,
                                         **GREEDY).choices[0].text for p in prompts]
    assert [c.text for c in done.choices] == [singles[0]] * 2 + [singles[1]] * 2
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (15, 20)
    streamed = list(client.completions.create(model=MODEL, prompt=prompts, max_tokens=5, n=2,
                                              stream=True, **GREEDY))
    texts, finishes = by_index(streamed, lambda c: c.text)
    assert texts == {c.index: c.text for c in done.choices}
    assert finishes == dict.fromkeys(range(4), 'length')


@pytest.mark.timeout(60)
@pytest.mark.parametrize('endpoint, n', [('completions', 0), ('chat/completions', 17)])
def test_n_out_of_range_is_a_400_naming_n(spec_server, endpoint, n):
    body = {'prompt': 'x'} if endpoint == 'completions' else {'messages': chat('x')}
    r = post(spec_server, f'/v1/{endpoint}', {**body, 'n': n, 'max_tokens': 2}, key=None)
    assert r.status_code == 400 and r.json()['error']['param'] == 'n'
    assert f'n={n}: must be in [1, 16]' in r.json()['error']['message']
    ok = post(spec_server, f'/v1/{endpoint}', {**body, 'n': 2, 'max_tokens': 2}, key=None)
    assert ok.status_code == 200 and [c['index'] for c in ok.json()['choices']] == [0, 1]


@pytest.mark.timeout(60)
def test_a_client_that_leaves_aborts_every_choice(spec_server):
    """A streamed n=3 request whose client goes away after its first chunks: its three choices
    end as aborted (none runs to its length) and none keeps running in the engine."""
    import time
    abort, length = ('lmdeploy_lite_requests_total{outcome="%s"}' % o for o in ('abort', 'length'))
    before = scrape(spec_server.url, key=None)
    payload = {'prompt': fresh(8), 'max_tokens': 110, 'n': 3, 'stream': True, **GREEDY_BODY}
    with httpx.stream('POST', spec_server.url + '/v1/completions', json=payload,
                      timeout=60) as r:
        for seen, line in enumerate(line for line in r.iter_lines() if line.startswith('data')):
            if seen == 4:
                break
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        after = scrape(spec_server.url, key=None)
        if after[abort] - before[abort] == 3 and not after['lmdeploy_lite_num_requests_running']:
            break
        time.sleep(0.05)
    assert (after[abort] - before[abort], after[length] - before[length]) == (3, 0)
    assert after['lmdeploy_lite_num_requests_running'] == 0
