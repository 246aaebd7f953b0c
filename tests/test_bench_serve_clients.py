"""benchmarks/bench_serve.py's two HTTP clients read the same streams the same way: a stub server
streams OpenAI completion chunks (one token each, an empty-text chunk, then usage and [DONE]) in
HTTP/1.1 chunked frames that split lines across reads; httpx and aiohttp must count the same
tokens, chunks and usage, and both must raise an error chunk."""
import asyncio
import json
import math
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                'benchmarks'))
from bench_clients import STREAM_HEAD, chunked, read_request  # noqa: E402
from bench_serve import collect  # noqa: E402

HEAD = '{"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":['


def _event(choices: str, usage: str = 'null') -> bytes:
    return f'data: {HEAD}{choices}],"usage":{usage}}}\n\n'.encode()


def _choice(text: str, finish: str | None = None) -> str:
    return json.dumps({'index': 0, 'text': text, 'logprobs': None, 'finish_reason': finish})


async def _serve(reader, writer):
    while (body := await read_request(reader)) is not None:
        writer.write(STREAM_HEAD)
        n = body['max_tokens']
        if body['prompt'] == 'bad':
            events = [b'data: {"error":{"message":"prompt refused"}}\n\n']
        else:
            events = [_event(_choice(' t', 'length' if i == n - 1 else None)) for i in range(n)]
            events.insert(1, _event(_choice('')))                 # no text: not a token's gap
            usage = {'prompt_tokens': 3, 'completion_tokens': n, 'total_tokens': 3 + n}
            events += [_event('', json.dumps(usage)), b'data: [DONE]\n\n']
        data = b''.join(events)
        for i in range(0, len(data), 37):          # frames that cut events mid-line
            writer.write(chunked(data[i:i + 37]))
            await writer.drain()
            await asyncio.sleep(0)
        writer.write(b'0\r\n\r\n')
        await writer.drain()


def _collect(client: str, prompts: list[str], output_len: int):
    async def main():
        server = await asyncio.start_server(_serve, '127.0.0.1', 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            return await collect(f'http://127.0.0.1:{port}', prompts, output_len, 2, math.inf,
                                 None, 0, False, client)
    return asyncio.run(main())


@pytest.mark.parametrize('client', ['httpx', 'aiohttp'])
def test_clients_count_the_same_stream(client):
    if client == 'aiohttp':
        pytest.importorskip('aiohttp')
    results, start, end = _collect(client, ['a', 'b', 'c'], 5)
    assert end >= start and len(results) == 3
    for r in results:
        assert r['usage'] == {'prompt_tokens': 3, 'completion_tokens': 5, 'total_tokens': 8}
        assert r['ttft'] > 0 and r['latency'] >= r['ttft']
        assert len(r['itl']) == 4                  # 5 token chunks; the empty one is no gap


@pytest.mark.parametrize('client', ['httpx', 'aiohttp'])
def test_clients_raise_an_error_chunk(client):
    if client == 'aiohttp':
        pytest.importorskip('aiohttp')
    with pytest.raises(RuntimeError, match='prompt refused'):
        _collect(client, ['bad'], 3)
