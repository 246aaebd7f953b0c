"""Online serving benchmark in the spirit of `vllm bench serve`: streaming /v1/completions requests
at a given concurrency and request rate; TTFT, TPOT, ITL (mean, median, p99), request and token
throughput, and the mean accepted length of speculative decoding.

    # against a running server
    python benchmarks/bench_serve.py --base-url http://127.0.0.1:23333 --concurrency 1,8,32
    # or launch one (the embedded model when --model is omitted), run, stop it
    python benchmarks/bench_serve.py --launch [--model DIR] \
        --server-args "--speculative-num-draft-tokens 3"
    # a preset shape on random weights, with a word-level tokenizer over the preset's vocabulary
    python benchmarks/bench_serve.py --launch --preset qwen3_5_0_8b --input-words 128 \
        --server-args "--device cuda --dtype bfloat16"

TTFT: request sent -> first streamed text. ITL: gaps between streamed chunks (a chunk holds every
token of one engine step, so up to k+1 with speculation). TPOT: (latency - TTFT) / (tokens - 1) per
request. Mean accepted length: 1 + accepted / drafts over all requests (the server's `usage`).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shlex
import socket
import statistics
import subprocess
import sys
import time
from collections import Counter

import httpx
from common import ROOT, environment, print_table, save_json

WORDS = ('the model reads every token once and writes the next one while the cache keeps what it '
         'has seen so far def return class import for while if else with yield lambda').split()


def make_prompts(n: int, num_words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [' '.join(rng.choice(WORDS) for _ in range(num_words)) for _ in range(n)]


class Timing:
    """One streamed request's TTFT, ITL and usage, fed each SSE `data:` payload as it arrives."""

    def __init__(self):
        self.start = self.last = time.perf_counter()
        self.ttft, self.itl, self.usage = None, [], None

    def feed(self, data: bytes | str):
        if data in ('[DONE]', b'[DONE]'):
            return
        chunk = json.loads(data)
        if 'error' in chunk:
            raise RuntimeError(chunk['error']['message'])
        now = time.perf_counter()
        if chunk['choices'] and (chunk['choices'][0]['text'] or
                                 chunk['choices'][0]['finish_reason']):
            if self.ttft is None:
                self.ttft = now - self.start
            else:
                self.itl.append(now - self.last)
            self.last = now
        self.usage = chunk.get('usage') or self.usage

    def result(self) -> dict:
        return {'ttft': self.ttft, 'latency': self.last - self.start, 'itl': self.itl,
                'usage': self.usage, 'start': self.start}


async def one_request(http, payload: dict) -> dict:
    """One streamed /v1/completions request over `http`: an httpx.AsyncClient (as the openai SDK
    uses) or an aiohttp.ClientSession (as vLLM's, SGLang's and lmdeploy's serving benchmarks do:
    httpx's pool rescans every connection for each waiting request, so one process of it
    completes fewer requests a second the more run at once, 388 at 8 and 112 at 64 against
    aiohttp's 1,883 at 64; `bench_clients.py`, BENCHMARKS.md)."""
    timing = Timing()
    if isinstance(http, httpx.AsyncClient):
        async with http.stream('POST', '/v1/completions', json=payload) as r:
            if r.status_code != 200:
                raise RuntimeError(f'HTTP {r.status_code}: {(await r.aread()).decode()}')
            async for line in r.aiter_lines():
                if line.startswith('data: '):
                    timing.feed(line[6:])
        return timing.result()
    async with http.post('/v1/completions', json=payload) as r:
        if r.status != 200:
            raise RuntimeError(f'HTTP {r.status}: {await r.text()}')
        async for line in r.content:
            if line.startswith(b'data: '):
                timing.feed(line[6:].rstrip())
    return timing.result()


def http_client(kind: str, base_url: str, headers: dict, concurrency: int):
    if kind == 'httpx':
        return httpx.AsyncClient(base_url=base_url, headers=headers, timeout=600,
                                 limits=httpx.Limits(max_connections=concurrency + 4))
    import aiohttp
    return aiohttp.ClientSession(base_url=base_url, headers=headers,
                                 timeout=aiohttp.ClientTimeout(total=600),
                                 connector=aiohttp.TCPConnector(limit=concurrency + 4))


