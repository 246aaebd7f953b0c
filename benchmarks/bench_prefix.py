"""Prefix caching on vs off through `pipeline()` (issue 21): multi-turn chats over a shared
system prompt, and a pair of requests sharing a long prefix.

    python benchmarks/bench_prefix.py      # CPU, embedded model, 16 x 4 over 2k: ~4 min, 2 cores
    python benchmarks/bench_prefix.py --preset 9b --device cuda --dtype bfloat16
    python benchmarks/bench_prefix.py --pair [--prefix-tokens 1500] [--repeats 5]   # ~1 min

Chat workload: `--conversations` chats of `--turns` turns over one `--system-tokens` system prompt
(on the CPU the cache-off run takes ~3 of the 4 minutes; `--conversations 8` halves it). Turn t of
a chat is the system prompt, the chat's earlier user messages and the model's answers to them, and
a new user message of 30..60 tokens; all token ids, random from `--seed` (the same in every mode;
the answers are each mode's own). Turns go in rounds: the chats' turn t are submitted together
(chat c after c x `--stagger-ms`), and round t + 1 starts once every answer of round t is in.
Greedy, ignore_eos, `--max-new-tokens` per answer. Each mode of `--modes` (default off,on) is one
pipeline with `enable_prefix_caching` False or True and every other setting equal, warmed up first
by 2 chats x 2 turns over another system prompt of the same length. Per mode: TTFT (submit to first
streamed token) p50 / p99 over all requests; `wall_s` of the whole workload; `hit_rate` =
sum(Response.num_cached_tokens) / sum(prompt tokens); `decode_tok_s`: tokens streamed in each round
once every request of the round has its first token (no prefill left: the decode speed that the
cache should leave unchanged) over those windows; `stream_tok_s`: one stream's speed from its first
token to its last, sum(tokens after the first) / sum(those times) over the requests (prefill chunks
of other requests ride in its steps, so the cache raises it); `speedup`: TTFT p50 of the first mode
/ this one; `identical`: every request's output is the same as in the first mode (float32 on the
CPU: it must be; bf16 on random weights flips near-tied argmaxes with the batch's make-up, so check
`--modes off,off` before reading a False there).

--pair (the CPU goal: >= 5x): request A (`--prefix-tokens` + 20 tokens) runs to its end, then B
(the same prefix + 20 other tokens); B's TTFT with the cache off and on, `--repeats` times with a
fresh prefix each time; min and median, and their ratio off / on.

A `--preset` (benchmarks/presets.py; `9b` stands for `qwen3_5_9b`) runs real shapes on dummy
weights (no tokenizer needed: prompts are token ids). The JSON (every figure, each request with
its streamed chunks, and the command line) goes to --out, by default
benchmarks/results/issue21/<name>.json ($OUT/<name>.json where $OUT is set, as on the GPU
machine). The table is printed last.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import statistics
import sys
import time

import torch
from common import (ROOT, add_model_args, environment, print_table, release_memory,
                    resolve_model, save_json)
from presets import PRESETS

from lmdeploy_lite import GenerationConfig, PytorchEngineConfig, SpeculativeConfig, pipeline
from lmdeploy_lite.pytorch.config import ModelConfig

USER_TOKENS = (30, 60)          # a user message's length range (inclusive)
PAIR_SUFFIX_TOKENS = 20
WARM_UP_SEED = 2**31            # the warm-up's tokens: no prefix of the measured prompts
FIRST_ID = 3                    # random ids start here: clear of pad/eos ids of small vocabularies


# ---- workload ----------------------------------------------------------------------------------
def random_ids(generator: torch.Generator, n: int, vocab: int) -> list[int]:
    return torch.randint(FIRST_ID, vocab, (n,), generator=generator).tolist()


def chat_workload(seed: int, conversations: int, turns: int, system_tokens: int, vocab: int
                  ) -> tuple[list[int], list[list[list[int]]]]:
    """(system prompt ids, user[c][t]: chat c's message of turn t), all from `seed`."""
    generator = torch.Generator().manual_seed(seed)
    system = random_ids(generator, system_tokens, vocab)
    users = [[random_ids(generator, int(torch.randint(USER_TOKENS[0], USER_TOKENS[1] + 1, (1,),
                                                      generator=generator)), vocab)
              for _ in range(turns)] for _ in range(conversations)]
    return system, users


# ---- one request -------------------------------------------------------------------------------
async def timed_request(pipe, prompt: list[int], gen: GenerationConfig, delay_s: float = 0.0
                        ) -> dict:
    """Stream one request after `delay_s`: its prompt length, cached tokens, TTFT (ms), the
    perf_counter times of its submission, first and last token, each chunk's (time, tokens)
    and its output ids."""
    await asyncio.sleep(delay_s)
    submit = time.perf_counter()
    first = last = None
    token_ids: list[int] = []
    chunks: list[tuple[float, int]] = []        # (arrival, tokens) of each streamed chunk
    num_cached = 0
    async for resp in pipe.generate(prompt, gen, stream_text=False):
        now = time.perf_counter()
        if resp.error is not None:
            raise RuntimeError(f'request failed: {resp.error}')
        if resp.token_ids and first is None:
            first = now
        token_ids += resp.token_ids
        chunks.append((now, len(resp.token_ids)))
        last = now
        num_cached = resp.num_cached_tokens
    return {'prompt_tokens': len(prompt), 'num_cached_tokens': num_cached,
            'ttft_ms': 1000 * (first - submit), 'submit': submit, 'first': first, 'last': last,
            'chunks': chunks, 'token_ids': token_ids}


def make_pipeline(args, model_dir: str, load_format: str, prefix_caching: bool,
                  session_len: int):
    cfg = PytorchEngineConfig(
        dtype=args.dtype, device=args.device, tp=args.tp, max_batch_size=args.max_batch_size,
        session_len=args.session_len or session_len, load_format=load_format, seed=args.seed,
        cache_max_entry_count=args.cache_max_entry_count, async_scheduling=args.async_scheduling,
        enable_prefix_caching=prefix_caching)
    spec = (SpeculativeConfig(num_speculative_tokens=args.num_spec_tokens)
            if args.num_spec_tokens else None)
    return pipeline(model_dir, backend_config=cfg, speculative_config=spec, progress=False)


# ---- the chat workload ---------------------------------------------------------------------------
async def run_chats(pipe, system: list[int], users, gen: GenerationConfig, stagger_ms: float
                    ) -> tuple[list[dict], float]:
    """(one record per request in (turn, chat) order, wall seconds of the whole workload)."""
    history = [list(system) for _ in users]
    records = []
    start = time.perf_counter()
    for turn in range(len(users[0])):
        prompts = [history[c] + users[c][turn] for c in range(len(users))]
        done = await asyncio.gather(*(
            timed_request(pipe, p, gen, c * stagger_ms / 1000) for c, p in enumerate(prompts)))
        for c, record in enumerate(done):
            history[c] = prompts[c] + record['token_ids']
            records.append(dict(record, conversation=c, turn=turn))
    return records, time.perf_counter() - start


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between the nearest ranks (numpy's default)."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summarize(records: list[dict], wall_s: float) -> dict:
    ttft = [r['ttft_ms'] for r in records]
    decoded = sum(len(r['token_ids']) - 1 for r in records)
    pure_tokens, pure_s = 0, 0.0                  # per round: once every prompt is prefilled
    for turn in {r['turn'] for r in records}:
        round_ = [r for r in records if r['turn'] == turn]
        all_first = max(r['first'] for r in round_)
        pure_tokens += sum(n for r in round_ for t, n in r['chunks'] if t > all_first)
        pure_s += max(r['last'] for r in round_) - all_first
    return {'requests': len(records), 'ttft_p50_ms': percentile(ttft, 50),
            'ttft_p99_ms': percentile(ttft, 99), 'ttft_mean_ms': statistics.fmean(ttft),
            'wall_s': wall_s,
            'hit_rate': (sum(r['num_cached_tokens'] for r in records)
                         / sum(r['prompt_tokens'] for r in records)),
            'stream_tok_s': decoded / sum(r['last'] - r['first'] for r in records),
            'decode_tok_s': pure_tokens / pure_s if pure_s else None,
            'ttft_p50_ms_by_turn': [percentile([r['ttft_ms'] for r in records if r['turn'] == t],
                                               50) for t in sorted({r['turn'] for r in records})]}


def parse_modes(text: str) -> list[tuple[str, bool]]:
    """'off,on' -> [('off', False), ('on', True)]; a repeated mode is numbered ('off2')."""
    modes = []
    for name in text.split(','):
        if name not in ('off', 'on'):
            raise ValueError(f'--modes {text}: each mode is off or on')
        count = sum(m.rstrip('0123456789') == name for m, _ in modes)
        modes.append((f'{name}{count + 1}' if count else name, name == 'on'))
    return modes


def run_modes(args, model_dir: str, load_format: str, session_len: int, run
              ) -> list[tuple[dict, list[dict]]]:
    """(row, records) per --modes entry: `run(pipe, warm_up=False)` on a fresh pipeline of
    each, after `run(pipe, warm_up=True)` (a small copy of the workload on other tokens: the
    first long prefill, the first hit and the first mixed steps pay for kernel compiles and
    allocations on a GPU)."""
    results = []
    for mode, prefix_caching in parse_modes(args.modes):
        pipe = make_pipeline(args, model_dir, load_format, prefix_caching, session_len)
        try:
            run(pipe, warm_up=True)
            row, records = run(pipe, warm_up=False)
        finally:
            pipe.close()
        del pipe
        release_memory()
        results.append((dict(mode=mode, **row), records))
        print(f'{mode}: done', flush=True)
    return results


def outputs(record: dict) -> list:
    return record['token_ids'] if 'token_ids' in record else [record['a']['token_ids'],
                                                               record['b']['token_ids']]


def compare(results: list[tuple[dict, list[dict]]], ratios: dict[str, str]) -> dict:
    """Each row against the first: `identical` outputs (and which requests differ) and, for
    each `ratios` entry (row key -> timing key), first row's timing / this row's."""
    reference_row, reference = results[0]
    for row, records in results:
        row['mismatched'] = [(y['conversation'], y['turn']) if 'turn' in y else i
                             for i, (x, y) in enumerate(zip(reference, records))
                             if outputs(x) != outputs(y)]
        row['identical'] = not row['mismatched']
        if row is not reference_row:
            for name, key in ratios.items():
                row[name] = reference_row[key] / row[key]
    return {'rows': [row for row, _ in results],
            'requests': {row['mode']: records for row, records in results}}


def chats_mode(args, model_dir: str, load_format: str, vocab: int) -> dict:
    longest = args.system_tokens + args.turns * (USER_TOKENS[1] + args.max_new_tokens)
    session_len = longest + (args.max_new_tokens + 2) * (args.num_spec_tokens + 1) + 16
    gen = GenerationConfig(max_new_tokens=args.max_new_tokens, ignore_eos=True)

    def run(pipe, warm_up: bool):
        if warm_up:                                  # 2 chats x 2 turns over another prompt
            workload = chat_workload(WARM_UP_SEED, 2, min(args.turns, 2), args.system_tokens,
                                     vocab)
        else:
            workload = chat_workload(args.seed, args.conversations, args.turns,
                                     args.system_tokens, vocab)
        records, wall_s = asyncio.run(run_chats(pipe, *workload, gen, args.stagger_ms))
        t0 = min(r['submit'] for r in records)      # times from the mode's first submission
        for record in records:
            for key in ('submit', 'first', 'last'):
                record[key] -= t0
            record['chunks'] = [(t - t0, n) for t, n in record['chunks']]
        return summarize(records, wall_s), records
    results = run_modes(args, model_dir, load_format, session_len, run)
    return compare(results, {'speedup': 'ttft_p50_ms'})


# ---- --pair ------------------------------------------------------------------------------------
async def run_pair(pipe, prefix: list[int], suffix_a: list[int], suffix_b: list[int],
                   gen: GenerationConfig) -> tuple[dict, dict]:
    a = await timed_request(pipe, prefix + suffix_a, gen)
    b = await timed_request(pipe, prefix + suffix_b, gen)
    return a, b


def pair_mode(args, model_dir: str, load_format: str, vocab: int) -> dict:
    length = args.prefix_tokens + PAIR_SUFFIX_TOKENS
    session_len = length + (args.max_new_tokens + 2) * (args.num_spec_tokens + 1) + 16
    gen = GenerationConfig(max_new_tokens=args.max_new_tokens, ignore_eos=True)

    def run(pipe, warm_up: bool):
        # the same prompts in each mode; warm-up: one pair of other tokens
        generator = torch.Generator().manual_seed(WARM_UP_SEED if warm_up else args.seed)
        records = []
        for _ in range(1 if warm_up else args.repeats):
            prefix = random_ids(generator, args.prefix_tokens, vocab)
            suffix_a = random_ids(generator, PAIR_SUFFIX_TOKENS, vocab)
            suffix_b = random_ids(generator, PAIR_SUFFIX_TOKENS, vocab)
            a, b = asyncio.run(run_pair(pipe, prefix, suffix_a, suffix_b, gen))
            records.append({'a': a, 'b': b})
        ttft_b = [r['b']['ttft_ms'] for r in records]
        return {'b_ttft_min_ms': min(ttft_b), 'b_ttft_median_ms': statistics.median(ttft_b),
                'a_ttft_median_ms': statistics.median(r['a']['ttft_ms'] for r in records),
                'b_cached_tokens': statistics.median(r['b']['num_cached_tokens']
                                                     for r in records)}, records
    results = run_modes(args, model_dir, load_format, session_len, run)
    return compare(results, {'speedup_min': 'b_ttft_min_ms',
                             'speedup_median': 'b_ttft_median_ms'})


# ---- main --------------------------------------------------------------------------------------
def expand_preset(argv: list[str]) -> list[str]:
    """`--preset 9b` -> `--preset qwen3_5_9b` (a preset's name without the `qwen3_5_` prefix)."""
    short = {name.removeprefix('qwen3_5_'): name for name in PRESETS}
    out = list(argv)
    for i, arg in enumerate(out):
        if arg == '--preset' and i + 1 < len(out):
            out[i + 1] = short.get(out[i + 1], out[i + 1])
        elif arg.startswith('--preset='):
            out[i] = '--preset=' + short.get(arg.split('=', 1)[1], arg.split('=', 1)[1])
    return out


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser)                          # --seed: also the workload's seed
    parser.add_argument('--threads', type=int, default=2, help='torch.set_num_threads')
    parser.add_argument('--tp', type=int, default=1)
    parser.add_argument('--max-batch-size', type=int, default=16)
    parser.add_argument('--num-spec-tokens', type=int, default=0, help='MTP draft tokens (0: AR)')
    parser.add_argument('--session-len', type=int, default=None,
                        help='default: the longest prompt plus the answer and speculative slack')
    parser.add_argument('--cache-max-entry-count', type=float, default=0.8)
    parser.add_argument('--max-new-tokens', type=int, default=32)
    parser.add_argument('--conversations', type=int, default=16)
    parser.add_argument('--turns', type=int, default=4)
    parser.add_argument('--system-tokens', type=int, default=2000)
    parser.add_argument('--stagger-ms', type=float, default=0.0,
                        help="delay between the chats' submissions within a round")
    parser.add_argument('--pair', action='store_true',
                        help='the two-request mode instead of the chat workload')
    parser.add_argument('--prefix-tokens', type=int, default=1500, help='--pair: shared prefix')
    parser.add_argument('--repeats', type=int, default=5, help='--pair: A/B pairs per mode')
    parser.add_argument('--modes', default='off,on',
                        help='prefix caching per run, compared with the first: e.g. off,off '
                             'shows how far two runs of one setting differ')
    parser.add_argument('--out', default=None)
    args = parser.parse_args(expand_preset(sys.argv[1:]))
    try:
        parse_modes(args.modes)
    except ValueError as e:
        parser.error(str(e))
    return args


def output_file(args) -> str:
    name = (f'bench_prefix_{"pair_" if args.pair else ""}{args.preset or "model"}_{args.device}'
            f'{f"_mtp{args.num_spec_tokens}" if args.num_spec_tokens else ""}.json')
    if args.out:
        return args.out
    if os.environ.get('OUT'):
        return os.path.join(os.environ['OUT'], name)
    return os.path.join(ROOT, 'benchmarks', 'results', 'issue21', name)


def main():
    args = parse_args()
    torch.set_num_threads(args.threads)
    model_dir, load_format = resolve_model(args)
    vocab = ModelConfig.from_pretrained(model_dir).vocab_size
    start = time.perf_counter()
    result = (pair_mode if args.pair else chats_mode)(args, model_dir, load_format, vocab)
    total_s = time.perf_counter() - start
    name = args.preset or args.model or 'embedded'
    save_json(output_file(args), {
        'command': shlex.join(['python'] + sys.argv), 'env': environment(), 'args': vars(args),
        'model': name, 'load_format': load_format, 'total_s': total_s, **result})
    spec = f'MTP k={args.num_spec_tokens}' if args.num_spec_tokens else 'AR'
    if args.pair:
        print(f'model: {name} ({load_format} weights), {args.dtype} on {environment()["device"]}, '
              f'{args.threads} threads, {spec}; A then B over a {args.prefix_tokens}-token '
              f'prefix (+{PAIR_SUFFIX_TOKENS} each), {args.repeats} repeats; '
              f'{total_s:.0f} s in all')
        print_table(result['rows'], ['mode', 'b_ttft_min_ms', 'b_ttft_median_ms',
                                     'a_ttft_median_ms', 'b_cached_tokens', 'speedup_min',
                                     'speedup_median', 'identical'])
    else:
        print(f'model: {name} ({load_format} weights), {args.dtype} on {environment()["device"]}, '
              f'{args.threads} threads, {spec}; {args.conversations} chats x {args.turns} turns '
              f'over {args.system_tokens} system tokens, {args.max_new_tokens} new tokens; '
              f'{total_s:.0f} s in all')
        print_table(result['rows'], ['mode', 'ttft_p50_ms', 'ttft_p99_ms', 'wall_s', 'hit_rate',
                                     'decode_tok_s', 'stream_tok_s', 'speedup', 'identical'])


if __name__ == '__main__':
    main()
