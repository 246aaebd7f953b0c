"""Which code launches the torch ops of one engine step: every aten op of the step (views and
allocations left out), counted by op and by the innermost frame of this package or fla that
called it (a TorchDispatchMode: works on any torch version, on CPU and on CUDA; eager steps, so
run with graphs off: a captured step replays the same ops). Triton kernels are not aten ops.

    python benchmarks/probe_step_ops.py --preset qwen3_5_0_8b --device cuda --dtype bfloat16 \
        --streams 32 --long-prompt-len 8192 --max-mixed-tokens 1024
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections import Counter

from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_itl import random_prompts  # noqa: E402
from common import synchronize  # noqa: E402
from profile_mixed import add_mixed_args, mixed_engine  # noqa: E402

from lmdeploy_lite.messages import GenerationConfig  # noqa: E402

NO_KERNEL = ('view', 'slice', 'select', 'as_strided', 't.', 'expand', 'unsqueeze', 'squeeze',
             'split', 'empty', 'alias', 'detach', 'permute', 'transpose', 'unbind', 'reshape',
             '_unsafe_view', 'narrow', 'lift_fresh', 'resolve', 'is_nonzero', 'item',
             '_local_scalar_dense', 'sym_', 'set_', 'record_stream', 'chunk')


class OpSources(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket.__name__)
        if not any(name.startswith(n.rstrip('.')) and (n[-1] != '.' or name == n[:-1])
                   for n in NO_KERNEL):
            frames = [f for f in traceback.extract_stack()
                      if 'lmdeploy_lite' in f.filename or '/fla/' in f.filename]
            where = (f'{frames[-1].filename.split("/")[-1]}:{frames[-1].lineno} '
                     f'{frames[-1].name}' if frames else '?')
            self.counts[(name, where)] += 1
        return func(*args, **(kwargs or {}))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_mixed_args(parser)
    parser.add_argument('--rows', type=int, default=60)
    args = parser.parse_args()
    engine = mixed_engine(args, eager=True)
    vocab = engine.model_config.vocab_size
    gen = GenerationConfig(max_new_tokens=engine.session_len - args.prompt_len - 1,
                           ignore_eos=True)
    seqs = [engine.add_request(p, gen) for p in random_prompts(args.streams, args.prompt_len,
                                                               vocab, 0)]
    while not all(s.prefilled for s in seqs):
        engine.step()
    (prompt,) = random_prompts(1, args.long_prompt_len, vocab, 1)
    engine.add_request(prompt, GenerationConfig(max_new_tokens=2, ignore_eos=True))
    for _ in range(3):                      # into the prompt's chunks
        engine.step()
    synchronize(engine.device)
    mode = OpSources()
    with mode:
        engine.step()
    synchronize(engine.device)
    total = sum(mode.counts.values())
    print(f'one mixed step: {total} torch ops (views and allocations left out)')
    for (name, where), n in mode.counts.most_common(args.rows):
        print(f'{n:5d}  {name:<24} {where}')


if __name__ == '__main__':
    main()
