"""`pipeline()` as a user writes it on the CPU (issue 39: MTP k=3 against plain, no thread
settings): the embedded model in float32, a 16-token warm-up, then three code prompts x 96 new
tokens (`ignore_eos`), one after another (batch 1) or, with `--together`, in one call; prints the
tokens/s of the timed part. Pair the two modes in turn (a tool that alternates whole processes)
and quote the median of the per-pair ratios: this 2-core machine's speed drifts by ~20%.

    python benchmarks/pipe_cpu_user.py mtp|plain [--together]
"""
import sys
import time

from lmdeploy_lite import GenerationConfig, PytorchEngineConfig, SpeculativeConfig, pipeline

PROMPTS = ['def fibonacci(n):', 'import os\n\n\ndef main(', 'class Stack:\n    def __init__(self']


def main():
    spec = SpeculativeConfig(num_speculative_tokens=3) if sys.argv[1] == 'mtp' else None
    gen = GenerationConfig(max_new_tokens=96, ignore_eos=True)
    with pipeline(backend_config=PytorchEngineConfig(dtype='float32', device='cpu'),
                  speculative_config=spec) as pipe:
        pipe(['def x('], gen_config=GenerationConfig(max_new_tokens=16, ignore_eos=True))
        start = time.perf_counter()
        if '--together' in sys.argv:
            responses = pipe(PROMPTS, gen_config=gen)
        else:
            responses = [pipe(p, gen_config=gen) for p in PROMPTS]
        seconds = time.perf_counter() - start
    print(f'{sum(r.generate_token_len for r in responses) / seconds:.1f} tokens/s')


if __name__ == '__main__':
    main()
