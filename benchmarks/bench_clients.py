"""How many streamed chunks and requests one bench_serve.py client process completes a second,
per HTTP library: a stub server (its own process, no engine) writes one completion chunk of the
server's shape to every open stream each `--step-ms`, as an engine step would; bench_serve's
`collect` reads them with httpx and with aiohttp. A client that keeps up reads concurrency /
step chunks a second; one that cannot is what a one-client server benchmark would measure
instead of the server. Short outputs (`--output-len 8`) time the per-request cost.

    python benchmarks/bench_clients.py [--concurrency 64] [--step-ms 2] [--output-len 256]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import socket
import subprocess
import sys
import time

from bench_serve import collect, default_client
from common import print_table

HEAD = '{"id":"cmpl-0123456789abcdef","object":"text_completion","created":1764400000,' \
       '"model":"m","choices":['


def chunked(data: bytes) -> bytes:
    """`data` as one frame of an HTTP/1.1 chunked body."""
    return b'%x\r\n%s\r\n' % (len(data), data)


def frame(text: str, finish: str | None = None, usage: dict | None = None) -> bytes:
    choice = (f'{{"index":0,"text":{json.dumps(text)},"logprobs":null,"finish_reason":'
              f'{json.dumps(finish)},"hidden_states_path":null}}') if text else ''
    return chunked(f'data: {HEAD}{choice}],"usage":{json.dumps(usage)}}}\n\n'.encode())


STREAM_HEAD = (b'HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n'
               b'transfer-encoding: chunked\r\n\r\n')


async def read_request(reader: asyncio.StreamReader) -> dict | None:
    """The next HTTP/1.1 request's JSON body on a connection; None once the client closed it."""
    try:
        head = await reader.readuntil(b'\r\n\r\n')
    except asyncio.IncompleteReadError:
        return None
    length = next(int(line.split(b':')[1]) for line in head.split(b'\r\n')
                  if line.lower().startswith(b'content-length:'))
    return json.loads(await reader.readexactly(length))


async def stub_server(port: int, step_s: float):
    streams = []                            # [writer, tokens left, done future]

    async def handle(reader, writer):
        while (body := await read_request(reader)) is not None:
            n = body['max_tokens']
            writer.write(STREAM_HEAD)
            done = asyncio.get_running_loop().create_future()
            streams.append([writer, n, done])
            await done
            usage = {'prompt_tokens': 1, 'completion_tokens': n, 'total_tokens': n + 1}
            writer.write(frame('', usage=usage) + chunked(b'data: [DONE]\n\n') + b'0\r\n\r\n')
            await writer.drain()

    async def steps():
        token, last = frame(' word'), frame(' end', 'length')
        while True:
            await asyncio.sleep(step_s)
            for stream in list(streams):
                stream[1] -= 1
                stream[0].write(token if stream[1] else last)
                if not stream[1]:
                    streams.remove(stream)
                    stream[2].set_result(None)
    server = await asyncio.start_server(handle, '127.0.0.1', port)
    asyncio.get_running_loop().create_task(steps())
    async with server:
        await server.serve_forever()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--concurrency', type=int, default=64)
    parser.add_argument('--num-requests', type=int, default=256)
    parser.add_argument('--output-len', type=int, default=256)
    parser.add_argument('--step-ms', type=float, default=2.0)
    parser.add_argument('--clients', default='httpx,aiohttp' if default_client() == 'aiohttp'
                        else 'httpx')
    parser.add_argument('--serve', type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        try:
            import uvloop
            uvloop.install()
        except ImportError:
            pass
        return asyncio.run(stub_server(args.serve, args.step_ms / 1000))
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, __file__, '--serve', str(port),
                             '--step-ms', str(args.step_ms)])
    try:
        time.sleep(1.5)
        rows = []
        for client in args.clients.split(','):
            results, start, end = asyncio.run(collect(
                f'http://127.0.0.1:{port}', ['p'] * args.num_requests, args.output_len,
                args.concurrency, math.inf, None, 0, False, client))
            chunks = sum(len(r['itl']) + 1 for r in results)
            rows.append({'client': client, 'chunks': chunks,
                         'requests_per_s': args.num_requests / (end - start),
                         'chunks_per_s': chunks / (end - start),
                         'offered_per_s': args.concurrency / (args.step_ms / 1000)})
    finally:
        proc.terminate()
        proc.wait(10)
    print_table(rows, ['client', 'chunks', 'requests_per_s', 'chunks_per_s', 'offered_per_s'])


if __name__ == '__main__':
    main()
