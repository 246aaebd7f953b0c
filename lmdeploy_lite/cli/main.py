"""`lmdeploy_lite generate | chat`: the command line."""
from __future__ import annotations

import argparse
import logging
import sys
import time


def _engine_args(p: argparse.ArgumentParser):
    p.add_argument('model', nargs='?', default=None,
                   help='HF model directory (default: the embedded model)')
    p.add_argument('--dtype', default='auto',
                   choices=['auto', 'float32', 'float64', 'bfloat16', 'float16'],
                   help='weights/activations dtype (auto: float32 on CPU, the checkpoint dtype on CUDA)')
    p.add_argument('--device', default='auto', choices=['auto', 'cpu', 'cuda'],
                   help='where to run (auto: CUDA when present)')
    p.add_argument('--max-batch-size', type=int, default=64, help='max sequences per step')
    p.add_argument('--session-len', type=int, default=None,
                   help='max tokens per sequence, prompt included (default: the model maximum)')
    p.add_argument('--cache-max-entry-count', type=float, default=0.8,
                   help='fraction of free memory for the KV cache')
    p.add_argument('--speculative-algorithm', default=None, choices=['qwen3_5_mtp', 'ngram'],
                   help='speculative decoding method (default qwen3_5_mtp when a draft count '
                        'is given)')
    p.add_argument('--speculative-num-draft-tokens', type=int, default=None,
                   help='drafts per step, 1..8 (enables speculative decoding)')
    p.add_argument('--speculative-draft-model', default=None,
                   help='directory with the mtp.* tensors (default: the target model)')
    p.add_argument('--log-level', default='WARNING', help='python logging level')


def _sampling_args(p: argparse.ArgumentParser):
    p.add_argument('--max-new-tokens', type=int, default=128, help='tokens to generate at most')
    p.add_argument('--temperature', type=float, default=0.0, help='0 = greedy')
    p.add_argument('--top-p', type=float, default=1.0, help='nucleus sampling mass')
    p.add_argument('--top-k', type=int, default=0, help='0 = off')
    p.add_argument('--seed', type=int, default=None, help='random seed for sampling')


def speculative_config(args):
    from lmdeploy_lite import SpeculativeConfig
    if args.speculative_algorithm is None and args.speculative_num_draft_tokens is None:
        return None
    return SpeculativeConfig(method=args.speculative_algorithm or 'qwen3_5_mtp',
                             num_speculative_tokens=args.speculative_num_draft_tokens or 3,
                             model=args.speculative_draft_model)


def _build(args):
    from lmdeploy_lite import GenerationConfig, PytorchEngineConfig, pipeline
    logging.basicConfig(level=args.log_level.upper())
    engine_config = PytorchEngineConfig(dtype=args.dtype, device=args.device,
                                        max_batch_size=args.max_batch_size,
                                        session_len=args.session_len,
                                        cache_max_entry_count=args.cache_max_entry_count)
    gen_config = GenerationConfig(max_new_tokens=args.max_new_tokens,
                                  do_sample=args.temperature > 0, temperature=args.temperature,
                                  top_p=args.top_p, top_k=args.top_k, random_seed=args.seed)
    return pipeline(args.model, engine_config, speculative_config(args)), gen_config


def cmd_generate(args) -> int:
    pipe, gen_config = _build(args)
    with pipe:
        start = time.perf_counter()
        n = 0
        for r in pipe.stream_infer(args.prompt, gen_config):
            print(r.text, end='', flush=True)
            n = r.generate_token_len
            last = r
        elapsed = time.perf_counter() - start
        print()
        print(f'[{n} tokens in {elapsed:.2f} s, {n / elapsed:.1f} tokens/s, '
              f'finish_reason={last.finish_reason}]', file=sys.stderr)
        stats = last.spec_stats
        if stats is not None:
            per_position = ', '.join(f'{a / stats.num_drafts:.2f}'
                                     for a in stats.accepted_per_position)
            print(f'[speculative: {stats.num_drafts} drafts, {stats.num_accepted_tokens}/'
                  f'{stats.num_draft_tokens} draft tokens accepted, mean accepted length '
                  f'{stats.mean_accepted_length:.2f}, acceptance by position: {per_position}]',
                  file=sys.stderr)
    return 0


def cmd_chat(args) -> int:
    pipe, gen_config = _build(args)
    messages = []
    with pipe:
        print('chat: empty line or Ctrl-D to quit', file=sys.stderr)
        while True:
            try:
                line = input('user> ')
            except EOFError:
                break
            if not line.strip():
                break
            messages.append({'role': 'user', 'content': line})
            reply = ''
            print('assistant> ', end='', flush=True)
            for r in pipe.stream_infer(messages, gen_config):
                print(r.text, end='', flush=True)
                reply += r.text
            print()
            messages.append({'role': 'assistant', 'content': reply})
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog='lmdeploy_lite', description=__doc__)
    sub = parser.add_subparsers(dest='command', required=True)
    gen = sub.add_parser('generate', help='generate text for one prompt')
    _engine_args(gen)
    _sampling_args(gen)
    gen.add_argument('--prompt', required=True, help='prompt text')
    gen.set_defaults(func=cmd_generate)
    chat = sub.add_parser('chat', help='interactive chat through the chat template')
    _engine_args(chat)
    _sampling_args(chat)
    chat.set_defaults(func=cmd_chat)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f'error: {e}', file=sys.stderr)
        return 2


if __name__ == '__main__':
    sys.exit(main())
