"""Prefill and decode tokens/s of the engine (plain AR) at a few batch sizes.

    python benchmarks/bench_decode.py [--model DIR] [--batch-sizes 1,16] [--out out/bench_decode.json]
"""
from __future__ import annotations

import argparse
import time

from common import default_model, environment, print_table, save_json

from lmdeploy_lite.messages import GenerationConfig, PytorchEngineConfig
from lmdeploy_lite.pytorch.engine.engine import Engine


def measure(engine: Engine, batch_size: int, prompt_len: int, decode_steps: int) -> dict:
    vocab = engine.model_config.vocab_size
    prompts = [[(7 * b + 3 * i) % (vocab - 2) + 2 for i in range(prompt_len)]
               for b in range(batch_size)]
    cfg = GenerationConfig(max_new_tokens=decode_steps + 1, ignore_eos=True)
    seqs = [engine.add_request(p, cfg) for p in prompts]
    start = time.perf_counter()
    while not all(s.prefilled for s in seqs):
        engine.step()
    prefill_s = time.perf_counter() - start
    start = time.perf_counter()
    steps = 0
    while engine.has_work:
        engine.step()
        steps += 1
    decode_s = time.perf_counter() - start
    decoded = sum(s.num_generated - 1 for s in seqs)
    return {'batch': batch_size, 'prompt_len': prompt_len,
            'prefill_tok_s': batch_size * prompt_len / prefill_s,
            'decode_tok_s': decoded / decode_s, 'decode_step_ms': 1000 * decode_s / steps}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--model', default=None)
    parser.add_argument('--batch-sizes', default='1,16')
    parser.add_argument('--prompt-len', type=int, default=128)
    parser.add_argument('--decode-steps', type=int, default=64)
    parser.add_argument('--dtype', default='float32')
    parser.add_argument('--device', default='cpu')
    parser.add_argument('--out', default='out/bench_decode.json')
    args = parser.parse_args()
    model = args.model or default_model()
    engine = Engine(model, PytorchEngineConfig(dtype=args.dtype, device=args.device,
                                               max_batch_size=64, session_len=1024,
                                               max_prefill_token_num=8192), progress=False)
    measure(engine, 2, 16, 4)                                       # warm-up
    rows = [measure(engine, int(b), args.prompt_len, args.decode_steps)
            for b in args.batch_sizes.split(',')]
    print(f'model: {model}')
    print_table(rows, ['batch', 'prompt_len', 'prefill_tok_s', 'decode_tok_s', 'decode_step_ms'])
    save_json(args.out, {'env': environment(), 'model': model, 'rows': rows})


if __name__ == '__main__':
    main()
