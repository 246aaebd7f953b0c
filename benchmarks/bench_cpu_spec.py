"""AR vs MTP speculative decoding through `pipeline()` on the embedded model, on the CPU (issue 20).

    python benchmarks/bench_cpu_spec.py [--threads 2] [--batch-sizes 1,8] [--ks 1,2,3,4]
        [--prompt-len 64] [--new-tokens 128] [--repeats 3] [--out bench_cpu_spec.json]

Greedy, ignore_eos, float32. Prompts: `--prompt-len` tokens of a fixed Python text (`TEXT`),
each row of a batch starting at a different line; `--prompts random`: random token ids (seeded),
as bench_spec.py uses (the model drafts worse on them: mean accepted length ~2.9 at k=3 against
~3.7 on the text). Each row runs `--repeats` streamed
`pipeline()` calls of `--new-tokens` tokens per request (`SpeculativeConfig(k, dynamic=False)`
for k > 0) and keeps the best; `decode_tok_s` counts the tokens streamed between the moment every
request has its first token (prefill done) and the last token, over that time. `accept_len`:
mean accepted length (tokens per verify step, bonus included) over the row's calls;
`speedup`: decode_tok_s over the AR row of the same batch; `step_ms`: what one engine step
costs through the pipeline, batch x accept_len tokens over decode_tok_s, and `step_cost`: that
over the AR row's (a k step pays off by accept_len / step_cost). The table is printed last.
"""
from __future__ import annotations

import argparse
import statistics

import torch
from bench_pipeline import stream_decode
from common import environment, output_path, print_table, release_memory, save_json

from lmdeploy_lite import GenerationConfig, PytorchEngineConfig, SpeculativeConfig, pipeline
from lmdeploy_lite.messages import SpecDecodeStats

TEXT = '''\
class LRUCache:
    """A mapping that keeps at most `capacity` items, dropping the least recently used."""

    def __init__(self, capacity=128):
        if capacity <= 0:
            raise ValueError('capacity must be positive')
        self.capacity = capacity
        self._data = {}
        self._order = []

    def __len__(self):
        return len(self._data)

    def __contains__(self, key):
        return key in self._data

    def get(self, key, default=None):
        if key not in self._data:
            return default
        self._order.remove(key)
        self._order.append(key)
        return self._data[key]

    def put(self, key, value):
        if key in self._data:
            self._order.remove(key)
        elif len(self._data) >= self.capacity:
            oldest = self._order.pop(0)
            del self._data[oldest]
        self._data[key] = value
        self._order.append(key)


def parse_args(argv=None):
    import argparse
    parser = argparse.ArgumentParser(description='Run the cache benchmark.')
    parser.add_argument('--size', type=int, default=1000)
    parser.add_argument('--capacity', type=int, default=128)
    parser.add_argument('--verbose', action='store_true')
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    cache = LRUCache(args.capacity)
    hits = misses = 0
    for i in range(args.size):
        key = i % (args.capacity * 2)
        if cache.get(key) is None:
            misses += 1
            cache.put(key, i)
        else:
            hits += 1
    if args.verbose:
        print(f'hits={hits} misses={misses}')
    return hits, misses
'''


def make_prompts(tokenizer, batch: int, length: int, kind: str = 'text') -> list[list[int]]:
    """`batch` prompts of `length` tokens of TEXT, row i starting at line 3 * i; or of random
    ids (`kind='random'`)."""
    if kind == 'random':
        generator = torch.Generator().manual_seed(batch)
        return torch.randint(2, len(tokenizer), (batch, length), generator=generator).tolist()
    lines = TEXT.splitlines(True)
    prompts = []
    for i in range(batch):
        ids = tokenizer.encode(''.join(lines[3 * i:] + lines), add_special_tokens=False)
        if len(ids) < length:
            raise ValueError(f'--prompt-len {length}: the text gives only {len(ids)} tokens')
        prompts.append(ids[:length])
    return prompts


def run_k(args, k: int) -> list[dict]:
    spec = SpeculativeConfig(num_speculative_tokens=k, dynamic=False) if k else None
    cfg = PytorchEngineConfig(dtype=args.dtype, device='cpu', max_batch_size=max(args.batch_sizes),
                              session_len=args.prompt_len + (args.new_tokens + 2) * (k + 1) + 16)
    pipe = pipeline(backend_config=cfg, speculative_config=spec, progress=False)
    rows = []
    try:
        gen = GenerationConfig(max_new_tokens=args.new_tokens, ignore_eos=True)
        pipe(make_prompts(pipe.tokenizer, 1, args.prompt_len, args.prompts), gen)  # warm-up
        for batch in args.batch_sizes:
            prompts = make_prompts(pipe.tokenizer, batch, args.prompt_len, args.prompts)
            pipe.engine.spec_stats = SpecDecodeStats()
            rates = []
            for _ in range(args.repeats):
                seconds, tokens, _, _ = stream_decode(pipe, prompts, gen)
                rates.append(tokens / seconds)
            stats = pipe.engine.spec_stats
            rows.append({'batch': batch, 'k': k if k else 'AR', 'decode_tok_s': max(rates),
                         'median_tok_s': statistics.median(rates), 'min_tok_s': min(rates),
                         'accept_len': stats.mean_accepted_length if k else 1.0})
    finally:
        pipe.close()
    del pipe
    release_memory()
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--threads', type=int, default=2, help='torch.set_num_threads')
    parser.add_argument('--batch-sizes', default='1,8')
    parser.add_argument('--ks', default='1,2,3,4', help='MTP draft counts; AR always runs')
    parser.add_argument('--no-ar', action='store_true', help='skip the AR rows')
    parser.add_argument('--prompt-len', type=int, default=64)
    parser.add_argument('--prompts', default='text', choices=('text', 'random'))
    parser.add_argument('--new-tokens', type=int, default=128)
    parser.add_argument('--repeats', type=int, default=3)
    parser.add_argument('--dtype', default='float32')
    parser.add_argument('--out', default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(',') if b]
    ks = ([] if args.no_ar else [0]) + [int(k) for k in args.ks.split(',') if k]
    rows = [row for k in ks for row in run_k(args, k)]
    for row in rows:
        row['step_ms'] = 1000 * row['batch'] * row['accept_len'] / row['decode_tok_s']
    for row in rows:
        ar = next((r for r in rows if r['batch'] == row['batch'] and r['k'] == 'AR'), None)
        row['speedup'] = row['decode_tok_s'] / ar['decode_tok_s'] if ar else None
        row['step_cost'] = row['step_ms'] / ar['step_ms'] if ar else None
    rows.sort(key=lambda r: (r['batch'], -1 if r['k'] == 'AR' else r['k']))
    save_json(output_path(args.out, 'bench_cpu_spec.json'),
              {'env': environment(), 'args': vars(args), 'rows': rows})
    print(f'embedded model, {args.dtype}, {args.threads} threads, greedy, {args.prompts} prompts '
          f'of {args.prompt_len} tokens, {args.new_tokens} new tokens, best of {args.repeats}')
    print_table(rows, ['batch', 'k', 'decode_tok_s', 'median_tok_s', 'min_tok_s', 'accept_len',
                       'step_ms', 'step_cost', 'speedup'])


if __name__ == '__main__':
    main()
