"""`serve api_server --api-workers N` end to end (serve/openai/workers.py, executor/relay.py): the
requests of many clients spread over two front-end processes get what the one-process server
gives, /metrics sums every worker's figures, SIGTERM ends open streams as 'abort' and leaves no
process, and a worker that dies stops the whole server (exit 1), none left behind."""
import asyncio
import json
import os
import signal
import socket

import pytest

for _module in ('fastapi', 'uvicorn', 'prometheus_client'):
    pytest.importorskip(_module, reason="needs the 'serve' extra")
openai = pytest.importorskip('openai')
httpx = pytest.importorskip('httpx')

from tests.serve.live_server import (KEY, MODEL, chat, headers, left_alive, scrape,  # noqa: E402
                                     stream_in_background, stream_texts)

GREEDY = dict(temperature=0, extra_body={'ignore_eos': True})
LENGTH = 'lmdeploy_lite_requests_total{outcome="length"}'


def front_ends(srv) -> list[int]:
    """The server's front-end worker processes (spawned children running worker_main)."""
    found = []
    for pid in srv.children():
        try:
            with open(f'/proc/{pid}/cmdline', 'rb') as f:
                cmdline = f.read()
        except OSError:
            continue
        if b'multiprocessing.spawn' in cmdline and b'resource_tracker' not in cmdline:
            found.append(pid)
    return found


@pytest.mark.timeout(240)
def test_two_front_ends_serve_what_one_serves_and_stop_on_sigterm(workers_server, client):
    """`client`: the one-process server of the same model and flags (tests/serve/conftest.py)."""
    srv = workers_server
    assert len(front_ends(srv)) == 2
    prompts = [f'def g{i}(' for i in range(8)]
    alone = [client.chat.completions.create(model=MODEL, messages=chat(p), max_tokens=6,
                                            **GREEDY).choices[0].message.content for p in prompts]
    before = scrape(srv.url)
    results = asyncio.run(stream_texts(srv.url, prompts * 3, 6))        # 24 at once, both workers
    assert results == [(text, 'length') for text in alone * 3]
    workers = openai.OpenAI(base_url=srv.url + '/v1', api_key=KEY, timeout=60, max_retries=0)
    whole = [workers.chat.completions.create(model=MODEL, messages=chat(p), max_tokens=6,
                                             **GREEDY).choices[0].message.content
             for p in prompts[:3]]
    assert whole == alone[:3]
    bad = httpx.post(srv.url + '/v1/completions', headers=headers(), timeout=30,
                     json={'model': MODEL, 'prompt': [10 ** 9], 'max_tokens': 2})
    assert bad.status_code == 400 and 'outside' in bad.json()['error']['message']
    after = scrape(srv.url)                        # whichever worker answers: every worker's sum
    assert after[LENGTH] - before[LENGTH] == 27
    assert after['lmdeploy_lite_num_requests_in_flight'] == 0
    assert after['lmdeploy_lite_kv_blocks_used'] == 0
    assert after['lmdeploy_lite_kv_blocks_total'] > 0                 # from the engine's process

    lines, reader = stream_in_background(srv, '/v1/chat/completions', {
        'messages': chat('go on'), 'max_tokens': 2000, 'temperature': 0, 'ignore_eos': True})
    children = srv.children()
    srv.proc.send_signal(signal.SIGTERM)
    srv.proc.wait(60)
    reader.join(30)
    assert srv.proc.returncode == 0, srv.output()
    assert lines[-1] == '[DONE]'
    assert json.loads(lines[-2])['choices'][0]['finish_reason'] == 'abort'
    assert not left_alive(children), srv.output()


@pytest.mark.timeout(120)
def test_a_front_end_that_dies_stops_the_server(workers_kill_server):
    srv = workers_kill_server
    workers = front_ends(srv)
    assert len(workers) == 2
    children = srv.children()
    os.kill(workers[0], signal.SIGKILL)
    srv.proc.wait(60)
    assert srv.proc.returncode == 1, srv.output()
    assert 'front-end process' in srv.output()
    assert not left_alive(children), srv.output()


@pytest.mark.skipif(not hasattr(socket, 'SO_REUSEPORT'), reason='no SO_REUSEPORT here')
def test_each_front_end_listens_on_its_own_socket_and_gets_a_share():
    """The parent's socket (bound with reuse_port, never listening) gives each worker a socket of
    its own on the same port; the kernel spreads connections over them (a shared socket lets one
    worker's loop accept a whole burst)."""
    from lmdeploy_lite.serve.openai.connections import bind_socket
    from lmdeploy_lite.serve.openai.workers import own_socket
    parent = bind_socket('127.0.0.1', 0, reuse_port=True)
    port = parent.getsockname()[1]
    owns = [own_socket(socket.fromfd(parent.fileno(), parent.family, parent.type))
            for _ in range(2)]
    try:
        assert [s.getsockname()[1] for s in owns] == [port, port]
        for s in owns:
            s.listen(128)
            s.setblocking(False)
        clients = [socket.create_connection(('127.0.0.1', port), timeout=5) for _ in range(64)]
        accepted = [0, 0]
        for i, s in enumerate(owns):
            while True:
                try:
                    s.accept()[0].close()
                except BlockingIOError:
                    break
                accepted[i] += 1
        for c in clients:
            c.close()
        assert sum(accepted) == 64 and min(accepted) > 0, accepted
        shared = bind_socket('127.0.0.1', 0)
        assert own_socket(shared) is shared            # no reuse_port: the one socket, shared
        shared.close()
    finally:
        for s in owns + [parent]:
            s.close()


def test_the_concurrency_limit_is_split_among_workers_and_its_429_says_so():
    from lmdeploy_lite.serve.openai.admission import ConcurrencyLimitMiddleware
    from lmdeploy_lite.serve.openai.checks import ServerLimits
    from lmdeploy_lite.serve.openai.workers import worker_limits
    share = worker_limits(ServerLimits(max_concurrent=10), capacity=256, workers=4)
    assert (share.max_concurrent, share.workers) == (3, 4)
    sized = worker_limits(ServerLimits(), capacity=256, workers=8)    # 4 batches of 256 / 8
    assert (sized.max_concurrent, sized.workers) == (128, 8)
    assert ConcurrencyLimitMiddleware(None, 3, workers=4).flag == \
        'its share of --max-concurrent-requests over 4 front-end processes'
    assert ConcurrencyLimitMiddleware(None, 8).flag == '--max-concurrent-requests 8'