async def collect(base_url: str, prompts: list[str], output_len: int, concurrency: int,
                  request_rate: float, api_key: str | None, seed: int, warm_up: bool,
                  client: str = 'httpx') -> tuple[list[dict], float, float]:
    """Per-request results of one client, with its wall-clock start and end (time.time())."""
    rng = random.Random(seed)
    limit = asyncio.Semaphore(concurrency)
    headers = {'Authorization': f'Bearer {api_key}'} if api_key else {}
    payloads = [{'prompt': p, 'max_tokens': output_len, 'temperature': 0, 'ignore_eos': True,
                 'stream': True, 'stream_options': {'include_usage': True}} for p in prompts]
    async with http_client(client, base_url, headers, concurrency) as http:
        if warm_up:
            await one_request(http, dict(payloads[0], max_tokens=4))

        async def limited(payload):
            async with limit:
                return await one_request(http, payload)
        start = time.time()
        tasks = []
        for payload in payloads:
            tasks.append(asyncio.create_task(limited(payload)))
            if math.isfinite(request_rate):                              # Poisson arrivals
                await asyncio.sleep(rng.expovariate(request_rate))
        results = await asyncio.gather(*tasks)
    return results, start, time.time()


def default_client() -> str:
    try:
        import aiohttp  # noqa: F401
        return 'aiohttp'
    except ImportError:
        return 'httpx'


def _client(args: tuple) -> tuple[list[dict], float, float]:
    return asyncio.run(collect(*args))


def run(base_url: str, prompts: list[str], output_len: int, concurrency: int,
        request_rate: float, api_key: str | None, seed: int, client_procs: int = 1,
        client: str = 'httpx') -> dict:
    """One row: `client_procs` client processes share the prompts, the concurrency and the
    request rate (one httpx process reads ~12k streamed chunks/s at 64 streams, one aiohttp
    process 25-42k: a fast server would otherwise be measured by its client)."""
    # warm-up at this concurrency: the engine meets the batch sizes of the run (its first steps
    # at a new size may capture a CUDA graph) before anything is timed
    warm = prompts[:concurrency]
    asyncio.run(collect(base_url, warm, 8, len(warm), math.inf, api_key, seed, True, client))
    n = max(1, min(client_procs, concurrency, len(prompts)))
    jobs = [(base_url, prompts[i::n], output_len, concurrency // n + (i < concurrency % n),
             request_rate / n, api_key, seed + i, False, client) for i in range(n)]
    if n == 1:
        parts = [_client(jobs[0])]
    else:
        from concurrent.futures import ProcessPoolExecutor
        with ProcessPoolExecutor(n) as pool:
            parts = list(pool.map(_client, jobs))
    results = [r for part in parts for r in part[0]]
    duration = max(p[2] for p in parts) - min(p[1] for p in parts)
    return summarize(results, duration, concurrency, request_rate)


def _stats(values: list[float], name: str) -> dict:
    values = sorted(v * 1000 for v in values) or [float('nan')]
    p99 = values[min(len(values) - 1, math.ceil(0.99 * len(values)) - 1)]
    return {f'{name}_mean_ms': statistics.fmean(values),
            f'{name}_median_ms': statistics.median(values), f'{name}_p99_ms': p99}


def summarize(results: list[dict], duration: float, concurrency: int, rate: float) -> dict:
    prompt_tokens = sum(r['usage']['prompt_tokens'] for r in results)
    output_tokens = sum(r['usage']['completion_tokens'] for r in results)
    specs = [r['usage'].get('spec_decode') for r in results if r['usage'].get('spec_decode')]
    drafts = sum(s['num_drafts'] for s in specs)
    tpot = [(r['latency'] - r['ttft']) / (r['usage']['completion_tokens'] - 1)
            for r in results if r['usage']['completion_tokens'] > 1]
    return {'concurrency': concurrency, 'request_rate': 'inf' if math.isinf(rate) else rate,
            'requests': len(results), 'duration_s': duration,
            'chunks': sum(len(r['itl']) + 1 for r in results),
            'request_throughput': len(results) / duration,
            'output_throughput': output_tokens / duration,
            'total_token_throughput': (prompt_tokens + output_tokens) / duration,
            'mean_prompt_tokens': prompt_tokens / len(results),
            'mean_output_tokens': output_tokens / len(results),
            **_stats([r['ttft'] for r in results], 'ttft'), **_stats(tpot, 'tpot'),
            **_stats([x for r in results for x in r['itl']], 'itl'),
            'mean_accepted_length': (1 + sum(s['num_accepted_tokens'] for s in specs) / drafts
                                     if drafts else None),
            'slow_gaps': slow_gaps(results)}


