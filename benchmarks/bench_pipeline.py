"""Decode tokens/s through `pipeline()` (streamed, as a server would) beside the bare
`Engine.step` loop on the same engine, for plain AR and MTP k (synthetic acceptance on random
weights), plus time to first token and prefill model-FLOPs utilisation.

    python benchmarks/bench_pipeline.py --preset qwen3_5_0_8b --device cuda --dtype bfloat16 \
        --batch-sizes 1,16,64,128,256 --spec-ks 0,3 --synthetic-acceptance 0.8,0.6,0.5 \
        --ttft-lens 128,2048,8192
    python benchmarks/bench_pipeline.py --dp 2 --ep 2 --preset qwen3_5_35b_a3b ...   (mp executor)

Decode rows: `batch` prompts of `--prompt-len` random token ids, `--new-tokens` each, greedy,
ignore_eos. `pipeline_tok_s`: tokens streamed to the consumer between the moment every request
has its first token (prefill done) and the last token, over that time (best of `--repeats`).
`pipeline_all_tok_s`: all output tokens over the whole call (prefill included; what a serving
benchmark's output throughput measures). `loop_tok_s`: the same engine after the pipeline is closed, `--loop-steps` full-batch steps of
the bare step loop (common.timed_decode). `overhead_pct` = loop / pipeline - 1.
TTFT rows (each k of `--spec-ks`: under speculation the first step also runs the MTP head over
the prompt and drafts): one prompt of that length on an idle engine (one prefill forward up to
`--max-prefill-tokens`), through `pipeline()`; `mfu_pct` = model FLOPs of the prefill (2 x
non-embedding parameters x tokens, plus causal attention 2 x L^2 x heads x head_dim per
full-attention layer; the gated-delta chunks are not counted) / TTFT / `--peak-tflops`.
`--model-format fp8`: the linears and routed experts as FP8 blocks (online quantization).
`--session-len`: the engine's at least (its KV cache is planned for the largest batch of such
sessions: `kv_tokens` / `kv_seqs` in each row say what it got). `roofline_pct` (dense
models): the time to read the weights a decode step reads (every parameter but an untied
embedding table, at their stored size: FP8 blocks and scales included) at `--hbm-tb-s` over
the bare loop's step time.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import time

import torch
from bench_spec import first_ids_map, synthetic_rejection_sampler
from common import (add_model_args, environment, output_path, print_table, release_memory,
                    resolve_model, save_json, timed_decode)

from lmdeploy_lite import GenerationConfig, PytorchEngineConfig, SpeculativeConfig, pipeline
from lmdeploy_lite.pytorch.config import ModelConfig

DECODE_COLUMNS = ['layout', 'spec_k', 'batch', 'pipeline_tok_s', 'pipeline_all_tok_s',
                  'loop_tok_s', 'overhead_pct',
                  'loop_step_ms', 'mean_accepted_len', 'roofline_pct']
TTFT_COLUMNS = ['spec_k', 'prompt_len', 'ttft_ms', 'prefill_tok_s', 'tflops', 'mfu_pct']


SYNTHETIC_ENV = 'LMDEPLOY_LITE_BENCH_SYNTHETIC_ACCEPTANCE'    # LMDEPLOY_LITE_*: reaches ranks


def install_synthetic_acceptance(engine):
    """mp worker hook (top-level: pickled by reference): this rank verifies with the synthetic
    acceptance rates of $LMDEPLOY_LITE_BENCH_SYNTHETIC_ACCEPTANCE (TP peers draw alike, and
    take TP rank 0's result anyway)."""
    rates = [float(r) for r in os.environ[SYNTHETIC_ENV].split(',')]
    engine.agent.rejection_sampler = synthetic_rejection_sampler(rates)


@contextlib.contextmanager
def synthetic_acceptance_on_ranks(rates: list[float] | None):
    """While a multi-rank pipeline starts: its mp ranks run `install_synthetic_acceptance`."""
    if not rates:
        yield
        return
    from lmdeploy_lite.pytorch.engine.executor import mp as mp_executor
    real = mp_executor.MPEngineLoop

    class SyntheticLoop(real):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, worker_hook=install_synthetic_acceptance, **kwargs)
    os.environ[SYNTHETIC_ENV] = ','.join(map(str, rates))
    mp_executor.MPEngineLoop = SyntheticLoop
    try:
        yield
    finally:
        mp_executor.MPEngineLoop = real


