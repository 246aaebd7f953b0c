"""Decode step time of the engine (plain AR) against the HBM floor, batch and context scaling.

    python benchmarks/bench_decode.py --preset qwen3_5_9b --device cuda --dtype bfloat16 \
        [--batch-sizes 1,2,4,8,16,32,64,128] [--context-lens 1024,4096,16384,32768] [--hf]

Rows: `batch` rows decode `batch` sequences after a `--prompt-len` prefill; `context` rows
decode one sequence after a prefill of that many tokens. Each row times `--decode-steps` full-batch
decode steps after `--warmup-steps` untimed ones (prefill excluded), then aborts its sequences.

HBM floor of a step = bytes it must read / the device-to-device copy bandwidth measured in the
same run (bytes read + written, as gpu.md). Weight bytes: every target parameter except the
embedding table (a step gathers `batch` rows of it) plus the LM head (the same tensor when
tied); the routed experts of a MoE layer at the expected fraction a batch touches under uniform
routing, E * (1 - (1 - k/E)^batch) of E experts (<= min(E, batch * k)). `roofline_pct` = weight
floor / step. Cache bytes (KV of the context read, gated-delta-net state read + written) give
`roofline_all_pct` = (weights + cache) floor / step. `--hf` measures HF transformers on the same
shape first (bench_hf.py) and prints it beside the engine.
"""
from __future__ import annotations

import argparse

import torch
from bench_hf import hf_info, run_hf
from common import (add_model_args, copy_bandwidth, environment, output_path, print_table,
                    release_memory, resolve_model, save_json, timed_decode)

from lmdeploy_lite.messages import GenerationConfig, PytorchEngineConfig
from lmdeploy_lite.pytorch.config import ModelConfig
from lmdeploy_lite.pytorch.cache_engine import CacheEngine
from lmdeploy_lite.pytorch.engine.build import build_engine
from lmdeploy_lite.pytorch.engine.engine import Engine
from lmdeploy_lite.pytorch.models.qwen3_5 import Qwen3_5ForCausalLM

COLUMNS = ['impl', 'batch', 'context', 'step_ms', 'tok_s', 'weights_gb', 'floor_ms',
           'roofline_pct', 'cache_gb', 'roofline_all_pct']


def weight_bytes(config: ModelConfig, dtype: torch.dtype, batch_size: int) -> int:
    """Weight bytes one decode step of `batch_size` sequences reads (see the module docstring);
    counted from the shapes on the meta device."""
    model = Qwen3_5ForCausalLM(config, dtype, 'meta')
    touched = 1.0
    if config.is_moe:
        experts, top_k = config.num_experts, config.num_experts_per_tok
        touched = 1 - (1 - top_k / experts) ** batch_size
    total = 0.0
    for name, param in model.named_parameters():     # a tied LM head is the embedding table
        if name == 'model.embed_tokens.weight' and not config.tie_word_embeddings:
            continue
        scale = touched if '.experts.' in name else 1.0
        total += scale * param.numel() * param.element_size()
    return int(total)


def cache_bytes(config: ModelConfig, dtype: torch.dtype, batch_size: int, context: int) -> int:
    """KV bytes of `context` tokens read per sequence, plus the linear-attention state read and
    written, for `batch_size` sequences."""
    kv = CacheEngine.bytes_per_block(config, 1, dtype) * context
    state = 2 * CacheEngine.bytes_per_state_slot(config, 0, dtype)
    return batch_size * (kv + state)


def measure(engine: Engine, batch_size: int, prompt_len: int, decode_steps: int,
            warmup_steps: int) -> dict:
    """Prefill `batch_size` random prompts, then time `decode_steps` decode steps of the full
    batch (prefill and warm-up excluded)."""
    generator = torch.Generator().manual_seed(batch_size * 7919 + prompt_len)
    vocab = engine.model_config.vocab_size
    prompts = torch.randint(2, vocab, (batch_size, prompt_len), generator=generator).tolist()
    cfg = GenerationConfig(max_new_tokens=warmup_steps + decode_steps + 8, ignore_eos=True)
    elapsed, generated = timed_decode(engine, prompts, cfg, warmup_steps, decode_steps)
    return {'impl': 'engine', 'batch': batch_size, 'context': prompt_len,
            'step_ms': 1000 * elapsed / decode_steps, 'tok_s': generated / elapsed}