def slow_gaps(results: list[dict], factor: float = 3.0) -> dict:
    """The ITL gaps over `factor` x the median: how many, where in their stream (the first 8
    gaps, the last 8, between), and how many events they make (gaps ending within 1 ms of each
    other, over every client process: a step or stall that the running streams felt at once)."""
    gaps = [x for r in results for x in r['itl']]
    if not gaps:
        return {}
    limit = factor * statistics.median(gaps)
    where, ends = Counter(), []
    for r in results:
        now, n = r['start'] + r['ttft'], len(r['itl'])
        for i, gap in enumerate(r['itl']):
            now += gap
            if gap > limit:
                where['first 8' if i < 8 else 'last 8' if i >= n - 8 else 'between'] += 1
                ends.append(now)
    ends.sort()
    events = sum(1 for a, b in zip([-math.inf] + ends, ends) if b - a > 1e-3)
    return {'limit_ms': limit * 1000, 'count': len(ends), 'fraction': len(ends) / len(gaps),
            'events': events, 'where': dict(where)}


def pipeline_reference(model: str | None, server_args: str, prompts: list[str], output_len: int,
                       concurrency: int, engine_process: bool = False,
                       synthetic: str | None = None) -> dict:
    """What `pipeline()` delivers on the same workload: the same prompts, output length and
    engine flags, at most `concurrency` sequences at once (max_batch_size), all submitted at
    once; output tokens over the whole call (prefills included, as the server's figure)."""
    from lmdeploy_lite import GenerationConfig, pipeline
    from lmdeploy_lite.cli.args import build_engine_config
    from lmdeploy_lite.cli.main import build_parser
    args = build_parser().parse_args(['serve', 'api_server', *([model] if model else []),
                                      *shlex.split(server_args)])
    args.max_batch_size = concurrency
    gen = GenerationConfig(max_new_tokens=output_len, ignore_eos=True)
    rates = [float(r) for r in synthetic.split(',')] if synthetic else None
    from bench_pipeline import synthetic_acceptance_on_ranks
    from bench_spec import synthetic_rejection_sampler
    from lmdeploy_lite.cli.args import speculative_config
    with synthetic_acceptance_on_ranks(rates):
        pipe = pipeline(args.model, build_engine_config(args), speculative_config(args),
                        progress=False, engine_process=engine_process)
    if rates and pipe.engine is not None:
        pipe.engine.agent.rejection_sampler = synthetic_rejection_sampler(rates)
    with pipe:
        pipe(prompts[:concurrency], GenerationConfig(max_new_tokens=8, ignore_eos=True))  # warm-up
        start = time.perf_counter()
        outputs = pipe(prompts, gen)
        seconds = time.perf_counter() - start
    tokens = sum(o.generate_token_len for o in outputs)
    stats = [o.spec_stats for o in outputs if o.spec_stats is not None]
    drafts = sum(s.num_drafts for s in stats)
    return {'concurrency': concurrency, 'engine_process': engine_process,
            'output_throughput': tokens / seconds, 'duration_s': seconds,
            'mean_accepted_length': (1 + sum(s.num_accepted_tokens for s in stats) / drafts
                                     if drafts else None)}


def _reference_main(argv: list[str]):
    """`--reference-worker MODEL ARGS OUTPUT_LEN CONCURRENCY ENGINE_PROCESS PROMPTS_FILE RATES`: one
    pipeline_reference row as JSON on the last line (its own process: the GPU is free after)."""
    model, server_args, output_len, concurrency, engine_process, prompts, synthetic = argv
    with open(prompts) as f:
        prompts = json.load(f)
    row = pipeline_reference(model or None, server_args, prompts, int(output_len),
                             int(concurrency), engine_process == '1', synthetic or None)
    print(json.dumps(row))


