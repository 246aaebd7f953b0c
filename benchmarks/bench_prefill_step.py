"""Prefill and mixed steps with and without their CUDA graphs (issue 38): per step shape, the
step's wall time (engine.step(), which ends reading the sampled tokens) and its host time (until
the agent's step returns, before any wait for the device), best of --repeats, for
`--max-prefill-graph-tokens` 0 (eager) and the default, side by side in one process.

Shapes: one fresh prompt of N tokens (`prefill N`), a prefix-cache hit whose last N tokens are
fed (`hit N`, 1,500 cached), and `mixed`: 32 decoding sequences plus a prompt's chunk of
--mixed-budget less 32 tokens.

python benchmarks/bench_prefill_step.py --preset qwen3_5_0_8b --device cuda --dtype bfloat16
"""
import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (add_model_args, print_table, release_memory, resolve_model,  # noqa: E402
                    save_json, synchronize)

from lmdeploy_lite.messages import GenerationConfig, PytorchEngineConfig  # noqa: E402
from lmdeploy_lite.pytorch.engine.build import build_engine  # noqa: E402

COLUMNS = ['shape', 'graph_tokens', 'captured_q_len', 'host_ms', 'step_ms', 'replays',
           'graph_mib']


def measure(args, path, load_format, graph_tokens: int) -> list[dict]:
    cfg = PytorchEngineConfig(dtype=args.dtype, device=args.device, load_format=load_format,
                              session_len=10000, max_batch_size=40, max_prefill_token_num=8192,
                              max_mixed_token_num=args.mixed_budget,
                              max_prefill_graph_tokens=graph_tokens)
    engine = build_engine(path, cfg, progress=False)
    vocab = min(10000, engine.model_config.vocab_size - 1)
    rng = random.Random(0)
    agent = getattr(engine.agent, 'target', engine.agent)
    host = []
    step = engine.agent.step

    def timed_agent_step(inputs, sampling):
        start = time.perf_counter()
        out = step(inputs, sampling)
        host.append(time.perf_counter() - start)
        return out
    engine.agent.step = timed_agent_step

    def tokens(n):
        return [rng.randrange(3, vocab) for _ in range(n)]

    def one_step(prompt=None, cached=None):
        """(host ms, wall ms) of the next step after adding `prompt`."""
        if prompt is not None:
            engine.add_request(prompt, GenerationConfig(max_new_tokens=1, ignore_eos=True))
        synchronize(engine.device)
        host.clear()
        start = time.perf_counter()
        engine.step()
        synchronize(engine.device)
        return 1000 * host[0], 1000 * (time.perf_counter() - start)

    def drain():
        while engine.has_work:
            engine.step()

    # what capturing the prefill graphs added to the reserved memory (decode graphs: before)
    graph_mib = agent.prefill_graph.reserved_bytes / 2**20 if agent.prefill_graph else 0
    rows = []
    prefix = tokens(1500)
    for shape in args.shapes.split(','):
        kind, n = (shape.split() + ['0'])[:2]
        n = int(n)
        if kind == 'mixed':
            shape = f'mixed 32 + {args.mixed_budget - 32}'
        best = (float('inf'), float('inf'))
        before = agent.prefill_graph.num_replays if agent.prefill_graph else 0
        for _ in range(args.repeats + 1):          # the first: compiles and lazy set-up
            if kind == 'prefill':
                result = one_step(tokens(n))
            elif kind == 'hit':
                engine.add_request(prefix + tokens(8), GenerationConfig(max_new_tokens=1))
                drain()
                result = one_step(prefix + tokens(n))
            else:                                  # mixed: 32 streams decode, a chunk rides
                streams = [engine.add_request(tokens(16), GenerationConfig(
                    max_new_tokens=64, ignore_eos=True)) for _ in range(32)]
                while any(s.num_generated == 0 for s in streams):
                    engine.step()
                result = one_step(tokens(4 * args.mixed_budget))
            best = min(best, result)
            drain()
        after = agent.prefill_graph.num_replays if agent.prefill_graph else 0
        rows.append({'shape': shape, 'graph_tokens': graph_tokens, 'host_ms': best[0],
                     'step_ms': best[1], 'replays': after - before, 'graph_mib': graph_mib})
    del engine
    release_memory()
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser, dtype='bfloat16', device='cuda')
    parser.add_argument('--shapes', default='prefill 16,prefill 128,prefill 512,hit 48,mixed')
    parser.add_argument('--graph-tokens', default='0,512')
    parser.add_argument('--mixed-budget', type=int, default=128,
                        help='max_mixed_token_num: the mixed shapes carry a chunk of this less '
                             'the 32 decode rows (default 128: a 96-token chunk)')
    parser.add_argument('--repeats', type=int, default=3)
    parser.add_argument('--captured-q-lens', default=None,
                        help='comma-separated gated_delta_rule.CAPTURED_PREFILL_TOKENS to run '
                             'each graph setting with (the longest chunk a captured step takes)')
    parser.add_argument('--out', default=None)
    args = parser.parse_args()
    path, load_format = resolve_model(args)
    from lmdeploy_lite.pytorch.backends.cuda import gated_delta_rule
    rows = []
    for graph_tokens in (int(t) for t in args.graph_tokens.split(',')):
        for q_len in (args.captured_q_lens or str(gated_delta_rule.CAPTURED_PREFILL_TOKENS)).split(','):
            gated_delta_rule.CAPTURED_PREFILL_TOKENS = int(q_len)
            rows += [dict(row, captured_q_len=int(q_len))
                     for row in measure(args, path, load_format, graph_tokens)]
    if args.out:
        save_json(args.out, {'args': vars(args), 'rows': rows})
    print_table(rows, COLUMNS)


if __name__ == '__main__':
    main()