def prompts_of(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (batch, length), generator=generator).tolist()


def stream_decode(pipe, prompts: list[list[int]], gen: GenerationConfig
                  ) -> tuple[float, int, float, int]:
    """(seconds from every request's first token to the last token, tokens in that window;
    seconds from the call to the last token, all tokens)."""
    first: set[int] = set()
    begin = time.perf_counter()
    start, tokens, total, end = None, 0, 0, None
    for chunk in pipe.stream_infer(prompts, gen):
        now = time.perf_counter()
        total += len(chunk.token_ids)
        end = now
        if start is None:
            first.add(chunk.index)
            if len(first) == len(prompts):
                start = now
            continue
        tokens += len(chunk.token_ids)
    if start is None or tokens == 0:
        raise RuntimeError('no decode window: raise --new-tokens')
    return end - start, tokens, end - begin, total


def prefill_flops(config: ModelConfig, length: int) -> float:
    from lmdeploy_lite.pytorch.models.qwen3_5 import Qwen3_5ForCausalLM
    model = Qwen3_5ForCausalLM(config, torch.bfloat16, 'meta')
    params = sum(p.numel() for n, p in model.named_parameters() if 'embed_tokens' not in n)
    if config.tie_word_embeddings:
        params += config.vocab_size * config.hidden_size
    full = sum(t == 'full_attention' for t in config.layer_types)
    attention = full * 2 * length * length * config.num_attention_heads * config.head_dim
    lm_head_unused = 2 * (length - 1) * config.vocab_size * config.hidden_size  # logits: last only
    return 2 * params * length + attention - lm_head_unused