def add_floor(row: dict, config: ModelConfig, dtype: torch.dtype, bandwidth: float) -> dict:
    weights = weight_bytes(config, dtype, row['batch'])
    cache = cache_bytes(config, dtype, row['batch'], row['context'])
    floor_ms = 1000 * weights / bandwidth
    return dict(row, weights_gb=weights / 1e9, floor_ms=floor_ms, cache_gb=cache / 1e9,
                roofline_pct=100 * floor_ms / row['step_ms'],
                roofline_all_pct=100 * 1000 * (weights + cache) / bandwidth / row['step_ms'])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser)
    parser.add_argument('--batch-sizes', default='1,2,4,8,16,32,64,128')
    parser.add_argument('--context-lens', default='1024,4096,16384,32768',
                        help="bs=1 rows after a prefill of this many tokens ('' for none)")
    parser.add_argument('--prompt-len', type=int, default=128, help='prompt of the batch rows')
    parser.add_argument('--decode-steps', type=int, default=32)
    parser.add_argument('--warmup-steps', type=int, default=4)
    parser.add_argument('--max-prefill-tokens', type=int, default=8192)
    parser.add_argument('--copy-gib', type=float, default=None,
                        help='size of the bandwidth copy (default 2 on CUDA, 0.25 on CPU)')
    parser.add_argument('--hf', action='store_true', help='also HF transformers, same shape')
    parser.add_argument('--hf-batch-sizes', default='1,16')
    parser.add_argument('--out', default=None)
    args = parser.parse_args()
    model_dir, load_format = resolve_model(args)
    device = torch.device(args.device)
    batch_sizes = [int(b) for b in args.batch_sizes.split(',') if b]
    context_lens = [int(c) for c in args.context_lens.split(',') if c]
    copy_gib = args.copy_gib or (2.0 if device.type == 'cuda' else 0.25)
    bandwidth = copy_bandwidth(device, int(copy_gib * 2**30))
    hf_rows = []
    if args.hf:                                    # first: its memory is freed before the engine
        hf_rows = run_hf(model_dir, args.dtype, args.device,
                         [int(b) for b in args.hf_batch_sizes.split(',')], args.prompt_len,
                         args.decode_steps)
    session_len = max([args.prompt_len, *context_lens]) + args.warmup_steps + args.decode_steps + 16
    engine = build_engine(model_dir, PytorchEngineConfig(
        dtype=args.dtype, device=args.device, max_batch_size=max(batch_sizes + [2]),
        session_len=session_len, max_prefill_token_num=args.max_prefill_tokens,
        load_format=load_format, seed=args.seed,
        async_scheduling=args.async_scheduling), progress=False)
    config, dtype = engine.model_config, engine.dtype
    measure(engine, 2, 16, 2, 2)                                        # warm-up
    rows = [measure(engine, bs, args.prompt_len, args.decode_steps, args.warmup_steps)
            for bs in batch_sizes]
    rows += [measure(engine, 1, ctx, args.decode_steps, args.warmup_steps) for ctx in context_lens]
    rows = [add_floor(r, config, dtype, bandwidth) for r in hf_rows + rows]
    del engine
    release_memory()
    name = args.preset or model_dir
    save_json(output_path(args.out, f'bench_decode_{args.preset or "model"}_{device.type}.json'),
              {'env': environment(), 'model': name, 'load_format': load_format,
               'dtype': str(dtype), 'copy_bandwidth_gb_s': bandwidth / 1e9,
               'hf': hf_info() if args.hf else None, 'rows': rows})
    print(f'model: {name} ({load_format} weights), {dtype} on {environment()["device"]}; '
          f'copy bandwidth {bandwidth / 1e9:.0f} GB/s (read + write)')
    print_table(rows, COLUMNS)

if __name__ == '__main__':
    main()
