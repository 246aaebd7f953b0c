"""Bytes moved by TP collectives per decode step with sequence parallelism off and on (issue 24),
read from the collective trace (distributed.py records every collective's op, group, shape and
dtype), for real Qwen3.5 shapes on dummy weights, tp=2 on CPU (gloo).

    python benchmarks/bench_sp_bytes.py [--presets qwen3_5_9b,qwen3_5_35b_a3b] [--batches 1,64]
        [--layers 4] [--experts 16] [--dtype bfloat16] [--repeats 3]

One step = the target forward of `batch` sequences decoding one token each (16 tokens of
history) plus the LM head, as the engine runs it (plan-padded token count). SHRUNK to fit a
2-core CPU box: `--layers` decoder layers instead of the preset's (a full 3 linear + 1 full
attention cycle by default; per-layer bytes are the same in every cycle, so the full model's
layer bytes are these x num_hidden_layers / layers) and, for MoE presets, `--experts` routed
experts (ep=1: the experts' count changes no TP collective's shape). Bytes per rank with ring
algorithms over p ranks: all-reduce of n bytes 2(p-1)/p n, reduce-scatter of an n-byte input
(p-1)/p n, all-gather of n bytes per rank (p-1) n; "payload" is the traced tensors' bytes.
step_ms_cpu: the best of `--repeats` steps after a warm-up, on a shared 2-core CPU (gloo):
context only, not a GPU figure.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time

import torch
import torch.multiprocessing as mp
from common import environment, print_table, save_json
from presets import preset_config

from lmdeploy_lite.pytorch.config import CacheConfig, DistConfig
from lmdeploy_lite.pytorch.distributed import DistContext
from lmdeploy_lite.pytorch.cache_engine import CacheEngine
from lmdeploy_lite.pytorch.engine.executor.mp import free_port
from lmdeploy_lite.pytorch.engine.step_plan import round_up
from lmdeploy_lite.pytorch.model_inputs import ForwardSizes, ModelInputs
from lmdeploy_lite.pytorch.models.loader import build_model

HISTORY, BLOCK = 16, 16
DTYPES = {'bfloat16': torch.bfloat16, 'float32': torch.float32}


def ring_bytes(op: str, shape: tuple, dtype: str, p: int) -> tuple[int, float]:
    """(payload bytes, bytes this rank sends with a ring algorithm over p ranks)."""
    n = math.prod(shape) * torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    factor = {'all_reduce': 2 * (p - 1) / p, 'reduce_scatter': (p - 1) / p,
              'all_gather': p - 1, 'all_gather_rows': p - 1}.get(op, (p - 1) / p)
    return n, n * factor


def decode_inputs(batch: int, tp: int) -> ModelInputs:
    ids = torch.arange(batch) % 1000 + 10
    tokens, seqs = round_up(batch, tp), round_up(batch, tp)
    return ModelInputs(
        input_ids=ids, positions=torch.full((batch,), HISTORY),
        q_lens=torch.ones(batch, dtype=torch.long), history_lens=torch.full((batch,), HISTORY),
        block_tables=torch.arange(batch * 2).view(batch, 2), state_slots=torch.arange(batch),
        state_index=torch.zeros(batch, dtype=torch.long), is_decoding=True, uniform_q_len=1,
        sizes=ForwardSizes(tokens, tokens, seqs, seqs))


def worker(rank, port, path, args, results):
    torch.set_num_threads(1)
    tp = 2
    out = []
    for sp in (False, True):
        ctx = DistContext.init(DistConfig(tp=tp, sequence_parallel=sp), rank,
                               f'tcp://127.0.0.1:{port + sp}')
        dtype = DTYPES[args.dtype]
        model = build_model(path, dtype, 'cpu', progress=False, dist_ctx=ctx,
                            load_format='dummy')
        max_batch = max(args.batches)
        caches = CacheEngine(model.config, CacheConfig(block_size=BLOCK, num_blocks=2 * max_batch,
                                                       num_state_slots=max_batch), dtype, 'cpu',
                             tp=tp)
        with torch.inference_mode():
            for batch in args.batches:
                timings = []
                for _ in range(1 + args.repeats):        # the first one warms up
                    ctx.begin_step(batch)
                    start = time.perf_counter()
                    model.compute_logits(model(decode_inputs(batch, tp), caches))
                    timings.append(time.perf_counter() - start)
                elapsed = min(timings[1:])
                trace = [e for e in ctx.trace if e[1] == 'tp']
                sizes = [ring_bytes(op, shape, dtype_, tp) for op, _, shape, dtype_ in trace]
                ops = {}
                for op, *_ in trace:
                    ops[op] = ops.get(op, 0) + 1
                out.append({'sequence_parallel': sp, 'batch': batch,
                            'collectives': len(trace), 'ops': ops,
                            'payload_bytes': sum(n for n, _ in sizes),
                            'ring_bytes_per_rank': sum(r for _, r in sizes),
                            'lm_head_gather_bytes': ring_bytes(*trace[-1][0:1], trace[-1][2],
                                                               trace[-1][3], tp)[1],
                            'step_ms_cpu': elapsed * 1e3})
        ctx.destroy()
        del model, caches
    if rank == 0:
        results.put(out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--presets', default='qwen3_5_9b,qwen3_5_35b_a3b')
    parser.add_argument('--batches', default='1,64')
    parser.add_argument('--layers', type=int, default=4)
    parser.add_argument('--experts', type=int, default=16)
    parser.add_argument('--dtype', default='bfloat16', choices=sorted(DTYPES))
    parser.add_argument('--repeats', type=int, default=3, help='timed steps (the best is kept)')
    parser.add_argument('--out', default='benchmarks/results/issue24/bench_sp_bytes_cpu.json')
    args = parser.parse_args()
    args.batches = [int(b) for b in args.batches.split(',')]
    rows, shrunk = [], []
    spawn = mp.get_context('spawn')
    for name in args.presets.split(','):
        config = preset_config(name)
        full_layers = config['num_hidden_layers']
        config['num_hidden_layers'] = args.layers
        config['layer_types'] = config['layer_types'][:args.layers]
        note = f'{name}: {args.layers} of {full_layers} layers'
        if 'num_experts' in config:
            note += f", {args.experts} of {config['num_experts']} experts"
            config['num_experts'] = args.experts
        shrunk.append(note)
        with tempfile.TemporaryDirectory() as path:
            with open(os.path.join(path, 'config.json'), 'w') as f:
                json.dump(config, f)
            results = spawn.Queue()
            port = free_port()
            procs = [spawn.Process(target=worker, args=(r, port, path, args, results))
                     for r in range(2)]
            for p in procs:
                p.start()
            out = results.get(timeout=1800)
            for p in procs:
                p.join(120)
        for row in out:
            layers_bytes = row['ring_bytes_per_rank'] - row['lm_head_gather_bytes']
            rows.append({'preset': name, 'tp': 2, 'batch': row['batch'],
                         'sp': 'on' if row['sequence_parallel'] else 'off',
                         'collectives': row['collectives'],
                         'payload_MiB': row['payload_bytes'] / 2**20,
                         'ring_MiB_per_rank': row['ring_bytes_per_rank'] / 2**20,
                         'without_lm_head_MiB': layers_bytes / 2**20,
                         'ops': ' '.join(f'{k}x{v}' for k, v in sorted(row['ops'].items())),
                         'step_ms_cpu': row['step_ms_cpu']})
    print('SHRUNK: ' + '; '.join(shrunk) + f' ({args.dtype}, dummy weights, CPU gloo, tp=2)')
    print_table(rows, ['preset', 'tp', 'batch', 'sp', 'collectives', 'payload_MiB',
                       'ring_MiB_per_rank', 'without_lm_head_MiB', 'ops', 'step_ms_cpu'])
    save_json(args.out, {'env': environment(), 'shrunk': shrunk, 'dtype': args.dtype,
                         'rows': rows})


if __name__ == '__main__':
    main()