def run_k(args, model_dir: str, load_format: str, k: int, rates) -> tuple[list, list]:
    batch_sizes = [int(b) for b in args.batch_sizes.split(',') if b]
    ttft_lens = [int(n) for n in args.ttft_lens.split(',') if n]
    session_len = max([args.session_len or 0,
                       args.prompt_len + (args.new_tokens + 2) * (k + 1) + 16,
                       args.prompt_len + (args.loop_steps + args.warmup_steps + 2
                                          + max(batch_sizes)) * (k + 1) + 16,   # + the stagger
                       *(n + 16 for n in ttft_lens)])
    # a batch is spread over the DP ranks (the front-end routes to the least loaded one)
    per_rank_batch = -(-max(batch_sizes) // args.dp)
    cfg = PytorchEngineConfig(enable_prefix_caching=args.enable_prefix_caching,
                              dtype=args.dtype, device=args.device, tp=args.tp, dp=args.dp,
                              ep=args.ep, sequence_parallel=args.sequence_parallel,
                              max_batch_size=per_rank_batch, session_len=session_len,
                              max_prefill_token_num=args.max_prefill_tokens,
                              load_format=load_format, seed=args.seed,
                              eager_mode=args.eager_mode, async_scheduling=args.async_scheduling,
                              max_prefill_graph_tokens=args.max_prefill_graph_tokens,
                              ssm_state_dtype=args.ssm_state_dtype,
                              model_format=args.model_format,
                              **({} if args.max_mixed_tokens is None
                                 else {'max_mixed_token_num': args.max_mixed_tokens}))
    spec = (SpeculativeConfig(num_speculative_tokens=k, dynamic=args.dynamic_k,
                              draft_token_map=args.token_map) if k else None)
    with synthetic_acceptance_on_ranks(rates if k else None):
        pipe = pipeline(model_dir, backend_config=cfg, speculative_config=spec, progress=False)
    engine = pipe.engine                           # None with the mp/ray executors
    kv = {}
    if engine is not None:                         # what the KV plan gave this engine
        cache = engine.cache_config
        kv_tokens = (cache.num_blocks - 1) * cache.block_size         # block 0 is reserved
        kv = {'kv_tokens': kv_tokens, 'kv_seqs': kv_tokens // session_len}
        print(f'spec k={k}: KV cache {cache.num_blocks} blocks x {cache.block_size} tokens = '
              f'{kv_tokens} tokens, {kv["kv_seqs"]} sequences of session_len={session_len}; '
              f'{cache.num_state_slots - 1} state slots')
    if k and rates and engine is not None:
        engine.agent.rejection_sampler = synthetic_rejection_sampler(rates)
    config = ModelConfig.from_pretrained(model_dir)
    vocab = config.vocab_size
    layout = f'tp{args.tp} dp{args.dp} ep{args.ep}' + (' fp8' if args.model_format else '')
    step_bytes = None
    if engine is not None and not config.num_experts:
        target = getattr(engine.agent, 'target', engine.agent).model      # (a spec agent's)
        step_bytes = sum(p.numel() * p.element_size() for name, p in target.named_parameters()
                         if config.tie_word_embeddings or 'embed_tokens' not in name)
    rows, ttft_rows = [], []
    try:
        pipe([[5] * 16] * 2, GenerationConfig(max_new_tokens=4, ignore_eos=True))   # warm-up
        for bs in batch_sizes:
            prompts = prompts_of(bs, args.prompt_len, vocab, bs)
            gen = GenerationConfig(max_new_tokens=args.new_tokens, ignore_eos=True)
            best = best_all = 0.0
            for _ in range(args.repeats):
                seconds, tokens, all_seconds, all_tokens = stream_decode(pipe, prompts, gen)
                best = max(best, tokens / seconds)
                best_all = max(best_all, all_tokens / all_seconds)
            rows.append({'layout': layout, 'spec_k': k, 'batch': bs, 'pipeline_tok_s': best,
                         'pipeline_all_tok_s': best_all, **kv})
        for n in ttft_lens:
            prompt = prompts_of(1, n, vocab, n)[0]
            gen = GenerationConfig(max_new_tokens=1, ignore_eos=True)
            best = float('inf')
            for _ in range(args.repeats):
                start = time.perf_counter()
                pipe(prompt, gen)
                best = min(best, time.perf_counter() - start)
            flops = prefill_flops(config, n)
            ttft_rows.append({'spec_k': k, 'prompt_len': n, 'ttft_ms': 1000 * best,
                              'prefill_tok_s': n / best, 'tflops': flops / best / 1e12,
                              'mfu_pct': 100 * flops / best / 1e12 / args.peak_tflops})
    finally:
        pipe.close()
    if engine is not None:                       # the bare step loop on the same engine
        for row in rows:
            prompts = prompts_of(row['batch'], args.prompt_len, vocab, row['batch'])
            # as many tokens as the session allows: with mixed steps the batch's sequences
            # start decoding over many steps, and none may finish inside the timed window
            gen = GenerationConfig(max_new_tokens=session_len - args.prompt_len - 1,
                                   ignore_eos=True)
            seconds, tokens = timed_decode(engine, prompts, gen, args.warmup_steps,
                                           args.loop_steps)
            row.update(loop_tok_s=tokens / seconds, loop_step_ms=1000 * seconds / args.loop_steps,
                       overhead_pct=100 * ((tokens / seconds) / row['pipeline_tok_s'] - 1),
                       mean_accepted_len=engine.spec_stats.mean_accepted_length if k else 1.0)
            if step_bytes:
                row.update(weight_gb=step_bytes / 1e9, roofline_pct=100 * step_bytes
                           / (args.hbm_tb_s * 1e12) / (seconds / args.loop_steps))
    del pipe, engine
    release_memory()
    return rows, ttft_rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser)
    parser.add_argument('--tp', type=int, default=1)
    parser.add_argument('--dp', type=int, default=1)
    parser.add_argument('--ep', type=int, default=1)
    parser.add_argument('--sequence-parallel', action='store_true',
                        help='sequence parallelism inside the TP groups (needs --tp > 1)')
    parser.add_argument('--spec-ks', default='0', help='MTP draft tokens per run (0: plain AR)')
    parser.add_argument('--synthetic-acceptance', default=None,
                        help='draft i accepted with these conditional rates (random weights '
                             'accept nothing), e.g. 0.8,0.6,0.5')
    parser.add_argument('--dynamic-k', action=argparse.BooleanOptionalAction, default=True,
                        help='SpeculativeConfig.dynamic (--no-dynamic-k: a fixed k)')
    parser.add_argument('--token-map-size', type=int, default=None, metavar='N',
                        help='MTP drafts over the first N ids (dummy weights; bench_spec.py)')
    parser.add_argument('--batch-sizes', default='1,16,64')
    parser.add_argument('--prompt-len', type=int, default=128)
    parser.add_argument('--session-len', type=int, default=None,
                        help='at least this session_len (the KV plan caps the cache at '
                             'max batch x session_len; default: what the rows need)')
    parser.add_argument('--new-tokens', type=int, default=256)
    parser.add_argument('--repeats', type=int, default=2,
                        help='pipeline runs per row; the best counts (the first one may pay for '
                             'kernel compiles of new prefill shapes)')
    parser.add_argument('--loop-steps', type=int, default=64, help='timed bare-loop steps')
    parser.add_argument('--warmup-steps', type=int, default=4)
    parser.add_argument('--ttft-lens', default='', help='prompt lengths of TTFT rows (each k)')
    parser.add_argument('--max-prefill-tokens', type=int, default=8192)
    parser.add_argument('--peak-tflops', type=float, default=989.0,
                        help='dense bf16 peak of the card (H100 SXM: 989)')
    parser.add_argument('--ssm-state-dtype', default='auto')
    parser.add_argument('--max-mixed-tokens', type=int, default=None,
                        help="max_mixed_token_num (default: the engine's)")
    parser.add_argument('--eager-mode', action='store_true', help='no CUDA graphs')
    parser.add_argument('--max-prefill-graph-tokens', type=int, default=512,
                        help='prefill steps of up to this many tokens replay CUDA graphs (0: none)')
    parser.add_argument('--enable-prefix-caching', action=argparse.BooleanOptionalAction,
                        default=True, help='PytorchEngineConfig.enable_prefix_caching')
    parser.add_argument('--model-format', default=None, choices=['fp8'])
    parser.add_argument('--hbm-tb-s', type=float, default=3.35,
                        help='HBM bandwidth of roofline_pct (H100 SXM: 3.35)')
    parser.add_argument('--out', default=None)
    args = parser.parse_args()
    model_dir, load_format = resolve_model(args)
    args.token_map = None
    if args.token_map_size is not None:
        args.token_map = first_ids_map(parser, args, model_dir, load_format)
    rates = ([float(r) for r in args.synthetic_acceptance.split(',')]
             if args.synthetic_acceptance else None)
    rows, ttft_rows = [], []
    for k in (int(k) for k in args.spec_ks.split(',')):
        more, more_ttft = run_k(args, model_dir, load_format, k, rates)
        rows += more
        ttft_rows += more_ttft
    name = args.preset or model_dir
    save_json(output_path(args.out, f'bench_pipeline_{args.preset or "model"}_'
                                    f'{args.device}.json'),
              {'env': environment(), 'model': name, 'args': vars(args), 'rows': rows,
               'ttft_rows': ttft_rows})
    print(f'model: {name} ({load_format} weights), {args.dtype} on {environment()["device"]}; '
          f'synthetic acceptance: {rates}')
    if ttft_rows:
        print_table(ttft_rows, TTFT_COLUMNS)
    print_table(rows, DECODE_COLUMNS)


if __name__ == '__main__':
    main()
