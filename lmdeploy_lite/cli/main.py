"""`lmdeploy_lite generate | chat | serve api_server`: the command line."""
from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import signal
import sys
import time

from lmdeploy_lite.cli.args import (DefaultsFormatter, build_engine_config, engine_args,
                                    sampling_args, speculative_config)
from lmdeploy_lite.reasoning import PARSERS


def _build(args):
    from lmdeploy_lite import GenerationConfig, pipeline
    logging.basicConfig(level=args.log_level.upper())
    engine_config = build_engine_config(args)
    sampling = ('max_new_tokens', 'temperature', 'top_p', 'top_k', 'repetition_penalty',
                'presence_penalty', 'frequency_penalty')       # flags named as the fields
    gen_config = GenerationConfig(do_sample=args.temperature > 0, random_seed=args.seed,
                                  **{name: getattr(args, name) for name in sampling})
    return pipeline(args.model, engine_config, speculative_config(args),
                    chat_template=args.chat_template), gen_config


def cmd_generate(args) -> int:
    pipe, gen_config = _build(args)
    with pipe:
        start = time.perf_counter()
        for last in pipe.stream_infer(args.prompt, gen_config):
            print(last.text, end='', flush=True)
        elapsed = time.perf_counter() - start
        n = last.generate_token_len
        print()
        print(f'[{n} tokens in {elapsed:.2f} s, {n / elapsed:.1f} tokens/s, '
              f'finish_reason={last.finish_reason}]', file=sys.stderr)
        if last.hidden_states_path is not None:
            print(f'[hidden states: {last.hidden_states_path}]', file=sys.stderr)
        stats = last.spec_stats
        if stats is not None:
            per_position = ', '.join(f'{r:.2f}' for r in stats.acceptance_by_position)
            print(f'[speculative: {stats.num_drafts} drafts, {stats.num_accepted_tokens}/'
                  f'{stats.num_draft_tokens} draft tokens accepted, mean accepted length '
                  f'{stats.mean_accepted_length:.2f}, acceptance by position: {per_position}]',
                  file=sys.stderr)
    return 0


def _fit_history(pipe, messages: list[dict], session_len: int, room: int) -> tuple[list[dict], int]:
    """Drop the oldest user/assistant turns (system messages stay) until the prompt leaves `room`
    tokens; (messages, turns dropped). ValueError when the newest message alone does not fit."""
    dropped = 0
    while len(pipe.encode(messages)) > session_len - room:
        turns = [i for i, m in enumerate(messages) if m['role'] != 'system']
        if len(turns) <= 1:
            raise ValueError(f'this message is {len(pipe.encode(messages))} tokens with the chat '
                             f'template, but session_len={session_len} leaves room for at most '
                             f'{session_len - room}; shorten it or start with a larger '
                             f'--session-len')
        first = turns[0]                         # a user turn and the reply that followed it
        end = first + 2 if first + 1 < len(messages) - 1 else first + 1
        messages = messages[:first] + messages[end:]
        dropped += 1
    return messages, dropped


