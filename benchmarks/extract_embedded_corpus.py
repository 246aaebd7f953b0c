"""Extract the embedded model's final-normed hidden states (layer L = 8) over windows of its own
training corpus with the engine (method='extract_hidden_states'), the input of
tools/train_mtp_head.py:

    python benchmarks/extract_embedded_corpus.py --windows 300 --out /tmp/embedded_hidden
    python tools/train_mtp_head.py /tmp/embedded_hidden --model lmdeploy_lite/assets/qwen3_5_moe_tiny \
        --out /tmp/embedded_mtp_fresh --threads 1
    python benchmarks/eval_embedded_acceptance.py --model /tmp/embedded_mtp_fresh

The corpus is tools/train_tiny_model.py's training files (this machine's stdlib, the held-out
modules left out), each followed by <|endoftext|>, as one token stream; `--windows` windows of
`--window` tokens are taken at evenly spaced offsets over it (deterministic) and each is one
request with max_new_tokens=1, so its file holds exactly the window's tokens.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, 'tools'))

from lmdeploy_lite import (GenerationConfig, PytorchEngineConfig, SpeculativeConfig,  # noqa: E402
                           pipeline)
from lmdeploy_lite.api import EMBEDDED_MODEL_DIR  # noqa: E402
from train_tiny_model import EOS_TOKEN, corpus_files, encode_texts, read_texts  # noqa: E402


def corpus_windows(num_windows: int, window: int, stdlib: str | None = None) -> list[list[int]]:
    from tokenizers import Tokenizer
    tokenizer = Tokenizer.from_file(os.path.join(EMBEDDED_MODEL_DIR, 'tokenizer.json'))
    train, _ = corpus_files(stdlib)
    stream = encode_texts(tokenizer, read_texts(train), tokenizer.token_to_id(EOS_TOKEN))
    step = (len(stream) - window) // num_windows
    return [stream[i * step:i * step + window].tolist() for i in range(num_windows)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--out', required=True, help='the hidden-states directory')
    parser.add_argument('--windows', type=int, default=300)
    parser.add_argument('--window', type=int, default=512)
    parser.add_argument('--stdlib', default=None, help="corpus root (default: this Python's)")
    parser.add_argument('--batch', type=int, default=16, help='requests in flight at once')
    args = parser.parse_args()
    windows = corpus_windows(args.windows, args.window, args.stdlib)
    spec = SpeculativeConfig(method='extract_hidden_states', aux_hidden_state_layer_ids=(8,),
                             hidden_states_dir=args.out)
    start = time.perf_counter()
    with pipeline(None, PytorchEngineConfig(device='cpu', dtype='float32',
                                            max_batch_size=args.batch,
                                            max_prefill_token_num=4096),
                  spec, progress=False) as pipe:
        done = 0
        for first in range(0, len(windows), args.batch):
            responses = pipe(windows[first:first + args.batch], GenerationConfig(max_new_tokens=1))
            bad = [r for r in responses if r.hidden_states_path is None]
            if bad:
                raise RuntimeError(f'no file for a request: {bad[0].finish_reason} {bad[0].error}')
            done += len(responses)
            print(f'{done}/{len(windows)} windows, {time.perf_counter() - start:.0f} s',
                  flush=True)
    seconds = time.perf_counter() - start
    print(f'{len(windows)} windows x {args.window} tokens = {len(windows) * args.window} tokens '
          f'in {seconds:.0f} s ({len(windows) * args.window / seconds:.0f} tokens/s) -> {args.out}')


if __name__ == '__main__':
    main()
