"""Diagnose a tp=2 graph run that does not finish (2 GPUs): one layout, graphs on, the embedded
model in float32 with MTP k=3 dynamic; each rank dumps its Python stacks after DUMP_S seconds
(faulthandler), and the request waits at most WAIT_S. Usage: diag_tp2_graphs.py VARIANT
(tp2 | tp2_draft_tp1 | tp2_sequence_parallel) [eager]."""
import faulthandler
import os
import sys
import time

import torch

from lmdeploy_lite import GenerationConfig, PytorchEngineConfig, SpeculativeConfig
from lmdeploy_lite.api import EMBEDDED_MODEL_DIR
from lmdeploy_lite.pytorch.engine.executor.mp import MPEngineLoop
from lmdeploy_lite.tokenizer import load_tokenizer
from tests.helpers.broken import run_requests

DUMP_S, WAIT_S = float(os.environ.get('DUMP_S', 90)), float(os.environ.get('WAIT_S', 120))


def dump_later(engine):              # worker hook
    faulthandler.dump_traceback_later(DUMP_S, exit=False)
    print(f'rank {engine.dist.rank}: graphs {sorted(getattr(engine.agent, "step_graphs", {}))}',
          flush=True)


def main():
    variant, eager = sys.argv[1], 'eager' in sys.argv[2:]
    layout = dict(tp=2, sequence_parallel=variant == 'tp2_sequence_parallel')
    spec = SpeculativeConfig(num_speculative_tokens=3, dynamic=True,
                             tp=1 if variant == 'tp2_draft_tp1' else None)
    config = PytorchEngineConfig(device='cuda', dtype='float32', block_size=16, session_len=512,
                                 max_batch_size=16, async_scheduling=True,
                                 enable_prefix_caching=False, eager_mode=eager, **layout)
    os.environ['LMDEPLOY_LITE_CHECK_COLLECTIVES'] = '1'
    os.environ['LMDEPLOY_LITE_DIST_TIMEOUT'] = '60'
    tok = load_tokenizer(EMBEDDED_MODEL_DIR)
    prompts = [tok.encode(t) for t in ['def fibonacci(n):', 'import os\n\n\ndef main(']]
    start = time.monotonic()
    loop = MPEngineLoop(EMBEDDED_MODEL_DIR, config, spec, worker_hook=dump_later)
    print(f'{variant}: started in {time.monotonic() - start:.1f} s', flush=True)
    try:
        for n in (1, 2):
            t = time.monotonic()
            out = run_requests(loop, prompts[:n], GenerationConfig(max_new_tokens=64,
                                                                   ignore_eos=True), WAIT_S)
            print(f'{variant}: {n} request(s) in {time.monotonic() - t:.1f} s, accepted '
                  f'{sum(r.spec_stats.num_accepted_tokens for r in out if r.spec_stats)}',
                  flush=True)
    finally:
        loop.close()


if __name__ == '__main__':
    torch.set_num_threads(2)
    main()
