"""What storing the gated-delta recurrent state in bf16 costs (PytorchEngineConfig.ssm_state_dtype):
greedy tokens against the fp32-stored state, the state bytes, the KV blocks planned, and the
decode step time.

    python benchmarks/ssm_state_exactness.py                       # embedded model, CPU, fp32
    python benchmarks/ssm_state_exactness.py --preset qwen3_5_0_8b --device cuda --dtype bfloat16
    python benchmarks/ssm_state_exactness.py --device cuda --dtype bfloat16   # embedded, bf16

For each state dtype (float32, then bfloat16) one engine runs `--num-prompts` greedy prompts for
`--max-new-tokens` tokens as one batch (random token ids, seeded: the same prompts for both), then
times `--decode-steps` decode steps of `--batch` sequences (prefill and `--warmup-steps`
excluded; bench_decode's way). The state is always computed in fp32; only its storage differs.

Columns: `match_pct` = tokens equal to the fp32 state's at the same position (over all
prompts x max_new_tokens); `identical` = whole sequences equal; `first_div_median` = median
position of the first differing token over the sequences that differ (0-based; None if none);
`state_mb` = recurrent + conv state bytes of one sequence (no drafts); `kv_blocks` = the blocks
planned (the plan charges the state rows first: bf16 leaves more for KV, up to the cap that
max_batch_size full sessions need); `step_ms` = one decode step of `--batch` sequences.
On random weights (--preset) the logits are nearly flat, so greedy flips easily: a worst case.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import (add_model_args, environment, output_path, print_table, release_memory,
                    resolve_model, save_json, timed_decode)

from lmdeploy_lite.messages import GenerationConfig, PytorchEngineConfig
from lmdeploy_lite.pytorch.config import ModelConfig
from lmdeploy_lite.pytorch.cache_engine import CacheEngine
from lmdeploy_lite.pytorch.engine.build import build_engine
from lmdeploy_lite.pytorch.engine.engine import Engine

COLUMNS = ['state', 'match_pct', 'identical', 'first_div_median', 'state_mb', 'kv_blocks',
           'step_ms', 'tok_s']


def random_prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (num, length), generator=generator).tolist()


def generate(engine: Engine, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy, as one batch (ignore_eos: every sequence runs to max_new_tokens)."""
    gen = GenerationConfig(max_new_tokens=max_new_tokens, ignore_eos=True)
    seqs = [engine.add_request(p, gen) for p in prompts]
    while engine.has_work:
        engine.step()
    return [list(s.generated_ids) for s in seqs]


def compare(reference: list[list[int]], got: list[list[int]]) -> dict:
    """match_pct, identical, first_div_median (None when every sequence is identical)."""
    total = sum(len(r) for r in reference)
    matched = sum(a == b for r, g in zip(reference, got) for a, b in zip(r, g))
    firsts = [next((i for i, (a, b) in enumerate(zip(r, g)) if a != b), None)
              for r, g in zip(reference, got)]
    diverged = [f for f in firsts if f is not None]
    return {'match_pct': 100 * matched / total,
            'identical': f'{len(firsts) - len(diverged)}/{len(firsts)}',
            'first_div_median': statistics.median(diverged) if diverged else None,
            'first_divergences': firsts}


def run(model_dir: str, load_format: str, args, ssm_state_dtype: str,
        prompts: list[list[int]]) -> tuple[dict, list[list[int]]]:
    session_len = args.prompt_len + max(args.max_new_tokens,
                                        args.warmup_steps + args.decode_steps + 8) + 16
    engine = build_engine(model_dir, PytorchEngineConfig(
        dtype=args.dtype, device=args.device, max_batch_size=max(args.batch, args.num_prompts),
        session_len=session_len, load_format=load_format, seed=args.seed,
        async_scheduling=args.async_scheduling, ssm_state_dtype=ssm_state_dtype),
        progress=False)
    start = time.perf_counter()
    tokens = generate(engine, prompts, args.max_new_tokens)
    generate_s = time.perf_counter() - start
    vocab = engine.model_config.vocab_size
    batch_prompts = random_prompts(args.batch, args.prompt_len, vocab, args.seed + 1)
    gen = GenerationConfig(max_new_tokens=args.warmup_steps + args.decode_steps + 8,
                           ignore_eos=True)
    timed_decode(engine, batch_prompts[:2], gen, 2, 2)                       # warm-up
    elapsed, emitted = timed_decode(engine, batch_prompts, gen, args.warmup_steps,
                                    args.decode_steps)
    state_bytes = CacheEngine.bytes_per_state_slot(engine.model_config, 0, engine.dtype,
                                                   ssm_state_dtype=ssm_state_dtype)
    row = {'state': str(engine.agent.caches.state_dtype).replace('torch.', ''),
           'state_mb': state_bytes / 1e6, 'kv_blocks': engine.cache_config.num_blocks,
           'step_ms': 1000 * elapsed / args.decode_steps, 'tok_s': emitted / elapsed,
           'generate_s': generate_s, 'model_dtype': str(engine.dtype)}
    del engine
    release_memory()
    return row, tokens


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser)
    parser.add_argument('--num-prompts', type=int, default=64, help='greedy prompts compared')
    parser.add_argument('--max-new-tokens', type=int, default=64, help='tokens per prompt')
    parser.add_argument('--prompt-len', type=int, default=16)
    parser.add_argument('--batch', type=int, default=64, help='sequences of the timed steps')
    parser.add_argument('--decode-steps', type=int, default=16)
    parser.add_argument('--warmup-steps', type=int, default=4)
    parser.add_argument('--out', default=None)
    args = parser.parse_args()
    model_dir, load_format = resolve_model(args)
    vocab = ModelConfig.from_pretrained(model_dir).vocab_size
    prompts = random_prompts(args.num_prompts, args.prompt_len, vocab, args.seed)
    rows, outputs = [], {}
    for name in ('float32', 'bfloat16'):
        row, outputs[name] = run(model_dir, load_format, args, name, prompts)
        rows.append(dict(row, **compare(outputs['float32'], outputs[name])))
    label = args.preset or model_dir
    save_json(output_path(args.out, f'ssm_state_exactness_{args.preset or "model"}_'
                                    f'{args.dtype}_{torch.device(args.device).type}.json'),
              {'env': environment(), 'model': label, 'load_format': load_format,
               'dtype': args.dtype, 'num_prompts': args.num_prompts,
               'max_new_tokens': args.max_new_tokens, 'prompt_len': args.prompt_len,
               'batch': args.batch, 'rows': rows})
    print(f'model: {label} ({load_format} weights), {rows[0]["model_dtype"]} on '
          f'{environment()["device"]}; {args.num_prompts} greedy prompts x {args.max_new_tokens} '
          f'tokens vs the float32 state; decode steps of batch {args.batch}')
    print_table(rows, COLUMNS)


if __name__ == '__main__':
    main()
