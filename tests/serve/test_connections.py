"""What one connection may hold of the server: slowloris headers, a stalled body, idle
connections, a flood past the connection limit. The real uvicorn server with the server's own
protocol and app, in a thread of this process, over a stand-in pipeline (the engine plays no part
in HTTP); every probe runs beside normal requests that must keep succeeding."""
import socket
import threading
import time

import httpx
import pytest

pytest.importorskip('uvicorn')

HEADER_S, BODY_S, IDLE_S = 1.0, 1.0, 1.5


@pytest.fixture
def serve():
    """serve(max_connections) -> base URL of a running server; stopped at the end."""
    import uvicorn

    from lmdeploy_lite.serve.openai.api_server import create_app, server_config
    from lmdeploy_lite.serve.openai.connections import HttpLimits
    from tests.serve.live_server import free_port
    from tests.serve.test_api_server_robustness import FakePipe
    servers = []

    def start(max_connections: int = 1000, parser: str = 'auto') -> tuple[str, int]:
        port = free_port()
        limits = HttpLimits(HEADER_S, BODY_S, IDLE_S, max_connections)
        app = create_app(FakePipe(), 'fake', bound_host='127.0.0.1')
        config = server_config(app, '127.0.0.1', port, 'error', 1.0, limits)
        config.http = limits.protocol(parser)
        server = uvicorn.Server(config)
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        servers.append((server, thread))
        deadline = time.monotonic() + 20
        while not server.started:
            assert time.monotonic() < deadline, 'the server did not start within 20 s'
            time.sleep(0.02)
        return f'http://127.0.0.1:{port}', port
    yield start
    for server, thread in servers:
        server.should_exit = True
        thread.join(10)
        assert not thread.is_alive(), 'the server did not stop within 10 s'


def connect(port: int) -> socket.socket:
    s = socket.create_connection(('127.0.0.1', port), timeout=10)
    return s


def closed_within(s: socket.socket, seconds: float) -> bytes | None:
    """What the server sent before closing `s`, or None if it is still open after `seconds`."""
    s.settimeout(0.05)
    got, deadline = b'', time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            chunk = s.recv(4096)
        except socket.timeout:
            continue
        except ConnectionResetError:
            return got
        if not chunk:
            return got
        got += chunk
    return None


def healthy(url: str) -> bool:
    return httpx.get(url + '/health', timeout=5).status_code == 200


@pytest.mark.timeout(60)
@pytest.mark.parametrize('parser', ['h11', 'httptools'])
def test_slowloris_headers_a_stalled_body_and_idle_connections_are_closed(serve, parser):
    """Headers sent a byte every 0.1 s get 408 and are closed at the header deadline (not
    extended by the bytes); a body that stops half-way is closed at the body deadline; 200 idle
    connections are closed after the idle timeout; normal requests succeed throughout. Over
    either HTTP parser the server may run on."""
    if parser == 'httptools':
        pytest.importorskip('httptools')
    url, port = serve(parser=parser)
    idle = [connect(port) for _ in range(200)]
    # a kept-alive connection between requests is idle too: its second request (at the end,
    # after the idle timeout) must reconnect
    kept_alive = httpx.Client(base_url=url, timeout=5)
    assert kept_alive.get('/health').status_code == 200
    kept_since = time.monotonic()
    slow, stalled = connect(port), connect(port)
    stalled.sendall(b'POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n'
                    b'Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"prompt"')
    start = time.monotonic()
    request = b'GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Padding: ' + b'a' * 200
    sent, answer = 0, None
    while answer is None and time.monotonic() - start < HEADER_S + 3:
        slow.sendall(request[sent:sent + 1])
        sent += 1
        answer = closed_within(slow, 0.1)
        if sent % 5 == 0:
            assert healthy(url), 'a normal request failed beside the slow one'
    took = time.monotonic() - start
    assert answer is not None, f'slowloris headers still open after {took:.1f} s'
    assert answer.startswith(b'HTTP/1.1 408') and b'request_timeout' in answer, answer
    assert HEADER_S - 0.2 < took < HEADER_S + 1.0, f'closed after {took:.2f} s'
    assert sent < len(request), 'the deadline must cut the headers short'
    assert closed_within(stalled, BODY_S + 1.0) is not None, 'a stalled body is still open'
    assert healthy(url)
    # the request whose body never came counts as a client that left, not as an invalid one
    metrics = httpx.get(url + '/metrics', timeout=5).text
    assert 'lmdeploy_lite_requests_total{outcome="abort"} 1.0' in metrics, metrics
    assert 'lmdeploy_lite_requests_total{outcome="invalid"} 0.0' in metrics
    for s in idle:
        assert closed_within(s, IDLE_S + 2.0 - (time.monotonic() - start)) is not None, \
            'an idle connection outlived the idle timeout'
    assert healthy(url)
    time.sleep(max(0.0, kept_since + IDLE_S + 0.5 - time.monotonic()))
    assert kept_alive.get('/health').status_code == 200       # httpx reconnects: it saw the close
    kept_alive.close()
    for s in [*idle, slow, stalled]:
        s.close()


@pytest.mark.timeout(60)
def test_past_the_connection_limit_a_new_connection_is_closed_until_idle_ones_expire(serve):
    url, port = serve(max_connections=20)
    held = [connect(port) for _ in range(20)]
    time.sleep(0.2)
    extra = connect(port)
    assert closed_within(extra, 1.0) == b'', 'the 21st connection was not closed at once'
    time.sleep(IDLE_S + 0.5)                  # the held ones expire as idle
    assert healthy(url)
    for s in [*held, extra]:
        s.close()
