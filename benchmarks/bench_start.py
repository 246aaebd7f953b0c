"""Engine start-up: seconds from `pipeline()` to ready (weights, KV plan, CUDA graphs captured),
then one request's TTFT, for each `--max-prefill-graph-tokens` value in turn, one process each.
Run it twice with an empty `TRITON_CACHE_DIR` first to see what a machine's first start costs
(Triton compiles, fla's autotuning: both cached on disk after).

    python benchmarks/bench_start.py --preset qwen3_5_0_8b --graph-tokens 4096,512,0
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from common import add_model_args, resolve_model


def one(args, graph_tokens: int) -> dict:
    from lmdeploy_lite import GenerationConfig, PytorchEngineConfig, pipeline
    model_dir, load_format = resolve_model(args)
    start = time.perf_counter()
    pipe = pipeline(model_dir, backend_config=PytorchEngineConfig(
        dtype=args.dtype, device=args.device, load_format=load_format,
        max_prefill_graph_tokens=graph_tokens, max_batch_size=args.max_batch_size),
        progress=False)
    ready = time.perf_counter() - start
    start = time.perf_counter()
    pipe([[5] * 2000], GenerationConfig(max_new_tokens=1, ignore_eos=True))
    first = time.perf_counter() - start
    pipe.close()
    return {'graph_tokens': graph_tokens, 'max_batch_size': args.max_batch_size,
            'start_s': ready, 'first_2k_request_s': first}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser, dtype='bfloat16', device='cuda')
    parser.add_argument('--graph-tokens', default='4096,512,0')
    parser.add_argument('--max-batch-size', type=int, default=64,
                        help="the server's --max-batch-size is 256: more prefill graphs")
    parser.add_argument('--one', type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument('--out', default=None)
    args, rest = parser.parse_known_args()
    if args.one is not None:
        print(json.dumps(one(args, args.one)))
        return
    rows = []
    for tokens in map(int, args.graph_tokens.split(',')):
        argv = [a for i, a in enumerate(sys.argv[1:]) if not a.startswith('--out')
                and sys.argv[i] != '--out']
        done = subprocess.run([sys.executable, __file__, *argv, '--one', str(tokens)],
                              capture_output=True, text=True)
        line = (done.stdout.strip().splitlines() or ['{}'])[-1]
        row = json.loads(line) if line.startswith('{') else {'graph_tokens': tokens,
                                                             'error': done.stderr[-300:]}
        rows.append(row)
        print(row, flush=True)
    if args.out:
        with open(args.out, 'w') as f:
            json.dump(rows, f, indent=1)


if __name__ == '__main__':
    main()
