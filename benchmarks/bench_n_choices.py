"""n choices of one prompt (issue 22, part 2): one request with GenerationConfig(n) against n
separate requests of the same prompt submitted together (each with its own seed: what a client
without `n` sends), through the engine directly.

Per mode: prefill tokens (Engine.num_prefill_tokens), time until every choice has its first token
(TTFT of the last), wall time to the end, and whether the choices equal the separate requests'
(seeded sampling: choice i of n is the request alone with seed + i). The prefix cache stays on in
both modes (the default): requests submitted together all miss it, since none has prefilled yet.

    python benchmarks/bench_n_choices.py --prompt-len 1024 --n 8            # CPU, embedded model
    python benchmarks/bench_n_choices.py --preset 9b --device cuda --dtype bfloat16
"""
from __future__ import annotations

import argparse
import random
import time

from common import (add_model_args, environment, output_path, print_table, resolve_model,
                    save_json, synchronize)

from lmdeploy_lite import GenerationConfig, PytorchEngineConfig
from lmdeploy_lite.pytorch.engine.build import build_engine
from lmdeploy_lite.pytorch.engine.engine import Engine


def run(engine: Engine, prompt: list[int], gen: GenerationConfig, grouped: bool) -> dict:
    """One round: (n choices of one request) or (n requests), timed until every first token."""
    n = gen.n
    before = engine.num_prefill_tokens
    start = time.perf_counter()
    if grouped:
        seqs = engine.add_group(prompt, gen)
    else:
        seqs = [engine.add_request(prompt, GenerationConfig(**{
            **gen.__dict__, 'n': 1, 'random_seed': gen.random_seed + i})) for i in range(n)]
    first = None
    while engine.has_work:
        engine.step()
        if first is None and all(s.num_generated for s in seqs):
            synchronize(engine.device)
            first = time.perf_counter() - start
    wall = time.perf_counter() - start
    return {'prefill_tokens': engine.num_prefill_tokens - before, 'ttft_all_ms': 1000 * first,
            'wall_ms': 1000 * wall, 'outputs': [s.generated_ids for s in seqs]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    add_model_args(parser)
    parser.add_argument('--prompt-len', type=int, default=1024)
    parser.add_argument('--n', type=int, default=8)
    parser.add_argument('--max-new-tokens', type=int, default=16)
    parser.add_argument('--repeats', type=int, default=3, help='rounds per mode (fresh prompts)')
    parser.add_argument('--out', default=None)
    args = parser.parse_args()
    model, load_format = resolve_model(args)
    engine = build_engine(model, PytorchEngineConfig(dtype=args.dtype, device=args.device,
                                               load_format=load_format,
                                               session_len=args.prompt_len + 64,
                                               max_prefill_token_num=8192,
                                               async_scheduling=args.async_scheduling),
                    progress=False)
    vocab = engine.model_config.vocab_size
    rng = random.Random(0)
    gen = GenerationConfig(max_new_tokens=args.max_new_tokens, do_sample=True, temperature=0.9,
                           ignore_eos=True, random_seed=1234, n=args.n)
    run(engine, [rng.randrange(vocab) for _ in range(64)], gen, True)            # warm-up
    rows = {True: [], False: []}
    for _ in range(args.repeats):
        for grouped in (False, True):            # a fresh prompt each time: no cache hit
            prompt = [rng.randrange(vocab) for _ in range(args.prompt_len)]
            rows[grouped].append(run(engine, prompt, gen, grouped))
    table = []
    for grouped, results in rows.items():
        table.append({'mode': f'n={args.n} one request' if grouped else f'{args.n} requests',
                      'prefill_tokens': results[0]['prefill_tokens'],
                      'ttft_all_ms': sorted(r['ttft_all_ms'] for r in results)[len(results) // 2],
                      'wall_ms': sorted(r['wall_ms'] for r in results)[len(results) // 2]})
    print_table(table, ['mode', 'prefill_tokens', 'ttft_all_ms', 'wall_ms'])
    check = build_engine(model, engine.engine_config, progress=False)     # same outputs, alone
    prompt = [rng.randrange(vocab) for _ in range(args.prompt_len)]
    grouped = run(check, prompt, gen, True)['outputs']
    separate = run(check, prompt, gen, False)['outputs']
    print(f'choices equal the separate seeded requests: {grouped == separate}')
    save_json(output_path(args.out, 'bench_n_choices.json'),
              {'args': vars(args), 'env': environment(), 'rows': table,
               'choices_equal_separate': grouped == separate})


if __name__ == '__main__':
    main()
