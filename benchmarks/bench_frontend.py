"""The server's front-end alone, at engine speeds no CPU engine reaches: a synthetic engine (a
thread that emits `--tokens-per-step` tokens for every running request each `--step-ms`, through
the real `RankClient` delivery) behind the real Pipeline, app and uvicorn, with bench_serve.py's
clients. What it shows: the server's output tokens/s against the synthetic engine's own rate at
that batch (what `pipeline()` would deliver), TTFT, the inter-chunk gap, the server process's CPU
time per streamed chunk and per request, and how many tokens a chunk carried.

    python benchmarks/bench_frontend.py --concurrency 64 --step-ms 3 --client-procs 4
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import random
import socket
import statistics
import subprocess
import sys
import threading
import time

import httpx
from bench_serve import default_client, make_prompts, preset_model_dir, run
from common import ROOT, environment, print_table, save_json


def synthetic_client(model_path: str, step_s: float, tokens_per_step: int, max_batch: int,
                     vocab_size: int):
    """A RankClient whose one 'rank' is a thread: every `step_s` it admits what waits (up to
    `max_batch` running) and emits `tokens_per_step` random tokens for each running request
    (the first step: one token, as after a prefill)."""
    from lmdeploy_lite.messages import PytorchEngineConfig
    from lmdeploy_lite.pytorch.config import ModelConfig
    from lmdeploy_lite.pytorch.engine.executor.client import RankClient
    from lmdeploy_lite.pytorch.engine.step_output import StepOutput

    def output(ids: list[int], num_generated: int, finished: bool) -> StepOutput:
        out = StepOutput.__new__(StepOutput)
        out.__setstate__({**dict.fromkeys(StepOutput.__slots__), 'new_token_ids': ids,
                          'finished': finished, 'finish_reason': 'length' if finished else None,
                          'num_generated': num_generated, 'num_cached_tokens': 0,
                          'num_preemptions': 0})
        return out

    class SyntheticEngine(RankClient):
        steps = 0

        def _configure(self, model_path, cfg, spec_config):
            self.model_config = ModelConfig.from_pretrained(model_path)
            self.session_len = 1 << 20

        def _start(self, model_path, cfg, spec_config, env):
            self._inboxes = [queue.Queue()]
            threading.Thread(target=self._run, daemon=True).start()

        def _wait_ready(self):
            self._prefix_naming = (64, 0, False)

        def _run(self):
            rng, waiting, running = random.Random(0), [], {}     # rid -> [generated, limit]
            next_step = time.perf_counter()
            while True:
                while True:
                    try:
                        kind, payload = self._inboxes[0].get_nowait()
                    except queue.Empty:
                        break
                    if kind == 'add':
                        rids, _, gen_config, _ = payload
                        waiting += [(rid, gen_config.max_new_tokens) for rid in rids]
                    elif kind == 'abort':
                        running.pop(payload, None)
                    elif kind == 'stop':
                        return
                while waiting and len(running) < max_batch:
                    rid, limit = waiting.pop(0)
                    running[rid] = [0, limit]
                reports = []
                for rid, state in list(running.items()):
                    n = min(1 if state[0] == 0 else tokens_per_step, state[1] - state[0])
                    state[0] += n
                    finished = state[0] >= state[1]
                    reports.append((rid, output([rng.randrange(vocab_size) for _ in range(n)],
                                                state[0], finished)))
                    if finished:
                        del running[rid]
                if reports:
                    self.steps += 1
                    self._on_report('out', 0, (reports, None))
                next_step += step_s
                time.sleep(max(0.0, next_step - time.perf_counter()))
                next_step = max(next_step, time.perf_counter() - step_s)

        def _dead_ranks(self):
            return {}

        def _join(self, timeout_s):
            pass

        def _kill(self):
            pass

    return SyntheticEngine(model_path, PytorchEngineConfig(max_batch_size=max_batch))


def serve_main(args):
    """The server process: the real Pipeline front-end over the synthetic engine."""
    import lmdeploy_lite.api as api
    from lmdeploy_lite.serve.openai.api_server import serve
    from presets import preset_config
    vocab = preset_config(args.preset)['vocab_size']
    api.connect = lambda path, *a, **k: synthetic_client(
        path, args.step_ms / 1000, args.tokens_per_step, args.max_batch, vocab)
    pipe = api.Pipeline(args.model, num_threads=1)
    serve(pipe, 'synthetic', port=args.port)


def in_process(args) -> dict:
    """The app alone (no sockets, no uvicorn): `concurrency` streamed /v1/completions requests
    driven through ASGI in this process, on uvloop and with startup's objects frozen out of the
    collector as `serve` runs them; CPU time per chunk of the whole process (the synthetic engine
    thread included); TTFT and the gaps between a stream's chunks (ITL). Quieter than the socket
    run: no client shares the machine."""
    import asyncio

    import lmdeploy_lite.api as api
    from lmdeploy_lite.serve.openai.api_server import create_app, settle_collector
    from presets import preset_config
    vocab = preset_config(args.preset)['vocab_size']
    api.connect = lambda path, *a, **k: synthetic_client(
        path, args.step_ms / 1000, args.tokens_per_step, args.max_batch, vocab)
    pipe = api.Pipeline(preset_model_dir(args.preset), num_threads=1)
    app = create_app(pipe, 'synthetic')
    settle_collector()                       # as serve() does
    prompts = make_prompts(args.num_prompts, args.input_words, 0)
    chunks, ttfts, gaps = 0, [], []

    async def one(prompt: str):
        nonlocal chunks
        body = json.dumps({'prompt': prompt, 'max_tokens': args.output_len, 'stream': True,
                           'ignore_eos': True}).encode()
        times, start = [], time.perf_counter()
        events = await post_stream(app, '/v1/completions', body, times)
        chunks += events                     # not `chunks += await ...`: it reads chunks first
        ttfts.append(times[0] - start)
        gaps.extend(b - a for a, b in zip(times, times[1:]))

    async def main():
        limit = asyncio.Semaphore(args.concurrency)

        async def limited(prompt):
            async with limit:
                await one(prompt)
        await one(prompts[0])                    # warm-up
        ttfts.clear()
        gaps.clear()
        start_cpu, start = time.process_time(), time.perf_counter()
        await asyncio.gather(*map(limited, prompts))
        return time.process_time() - start_cpu, time.perf_counter() - start
    before = chunks
    try:                                     # uvicorn's loop where installed, as the server's
        import uvloop
        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:
        pass
    cpu, wall = asyncio.run(main())
    pipe.close()
    n = chunks - before
    return {'concurrency': args.concurrency, 'requests': len(prompts), 'chunks': n,
            'wall_s': wall, 'cpu_s': cpu, 'cpu_us_per_chunk': 1e6 * cpu / n,
            'tokens_per_chunk': len(prompts) * args.output_len / n,
            'ttft_median_ms': 1e3 * statistics.median(ttfts), 'ttft_max_ms': 1e3 * max(ttfts),
            'itl_p99_ms': 1e3 * sorted(gaps)[int(0.99 * len(gaps))], 'itl_max_ms': 1e3 * max(gaps)}


async def post_stream(app, path: str, body: bytes, times: list[float]) -> int:
    """POST `body` to `path` of the ASGI `app` in this process; the time each non-empty body
    message came is appended to `times`; returns the server-sent events received."""
    import asyncio
    scope = {'type': 'http', 'asgi': {'version': '3.0'}, 'http_version': '1.1',
             'method': 'POST', 'scheme': 'http', 'path': path, 'raw_path': path.encode(),
             'query_string': b'', 'root_path': '',
             'headers': [(b'host', b'127.0.0.1'), (b'content-type', b'application/json'),
                         (b'content-length', str(len(body)).encode())],
             'client': ('127.0.0.1', 1), 'server': ('127.0.0.1', 2), 'state': {}}
    sent, done, events = [False], asyncio.Event(), [0]

    async def receive():
        if not sent[0]:
            sent[0] = True
            return {'type': 'http.request', 'body': body, 'more_body': False}
        await done.wait()
        return {'type': 'http.disconnect'}

    async def send(message):
        if message['type'] == 'http.response.body' and message.get('body'):
            times.append(time.perf_counter())
            events[0] += message['body'].count(b'data: ')
    await app(scope, receive, send)
    done.set()
    return events[0]


def cpu_seconds(pid: int) -> float:
    with open(f'/proc/{pid}/stat') as f:
        fields = f.read().rsplit(')', 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf('SC_CLK_TCK')


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--preset', default='qwen3_5_0_8b', help="the tokenizer's vocabulary")
    parser.add_argument('--concurrency', default='64', help='comma list')
    parser.add_argument('--num-prompts', type=int, default=None, help='default: 2 x concurrency')
    parser.add_argument('--input-words', type=int, default=128)
    parser.add_argument('--output-len', type=int, default=256)
    parser.add_argument('--step-ms', type=float, default=3.0, help='synthetic engine step')
    parser.add_argument('--tokens-per-step', type=int, default=1, help='k + 1 under MTP')
    parser.add_argument('--max-batch', type=int, default=256)
    parser.add_argument('--client-procs', default='1', help='comma list')
    parser.add_argument('--client', default=default_client(), choices=('aiohttp', 'httpx'),
                        help="bench_serve.py's HTTP client (default aiohttp where installed)")
    parser.add_argument('--out', default=os.path.join(ROOT, 'out', 'bench_frontend.json'))
    parser.add_argument('--in-process', action='store_true',
                        help='drive the app through ASGI in this process (no sockets, no '
                             'uvicorn): its CPU time per chunk')
    parser.add_argument('--serve', action='store_true', help=argparse.SUPPRESS)
    parser.add_argument('--model', help=argparse.SUPPRESS)
    parser.add_argument('--port', type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        return serve_main(args)
    if args.in_process:
        args.concurrency = int(args.concurrency)
        args.num_prompts = args.num_prompts or 2 * args.concurrency
        row = in_process(args)
        print_table([row], list(row))
        return save_json(args.out, {'environment': environment(), 'args': vars(args),
                                    'results': [row]})
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        port = s.getsockname()[1]
    model = preset_model_dir(args.preset)
    cmd = [sys.executable, __file__, '--serve', '--model', model, '--port', str(port),
           *[f'--{k.replace("_", "-")}={v}' for k, v in vars(args).items()
             if k in ('preset', 'step_ms', 'tokens_per_step', 'max_batch')]]
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, 'PYTHONPATH': os.path.join(
        ROOT, 'benchmarks') + os.pathsep + os.environ.get('PYTHONPATH', '')})
    url, rows = f'http://127.0.0.1:{port}', []
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(url + '/health', timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError('the synthetic server did not start')
            time.sleep(0.2)
        for concurrency in map(int, args.concurrency.split(',')):
            prompts = make_prompts(args.num_prompts or 2 * concurrency, args.input_words, 0)
            for procs in map(int, args.client_procs.split(',')):
                cpu = cpu_seconds(proc.pid)
                row = run(url, prompts, args.output_len, concurrency, float('inf'), None, 0,
                          procs, args.client)
                cpu = cpu_seconds(proc.pid) - cpu
                engine_rate = (min(concurrency, args.max_batch) * args.tokens_per_step
                               / (args.step_ms / 1000))
                tokens = row['mean_output_tokens'] * row['requests']
                chunks = row['chunks']
                row.update(client_procs=procs, engine_tokens_per_s=engine_rate,
                           of_engine=row['output_throughput'] / engine_rate,
                           server_cpu_us_per_chunk=1e6 * cpu / chunks,
                           server_cpu_ms_per_request=1e3 * cpu / row['requests'],
                           tokens_per_chunk=tokens / chunks)
                rows.append(row)
    finally:
        proc.terminate()
        proc.wait(30)
    columns = ['concurrency', 'client_procs', 'output_throughput', 'engine_tokens_per_s',
               'of_engine', 'ttft_median_ms', 'itl_p99_ms', 'tokens_per_chunk',
               'server_cpu_us_per_chunk', 'server_cpu_ms_per_request']
    print_table(rows, columns)
    save_json(args.out, {'environment': environment(), 'args': vars(args), 'results': rows})


if __name__ == '__main__':
    main()
