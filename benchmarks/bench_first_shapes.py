"""Steps of shapes a server meets after start-up, and the Triton kernels each one compiled: a
kernel variant first met inside a served step stalls every stream for its compile (measured on
an H200 before the eager warm-up: 1-2.5 s for each prefill-attention variant the MTP head's
eager pass met, 40 s for fla's varlen form). A preset on random weights through `pipeline()`,
CUDA; each row: a batch of `rows` prompts of `length` random tokens, 4 new tokens, timed whole.

    python benchmarks/bench_first_shapes.py --preset qwen3_5_0_8b --spec-tokens 3
"""
from __future__ import annotations

import argparse
import shlex
import time

import torch
import triton.runtime.jit as jit
from bench_serve import preset_model_dir
from bench_spec import synthetic_rejection_sampler
from common import environment, output_path, print_table, save_json

from lmdeploy_lite import GenerationConfig, pipeline
from lmdeploy_lite.cli.args import build_engine_config, speculative_config
from lmdeploy_lite.cli.main import build_parser

# (prompts, tokens each): row counts of 64-token prompts in each prefill-attention split class
# and parity, odd lengths, two chunks over 512 tokens (fla's varlen form), long single prompts
SHAPES = [(64, 64), (13, 64), (31, 64), (63, 64), (15, 64), (27, 64), (45, 64), (7, 64), (3, 67),
          (5, 67), (33, 67), (2, 1000), (1, 3000), (9, 333), (40, 77)]


def count_compiles() -> list[str]:
    """Names of the kernels Triton compiles from now on (a compile found in the disk cache
    counts too: it still stalls the step for ~0.1-1 s)."""
    names, real = [], jit.JITFunction._do_compile

    def logged(self, *args, **kwargs):
        names.append(self.fn.__name__)
        return real(self, *args, **kwargs)
    jit.JITFunction._do_compile = logged
    return names


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--preset', default='qwen3_5_0_8b')
    parser.add_argument('--spec-tokens', type=int, default=3, help='0: plain decoding')
    parser.add_argument('--device', default='cuda', help='cpu: a smoke run of this script')
    parser.add_argument('--dtype', default='bfloat16')
    parser.add_argument('--max-batch-size', type=int, default=256)
    parser.add_argument('--out', default=None)
    args = parser.parse_args()
    flags = (f'--device {args.device} --dtype {args.dtype} --session-len 4096 '
             f'--max-batch-size {args.max_batch_size} --load-format dummy')
    if args.spec_tokens:
        flags += f' --speculative-num-draft-tokens {args.spec_tokens}'
    cli = build_parser().parse_args(['serve', 'api_server', preset_model_dir(args.preset),
                                     *shlex.split(flags)])
    start = time.perf_counter()
    pipe = pipeline(cli.model, build_engine_config(cli), speculative_config(cli), progress=False)
    start_s = time.perf_counter() - start
    if args.spec_tokens:
        pipe.engine.agent.rejection_sampler = synthetic_rejection_sampler([0.8, 0.6, 0.5])
    generator = torch.Generator().manual_seed(0)
    prompts = lambda n, length: [torch.randint(100, 5000, (length,), generator=generator)  # noqa
                                 .tolist() for _ in range(n)]
    gen = GenerationConfig(max_new_tokens=4, ignore_eos=True)
    pipe(prompts(64, 64), gen)                    # the first request's one-time host work
    compiled, rows = count_compiles(), []
    for n, length in SHAPES:
        before, t = len(compiled), time.perf_counter()
        pipe(prompts(n, length), gen)
        rows.append(dict(prompts=n, tokens_each=length, ms=1000 * (time.perf_counter() - t),
                         compiles=len(compiled) - before,
                         kernels=','.join(sorted(set(compiled[before:]))) or '-'))
    pipe.close()
    print(f'start-up {start_s:.1f} s')
    print_table(rows, ['prompts', 'tokens_each', 'ms', 'compiles', 'kernels'])
    save_json(output_path(args.out, f'first_shapes_{args.preset}_k{args.spec_tokens}.json'),
              dict(environment=environment(), start_up_s=start_s, rows=rows))


if __name__ == '__main__':
    main()