def cmd_chat(args) -> int:
    """Ctrl-C stops a reply (its text stays); Ctrl-C, Ctrl-D or an empty line at the prompt ends
    the session. Turns that outgrow the session are dropped, oldest first, and said so."""
    pipe, gen_config = _build(args)
    session_len = pipe.session_len
    room = min(gen_config.max_new_tokens, max(1, session_len // 4))  # tokens kept to answer in
    messages = []
    with pipe:
        print('chat: empty line, Ctrl-D or Ctrl-C to quit; Ctrl-C during a reply stops it',
              file=sys.stderr)
        while True:
            try:
                line = input('user> ')
            except (EOFError, KeyboardInterrupt):
                print(file=sys.stderr)
                break
            if not line.strip():
                break
            try:
                messages, dropped = _fit_history(
                    pipe, messages + [{'role': 'user', 'content': line}], session_len, room)
            except ValueError as e:
                print(f'error: {e}', file=sys.stderr)
                continue
            if dropped:
                print(f'[the conversation outgrew session_len={session_len}: dropped the '
                      f'{dropped} oldest turn(s)]', file=sys.stderr)
            reply = ''
            print('assistant> ', end='', flush=True)
            stream = pipe.stream_infer(messages, gen_config)
            try:
                for r in stream:
                    print(r.text, end='', flush=True)
                    reply += r.text
            except KeyboardInterrupt:
                print(' [stopped]', end='', flush=True)
            finally:
                stream.close()                        # aborts the request if it still runs
            print()
            messages.append({'role': 'assistant', 'content': reply})
    return 0


SERVE_MODULES = ('fastapi', 'uvicorn', 'pydantic', 'prometheus_client')


def _serve_args(p: argparse.ArgumentParser):
    p.add_argument('--tool-call-parser', default=None, choices=['qwen3coder'],
                   help="lmdeploy's name of the tool-call format the server reads (Qwen3.5's "
                        '<tool_call> blocks) whenever a request gives tools')
    p.add_argument('--server-name', '--host', default='127.0.0.1', help='address to listen on')
    p.add_argument('--server-port', '--port', type=int, default=23333, help='port to listen on')
    p.add_argument('--allow-origins', '--allowed-origins', nargs='+', default=None,
                   metavar='ORIGIN',
                   help="web origins whose pages may call the server (CORS), e.g. "
                        "https://app.example.com, or '*' for any (default: none)")
    p.add_argument('--api-keys', nargs='+', default=None, metavar='KEY',
                   help='accept only requests with "Authorization: Bearer KEY" (any of these; '
                        'every path but /health); keys are also read from --api-keys-file and '
                        'from LMDEPLOY_LITE_API_KEYS (comma-separated), which keep them out of ps')
    p.add_argument('--generation-config', type=_generation_config, default='auto',
                   metavar='{auto,none,lmdeploy,DIR}',
                   help="auto: the model's generation_config.json sampling values are the "
                        "defaults of fields a request omits (vLLM's); none (or lmdeploy): "
                        "OpenAI's; DIR: the generation_config.json there")
    p.add_argument('--reasoning-parser', choices=PARSERS, default='auto',
                   help="qwen3: a chat reply's <think> block goes to reasoning_content (auto: "
                        "when the chat template writes one)")
    p.add_argument('--api-keys-file', default=None, metavar='PATH',
                   help='a file with one API key per line (blank and # lines skipped)')
    p.add_argument('--max-request-bytes', type=int, default=4 * 2**20, metavar='N',
                   help='largest request body accepted (default 4 MiB); larger ones get HTTP 413')
    p.add_argument('--allowed-hosts', nargs='+', default=None, metavar='HOST',
                   help='with a loopback --server-name, Host header names accepted besides '
                        'localhost, 127.0.0.1 and ::1 (others get HTTP 421: a guard against DNS '
                        'rebinding)')
    p.add_argument('--max-concurrent-requests', type=int, default=None, metavar='N',
                   help='generation requests held at once, queued or running (default: four '
                        'times the sequences the engine runs at once, dp x max-batch-size, at '
                        'least 16); more get HTTP 429 with Retry-After')
    p.add_argument('--max-sequences-per-request', type=int, default=256, metavar='N',
                   help='most sequences (prompts x n) one request may run (default 256); more '
                        'get HTTP 400 before any prompt is tokenized')
    p.add_argument('--max-tokens-per-request', type=int, default=2**20, metavar='N',
                   help='most tokens (max_tokens x n x prompts) one request may ask for '
                        '(default 1048576); more get HTTP 400 before any prompt is tokenized')
    p.add_argument('--health-stall-timeout', type=float, default=30.0, metavar='S',
                   help='/health answers 503 naming the rank when the engine has made no '
                        'progress for S seconds while requests are pending (default 30)')
    p.add_argument('--header-timeout', type=float, default=10.0, metavar='S',
                   help="seconds a request's headers may take to arrive from its first byte "
                        '(default 10); slower ones get HTTP 408 and the connection closes')
    p.add_argument('--body-timeout', type=float, default=30.0, metavar='S',
                   help="seconds a request's body may take to arrive after its headers "
                        '(default 30); then the connection closes')
    p.add_argument('--idle-timeout', type=float, default=15.0, metavar='S',
                   help='seconds a connection may stay open without a request, new or kept '
                        'alive (default 15)')
    p.add_argument('--max-connections', type=int, default=None, metavar='N',
                   help='open connections held at once (default: what the file-descriptor '
                        'limit allows, at most 1024); a new one past them is closed at once')
    _process_args(p)


def _process_args(p: argparse.ArgumentParser):
    """Where the server's parts run, and the name it serves under."""
    p.add_argument('--engine-process', action=argparse.BooleanOptionalAction, default=True,
                   help='run a one-rank engine in a process of its own, so that streaming '
                        "holds no GIL it needs (--no-engine-process: in the server's process)")
    p.add_argument('--api-workers', type=int, default=1, metavar='N',
                   help='front-end processes on the one port, sharing the engine (each streams '
                        '~25k chunks/s on a GPU host; BENCHMARKS.md); the concurrency limit is '
                        'split among them')
    p.add_argument('--model-name', '--served-model-name', default=None,
                   help='model id in /v1/models and requests (default: the model directory name)')


def _generation_config(value: str) -> str:
    if value in ('auto', 'none', 'lmdeploy') or os.path.isdir(value):
        return value
    raise argparse.ArgumentTypeError(f'{value!r}: must be auto, none, lmdeploy or a directory')


def file_sampling_defaults(choice: str, model_path: str) -> dict | None:
    """The sampling defaults --generation-config names (None: none)."""
    from lmdeploy_lite.pytorch.config import sampling_defaults
    if choice in ('none', 'lmdeploy'):
        return None
    return sampling_defaults(model_path if choice == 'auto' else choice) or None


def cmd_serve(args) -> int:
    """Exit code: 0 after SIGINT or SIGTERM (the same graceful shutdown), 1 when the engine died,
    2 for a bad argument or a missing extra, 3 when the server could not start."""
    missing = [m for m in SERVE_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        print(f"error: serving needs the 'serve' extra (missing: {', '.join(missing)}); "
              f"install it with: pip install 'lmdeploy_lite[serve]'", file=sys.stderr)
        return 2
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)   # as SIGINT
    try:
        return _load_and_serve(args)
    except KeyboardInterrupt:                # SIGINT or SIGTERM before the server was up
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous)


def _load_and_serve(args) -> int:
    from lmdeploy_lite.serve.openai.connections import CannotListen, HttpLimits, bind_socket
    if args.api_workers < 1:
        print(f'error: --api-workers={args.api_workers}: must be >= 1', file=sys.stderr)
        return 2
    try:                             # before the model loads: a taken port fails in a second
        sock = bind_socket(args.server_name, args.server_port, reuse_port=args.api_workers > 1)
    except CannotListen as e:
        print(f'error: {e}', file=sys.stderr)
        return 3
    from lmdeploy_lite import pipeline
    from lmdeploy_lite.serve.openai.api_server import serve
    from lmdeploy_lite.serve.openai.auth import load_api_keys
    from lmdeploy_lite.serve.openai.checks import ServerLimits
    from lmdeploy_lite.pytorch.spec_decode.build import num_draft_tokens
    logging.basicConfig(level=args.log_level.upper())
    limits = ServerLimits(args.max_request_bytes, args.max_sequences_per_request,
                          args.max_tokens_per_request, args.max_concurrent_requests,
                          args.health_stall_timeout)
    http_limits = HttpLimits(args.header_timeout, args.body_timeout, args.idle_timeout,
                             **({} if args.max_connections is None
                                else {'max_connections': args.max_connections}))
    api_keys = load_api_keys(args.api_keys, args.api_keys_file)
    engine_config = build_engine_config(args)
    spec = speculative_config(args)
    print(f'lmdeploy_lite: loading {args.model or "the embedded model"} (tp={args.tp}, '
          f'dp={args.dp}, ep={args.ep})', flush=True)
    start = time.perf_counter()
    pipe = pipeline(args.model, engine_config, spec, progress=True,   # a repo id: fetched
                    engine_process=args.engine_process, reasoning_parser=args.reasoning_parser,
                    chat_template=args.chat_template)
    print(f'lmdeploy_lite: loaded in {time.perf_counter() - start:.1f} s', flush=True)
    options = dict(host=args.server_name, port=args.server_port, api_keys=api_keys,
                   log_level=args.log_level, num_spec_tokens=num_draft_tokens(spec),
                   limits=limits, allowed_hosts=tuple(args.allowed_hosts or ()),
                   http_limits=http_limits, allow_origins=tuple(args.allow_origins or ()),
                   sampling_defaults=file_sampling_defaults(args.generation_config,
                                                            pipe.model_path))
    name = args.model_name or pipe.model_name
    if args.api_workers == 1:
        return serve(pipe, name, sock=sock, **options)
    from lmdeploy_lite.serve.openai.workers import WorkerSpec, serve_workers, worker_limits
    client = pipe.engine_client
    options['limits'] = worker_limits(limits, pipe.capacity, args.api_workers)
    return serve_workers(pipe, args.api_workers, sock, WorkerSpec(
        pipe.model_path, engine_config, client.model_config, client.session_len, name,
        args.reasoning_parser, args.chat_template, options), graceful_timeout_s=10.0)


def build_parser() -> argparse.ArgumentParser:
    from lmdeploy_lite import __version__
    parser = argparse.ArgumentParser(prog='lmdeploy_lite', description=__doc__)
    parser.add_argument('--version', action='version', version=f'%(prog)s {__version__}')
    sub = parser.add_subparsers(dest='command', required=True)
    for name, about, func in (('generate', 'generate text for one prompt', cmd_generate),
                              ('chat', 'interactive chat through the chat template', cmd_chat)):
        command = sub.add_parser(name, help=about, formatter_class=DefaultsFormatter)
        engine_args(command)
        sampling_args(command)
        command.set_defaults(func=func)
    sub.choices['generate'].add_argument('--prompt', required=True, help='prompt text')
    serve = sub.add_parser('serve', help='serve the model over HTTP')
    serve_sub = serve.add_subparsers(dest='server', required=True)
    api_server = serve_sub.add_parser(
        'api_server', help='OpenAI-compatible server: /v1/models, /v1/completions, '
        '/v1/chat/completions (streaming), /tokenize, /detokenize, /health, /metrics '
        '(Prometheus)', formatter_class=DefaultsFormatter)
    engine_args(api_server)
    _serve_args(api_server)
    api_server.set_defaults(func=cmd_serve)
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
