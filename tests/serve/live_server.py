"""The real server as a subprocess on 127.0.0.1 (`lmdeploy_lite serve api_server`), and helpers to
talk to it. CPU; float32 unless told otherwise."""
import asyncio
import os
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KEY = 'test-key'
K = 2                                   # draft tokens per step (the tiny model's server)
SPEC_K = 3                              # the same, the embedded model's server
SESSION_LEN = 128
MODEL = 'tiny'


def free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model_dir: str | None, log_path: str, *args: str, deadline_s: float = 180,
                 env: dict | None = None, key: str | None = None, wait: bool = True):
        """model_dir None: the embedded model. `args` come last (a repeated option wins).
        `wait` False: return once the process is started; wait_healthy() then waits for it."""
        self.port = free_port()
        self.url = f'http://127.0.0.1:{self.port}'
        self.model_dir = model_dir
        self.key = key                       # for the health wait: /health needs none
        self.log = open(log_path, 'w+')
        cmd = [sys.executable, '-m', 'lmdeploy_lite.cli.main', 'serve', 'api_server',
               *([model_dir] if model_dir else []),
               '--device', 'cpu', '--dtype', 'float32', '--session-len', str(SESSION_LEN),
               '--max-batch-size', '64', '--server-port', str(self.port), *args]
        env = dict(os.environ, OMP_NUM_THREADS='1', **(env or {}))
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=env)
        self.deadline_s, self.deadline = deadline_s, time.monotonic() + deadline_s
        if wait:
            self.wait_healthy()

    def wait_healthy(self):
        """Returns once /health answers 200; fails (and stops the server) at the deadline or if
        the server exits."""
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self):
        while time.monotonic() < self.deadline:
            if self.proc.poll() is not None:
                pytest.fail(f'server exited with {self.proc.returncode}:\n{self.output()}')
            try:
                if httpx.get(self.url + '/health', timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)     # a refused connect costs ~1 ms: poll often, start sooner
        pytest.fail(f'server not healthy within {self.deadline_s} s:\n{self.output()}')

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def children(self) -> list[int]:
        """Every process below the server: its children (the fork server that starts ranks,
        multiprocessing's resource tracker) and theirs (the ranks)."""
        pids, todo = [], [self.proc.pid]
        while todo:
            pid = todo.pop()
            for task in _listdir(f'/proc/{pid}/task'):
                try:
                    with open(f'/proc/{pid}/task/{task}/children') as f:
                        found = [int(p) for p in f.read().split()]
                except OSError:
                    continue
                pids += found
                todo += found
        return pids

    def rank_workers(self) -> list[int]:
        """The processes that run engine ranks: those the fork server forked."""
        servers = [pid for pid in self.children() if b'forkserver' in _cmdline(pid)
                   and _parent(pid) == self.proc.pid]
        return [pid for pid in self.children() if _parent(pid) in servers]

    def stop(self):
        """Terminates the server (killed if it takes over 30 s); once stopped, does nothing."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _parent(pid: int) -> int | None:
    try:
        with open(f'/proc/{pid}/stat') as f:
            return int(f.read().rsplit(')', 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _cmdline(pid: int) -> bytes:
    try:
        with open(f'/proc/{pid}/cmdline', 'rb') as f:
            return f.read()
    except FileNotFoundError:
        return b''


def listening(pids: list[int]) -> list[tuple[str, int]]:
    """The TCP addresses (hex address as /proc/net/tcp* writes it, port) the processes listen
    on."""
    inodes = set()
    for pid in pids:
        fd_dir = f'/proc/{pid}/fd'
        for fd in os.listdir(fd_dir):
            try:
                target = os.readlink(os.path.join(fd_dir, fd))
            except OSError:
                continue
            if target.startswith('socket:['):
                inodes.add(target[8:-1])
    found = []
    for table in ('/proc/net/tcp', '/proc/net/tcp6'):
        for line in open(table).read().splitlines()[1:]:
            fields = line.split()
            address, port = fields[1].split(':')
            if fields[3] == '0A' and fields[9] in inodes:          # LISTEN
                found.append((address, int(port, 16)))
    return found


def is_loopback_hex(address: str) -> bool:
    """127.0.0.0/8, ::1 or ::ffff:127.x.x.x, as /proc/net/tcp* writes them."""
    if len(address) == 8:
        return address.endswith('7F')
    return (address == '00000000000000000000000001000000'
            or (address.startswith('0000000000000000FFFF0000') and address.endswith('7F')))


def left_alive(pids: list[int], within_s: float = 5.0) -> list[int]:
    """Those of `pids` still running after `within_s` seconds (asked every 0.1 s)."""
    deadline = time.monotonic() + within_s
    while True:
        alive = [pid for pid in pids if is_alive(pid)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def is_alive(pid: int) -> bool:
    try:
        with open(f'/proc/{pid}/stat') as f:
            return f.read().rsplit(')', 1)[1].split()[0] != 'Z'
    except FileNotFoundError:
        return False


def headers(key: str | None = KEY) -> dict:
    return {'Authorization': f'Bearer {key}'} if key else {}


def scrape(url: str, key: str | None = KEY) -> dict[str, float]:
    """/metrics as {'name{labels}': value}."""
    text = httpx.get(url + '/metrics', headers=headers(key), timeout=10).text
    return {line.rsplit(' ', 1)[0]: float(line.rsplit(' ', 1)[1])
            for line in text.splitlines() if line and not line.startswith('#')}


def post(server, path: str, payload=None, content: str | bytes | None = None,
         key: str | None = KEY, timeout: float = 60) -> httpx.Response:
    r = httpx.post(server.url + path, json=payload, content=content,
                   headers={**headers(key), 'Content-Type': 'application/json'}, timeout=timeout)
    # no answer, error or not, tells a client where the server keeps its model
    model_dir = getattr(server, 'model_dir', None)
    assert not model_dir or os.path.dirname(os.path.normpath(model_dir)) not in r.text, r.text
    return r


def stream_in_background(server, path: str, payload: dict, key: str | None = KEY
                         ) -> tuple[list[str], threading.Thread]:
    """A streamed POST read by a thread: (the events' data as they come, the thread), returned
    once three events have arrived (the stream is running); fails if none come in 60 s."""
    lines, first = [], threading.Event()

    def read_stream():
        with httpx.stream('POST', server.url + path, timeout=60, headers=headers(key),
                          json={**payload, 'stream': True}) as resp:
            for line in resp.iter_lines():
                if line.startswith('data: '):
                    lines.append(line[6:])
                    if len(lines) == 3:
                        first.set()
    reader = threading.Thread(target=read_stream, daemon=True)
    reader.start()
    assert first.wait(60), 'no streamed tokens'
    return lines, reader


def chat(text: str) -> list[dict]:
    return [{'role': 'user', 'content': text}]


async def stream_texts(url: str, prompts: list[str], max_tokens: int) -> list[tuple[str, str]]:
    """Every prompt streamed at once as a greedy chat completion (ignore_eos) through one openai
    AsyncOpenAI client with a connection each: (text, finish_reason) per prompt, in order."""
    import openai

    async def one(client, prompt):
        stream = await client.chat.completions.create(
            model=MODEL, messages=chat(prompt), max_tokens=max_tokens, stream=True,
            temperature=0, extra_body={'ignore_eos': True})
        text, finish = '', None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ''
                finish = chunk.choices[0].finish_reason or finish
        return text, finish
    client = openai.AsyncOpenAI(base_url=url + '/v1', api_key=KEY, timeout=120, max_retries=0,
                                http_client=openai.DefaultAsyncHttpxClient(
                                    limits=httpx.Limits(max_connections=len(prompts))))
    async with client:
        return await asyncio.wait_for(asyncio.gather(*(one(client, p) for p in prompts)), 180)


def sse_events(lines) -> list[str]:
    """The data of each server-sent event."""
    return [line[6:] for line in lines if line.startswith('data: ')]