def preset_model_dir(name: str) -> str:
    """A preset's model directory (config.json, for `--load-format dummy`) with a word-level
    tokenizer of the preset's vocabulary (token i is the word `t<i>`), so that a random-weight
    model of a real shape serves text: every id decodes, and detokenizing costs what a real
    vocabulary's does per token. Made once per preset config in the temp directory (~6 MB; it was
    a new one each run) and reused."""
    import hashlib
    import shutil
    import tempfile

    from presets import preset_config, write_preset
    from tokenizers import Tokenizer, models, pre_tokenizers
    config = preset_config(name)
    digest = hashlib.sha1(json.dumps(config, sort_keys=True).encode()).hexdigest()[:10]
    path = os.path.join(tempfile.gettempdir(), f'bench_serve_{name}_{digest}')
    if os.path.isfile(os.path.join(path, 'tokenizer_config.json')):
        return path
    work = write_preset(name, tempfile.mkdtemp(prefix=f'bench_serve_{name}_'))
    vocab_size = config['vocab_size']
    tokenizer = Tokenizer(models.WordLevel({f't{i}': i for i in range(vocab_size)}, unk_token='t0'))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(os.path.join(work, 'tokenizer.json'))
    with open(os.path.join(work, 'tokenizer_config.json'), 'w') as f:
        json.dump({'tokenizer_class': 'PreTrainedTokenizerFast', 'unk_token': 't0',
                   'clean_up_tokenization_spaces': False}, f)
    try:
        os.rename(work, path)                 # whole, or not at all (another run made it first)
    except OSError:
        shutil.rmtree(work, ignore_errors=True)
    return path


def launch(model: str | None, server_args: str, server_root: str = ROOT,
           synthetic: str | None = None) -> tuple[subprocess.Popen, str]:
    """A server of the package found at `server_root` (another checkout: before/after runs);
    `synthetic`: draft acceptance rates (serve_synthetic.py; this checkout's server only)."""
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        port = s.getsockname()[1]
    runner = (['-m', 'lmdeploy_lite.cli.main'] if synthetic is None else
              [os.path.join(ROOT, 'benchmarks', 'serve_synthetic.py'), synthetic])
    cmd = [sys.executable, *runner, 'serve', 'api_server',
           *([model] if model else []), '--server-port', str(port), *shlex.split(server_args)]
    path = os.pathsep.join([os.path.abspath(server_root)]
                           + [p for p in os.environ.get('PYTHONPATH', '').split(os.pathsep) if p])
    proc = subprocess.Popen(cmd, cwd=server_root, env={**os.environ, 'PYTHONPATH': path})
    url = f'http://127.0.0.1:{port}'
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f'server exited with {proc.returncode}: {shlex.join(cmd)}')
        try:
            if httpx.get(url + '/health', timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError('server did not become healthy within 300 s')


COLUMNS = ['concurrency', 'client_procs', 'client', 'request_rate', 'requests',
           'request_throughput', 'output_throughput',
           'total_token_throughput', 'ttft_mean_ms', 'ttft_median_ms', 'ttft_p99_ms',
           'tpot_mean_ms', 'tpot_median_ms', 'tpot_p99_ms', 'itl_mean_ms', 'itl_median_ms',
           'itl_p99_ms', 'mean_accepted_length']


def frontend_cpu(num_chunks: int = 20000) -> list[dict]:
    """The server's CPU time per streamed chunk, no engine: writing the chunk (responses.py),
    its SSE framing and the metrics' per-response work (RequestTracker.observe), best of 3."""
    from types import SimpleNamespace

    from lmdeploy_lite.messages import Response
    from lmdeploy_lite.serve.openai.metrics import ServerMetrics
    from lmdeploy_lite.serve.openai.responses import ChatChunks, CompletionChunks, event
    metrics = ServerMetrics(SimpleNamespace())
    responses = [Response(text=' word "q"\n', token_ids=[i], input_token_len=128,
                          generate_token_len=i + 1) for i in range(num_chunks)]
    rows = []
    for name, chunks in (('completion', CompletionChunks('cmpl-1', 'model', [None])),
                         ('chat', ChatChunks('chatcmpl-1', 'model', [None], None))):
        best = math.inf
        for _ in range(3):
            tracker = metrics.track(128)
            start = time.perf_counter()
            for r in responses:
                tracker.observe(r)
                event(chunks.delta(0, r.text, r.finish_reason, None, r.hidden_states_path))
            best = min(best, (time.perf_counter() - start) / num_chunks)
            tracker.finish('length')
        rows.append({'endpoint': name, 'us_per_chunk': round(best * 1e6, 2)})
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--frontend-cpu', action='store_true',
                        help="only time the server's CPU work per streamed chunk (no server)")
    parser.add_argument('--base-url', default=None, help='a running server (else --launch)')
    parser.add_argument('--launch', action='store_true', help='start a server for the run')
    parser.add_argument('--model', default=None, help='with --launch: model directory')
    parser.add_argument('--server-args', default='', help='with --launch: extra server flags')
    parser.add_argument('--preset', default=None,
                        help='with --launch: a benchmarks/presets.py shape on random weights '
                             '(--load-format dummy) with a word-level tokenizer')
    parser.add_argument('--api-key', default=None)
    parser.add_argument('--num-prompts', type=int, default=64)
    parser.add_argument('--input-words', type=int, default=32, help='words per random prompt')
    parser.add_argument('--output-len', type=int, default=64,
                        help='tokens per request (ignore_eos)')
    parser.add_argument('--concurrency', default='1,8', help='comma list of max in-flight requests')
    parser.add_argument('--request-rate', default='inf', help='comma list of requests/s (Poisson)')
    parser.add_argument('--seed', type=int, default=0)
    parser.add_argument('--client-procs', default='1',
                        help='comma list: client processes sharing the requests (a fast server '
                             'outruns one)')
    parser.add_argument('--client', default=default_client(),
                        help='comma list of HTTP client libraries, aiohttp and/or httpx (default '
                             'aiohttp where installed, as the serving benchmarks of vLLM, SGLang '
                             'and lmdeploy use)')
    parser.add_argument('--server-root', default=ROOT,
                        help='with --launch: the checkout whose server runs (before/after runs)')
    parser.add_argument('--synthetic-acceptance', default=None, metavar='RATES',
                        help='with --launch and MTP: draft position i accepted at rate i '
                             '(e.g. 0.8,0.6,0.5; random weights accept nothing)')
    parser.add_argument('--pipeline-reference', action='store_true',
                        help='with --launch: after the server, pipeline() on the same workload '
                             'at each concurrency (output tokens/s over the whole call)')
    parser.add_argument('--out', default=os.path.join(ROOT, 'out', 'bench_serve.json'))
    if sys.argv[1:2] == ['--reference-worker']:
        return _reference_main(sys.argv[2:])
    args = parser.parse_args()
    if args.frontend_cpu:
        print_table(frontend_cpu(), ['endpoint', 'us_per_chunk'])
        return
    if not set(args.client.split(',')) <= {'aiohttp', 'httpx'}:
        parser.error(f'--client {args.client}: each must be aiohttp or httpx')
    if (args.base_url is None) == (not args.launch):
        parser.error('give exactly one of --base-url and --launch')
    if args.preset:
        if not args.launch or args.model:
            parser.error('--preset goes with --launch and without --model')
        args.model = preset_model_dir(args.preset)
        args.server_args += ' --load-format dummy'
    proc, url = (launch(args.model, args.server_args, args.server_root,
                        args.synthetic_acceptance) if args.launch else (None, args.base_url))
    try:
        prompts = make_prompts(args.num_prompts, args.input_words, args.seed)
        rows = [dict(run(url, prompts, args.output_len, int(c), float(rate), args.api_key,
                         args.seed, int(procs), client), client_procs=int(procs), client=client)
                for c in args.concurrency.split(',') for rate in args.request_rate.split(',')
                for procs in args.client_procs.split(',') for client in args.client.split(',')]
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    print_table(rows, COLUMNS)
    references = []
    if args.pipeline_reference and args.launch:
        import tempfile
        with tempfile.NamedTemporaryFile('w', suffix='.json', delete=False) as f:
            json.dump(prompts, f)
        for c in dict.fromkeys(int(c) for c in args.concurrency.split(',')):
            out = subprocess.run(
                [sys.executable, __file__, '--reference-worker', args.model or '', args.server_args,
                 str(args.output_len), str(c), '0', f.name, args.synthetic_acceptance or ''],
                cwd=args.server_root,
                capture_output=True, text=True, check=True).stdout
            references.append(json.loads(out.strip().splitlines()[-1]))
            best = max(r['output_throughput'] for r in rows if r['concurrency'] == c)
            references[-1]['server_best_of_pipeline'] = best / references[-1]['output_throughput']
        print_table(references, ['concurrency', 'output_throughput', 'duration_s',
                                 'mean_accepted_length', 'server_best_of_pipeline'])
    save_json(args.out, {'environment': environment(), 'server': url,
                         'server_args': args.server_args, 'model': args.model,
                         'output_len': args.output_len, 'results': rows,
                         'pipeline_reference': references})


if __name__ == '__main__':
    main()
