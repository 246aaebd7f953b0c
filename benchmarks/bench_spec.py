"""AR vs speculative (MTP) decode tokens/s and mean accepted length for k = 1..4.

    python benchmarks/bench_spec.py [--model DIR | --preset qwen3_5_9b] [--device cuda]
        [--dtype bfloat16] [--batch-sizes 1,8] [--ks 1,2,3,4]
        [--synthetic-acceptance 0.8,0.6,0.5] [--token-map PATH | --token-map-size N]
        [--dynamic] [--out bench_spec.json]

--synthetic-acceptance accepts draft position i with the given conditional rate (after all
earlier positions were accepted; the last rate repeats) while the engine still does the full
verify and draft work, so that speed can be measured on random weights (a --preset runs on dummy
weights, MTP head included). Each row times `--decode-steps` engine steps of the full batch after
`--warmup-steps` (prefill excluded) and counts the tokens they emitted; `speedup` is tokens/s over
the AR row of the same batch size; with synthetic acceptance, `expected_speedup` is the same at
the rule's expected accepted length (the draws of a few dozen steps wander). Rows of a fixed k run SpeculativeConfig(dynamic=False);
`--dynamic` adds a row 'dyn' per batch size: k chosen per step up to the largest of --ks, after
`--dynamic-warmup-steps` steps in which the policy measures (its choices are in `k_hist`).

--token-map PATH drafts over a reduced vocabulary (SpeculativeConfig.draft_token_map; build one
with tools/build_token_map.py). --token-map-size N, for dummy weights (a --preset) only, where
no corpus means anything: a map of the first N ids, written to a temporary JSON file.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import tempfile

import torch
from common import (add_model_args, environment, output_path, print_table, release_memory,
                    resolve_model, save_json, timed_decode)

from lmdeploy_lite.messages import GenerationConfig, PytorchEngineConfig, SpeculativeConfig
from lmdeploy_lite.pytorch.backends import get_backend
from lmdeploy_lite.pytorch.engine.build import build_engine
from lmdeploy_lite.pytorch.engine.engine import Engine
from lmdeploy_lite.pytorch.spec_decode.rejection import rejection_sample


def synthetic_rejection_sampler(rates: list[float], seed: int = 0, verify=rejection_sample):
    """Accept draft i with probability rates[i], drawn on the device (a host draw would need a
    synchronizing host-to-device copy every step) from the default generator, seeded here (a
    CUDA graph captures only that one: the agent's step graphs hold this sampler). `verify`:
    the verification whose work it still does (the agent's own rejection_sampler, which knows a
    token map)."""
    torch.manual_seed(seed)
    thresholds: dict[tuple[torch.device, int], torch.Tensor] = {}

    def sampler(target_logits, draft_tokens, draft_probs, sampling, num_drafts=None):
        output, _ = verify(target_logits, draft_tokens, draft_probs, sampling, num_drafts)
        batch, k = draft_tokens.shape
        device = draft_tokens.device
        if (device, 0) not in thresholds:
            for n in range(0, 9):      # copied once, before any step is timed or captured
                thresholds[device, n] = torch.tensor(
                    [rates[min(i, len(rates) - 1)] for i in range(n)]).to(device)
        accept = torch.rand(batch, k, device=device) < thresholds[device, k]
        if num_drafts is not None:      # a row verifies only the drafts its last step made
            accept &= torch.arange(k, device=device) < num_drafts[:, None]
        num_accepted = accept.long().cumprod(-1).sum(-1)
        rows = torch.arange(batch, device=draft_tokens.device)
        positions = torch.arange(k + 1, device=draft_tokens.device)
        drafts = torch.cat([draft_tokens, draft_tokens.new_zeros(batch, 1)], 1)   # k may be 0
        output = torch.where(positions < num_accepted[:, None], drafts, -1)
        output[rows, num_accepted] = get_backend(device).argmax(target_logits)[rows, num_accepted]
        return output, num_accepted
    return sampler


# a large batch's prompts prefill over several steps; those done first decode meanwhile and
# must not reach max_new_tokens before the timed steps end (at batch 128 the AR row counted
# ~22 of its 24 steps' tokens before this margin)
PREFILL_STEPS = 16


def make_engine(model_dir: str, load_format: str, k: int, rates, args,
                 dynamic: bool = False) -> Engine:
    steps = max(args.warmup_steps, args.dynamic_warmup_steps) + args.decode_steps
    spec = (SpeculativeConfig(method='qwen3_5_mtp', num_speculative_tokens=k, dynamic=dynamic,
                              draft_token_map=args.token_map) if k else None)
    engine = build_engine(model_dir, PytorchEngineConfig(
        dtype=args.dtype, device=args.device, max_batch_size=max(args.batch_sizes + [2]),
        session_len=args.prompt_len + (steps + 2 + PREFILL_STEPS) * (k + 1) + 16,
        load_format=load_format,
        seed=args.seed, async_scheduling=args.async_scheduling), spec, progress=False)
    if k and rates:
        engine.agent.rejection_sampler = synthetic_rejection_sampler(
            rates, verify=engine.agent.rejection_sampler)
    return engine


def first_ids_map(parser, args, model_dir: str, load_format: str) -> str:
    """--token-map-size N: a temporary JSON map of ids 0..N-1 (dummy weights only)."""
    from lmdeploy_lite.pytorch.config import ModelConfig
    vocab = ModelConfig.from_pretrained(model_dir).vocab_size
    if args.token_map is not None:
        parser.error('--token-map and --token-map-size: give one of them')
    if load_format != 'dummy':
        parser.error('--token-map-size: only with dummy weights (--preset); for a checkpoint '
                     'build a map with tools/build_token_map.py and pass --token-map')
    if not 1 <= args.token_map_size <= vocab:
        parser.error(f'--token-map-size={args.token_map_size}: must be in 1..{vocab}')
    fd, path = tempfile.mkstemp(prefix='bench_spec_token_map_', suffix='.json')
    with os.fdopen(fd, 'w') as f:
        json.dump(list(range(args.token_map_size)), f)
    return path


def measure(engine: Engine, k: int, batch_size: int, prompt_len: int, warmup_steps: int,
            decode_steps: int, label=None) -> dict:
    """Prefill, warm up, then time `decode_steps` steps; tokens/s of what they emitted."""
    vocab = engine.model_config.vocab_size
    generator = torch.Generator().manual_seed(batch_size)
    prompts = torch.randint(2, vocab, (batch_size, prompt_len), generator=generator).tolist()
    cfg = GenerationConfig(max_new_tokens=(warmup_steps + decode_steps + 1 + PREFILL_STEPS)
                           * (k + 1),
                           ignore_eos=True)
    chosen = []
    if engine.draft_policy is not None:            # the plan's k of every step
        gather = engine._gather_plan

        def gather_and_record(batch, sampling):
            plan = gather(batch, sampling)
            chosen.append(plan.num_spec)
            return plan
        engine._gather_plan = gather_and_record
    elapsed, generated = timed_decode(engine, prompts, cfg, warmup_steps, decode_steps)
    if engine.draft_policy is not None:
        del engine._gather_plan
    timed = chosen[-decode_steps:]
    return {'k': k if label is None else label, 'batch': batch_size,
            'step_ms': 1000 * elapsed / decode_steps, 'decode_tok_s': generated / elapsed,
            # 1 + accepted / verify steps; 1.0 where no step verified a draft (k = 0 throughout)
            'mean_accepted_len': engine.spec_stats.mean_accepted_length or 1.0,
            'acceptance': engine.spec_stats.acceptance_rate if k else None,
            'k_hist': {j: timed.count(j) for j in sorted(set(timed))} if timed else None}


def expected_speedup(row: dict, ar_step_ms: float, rates: list[float] | None) -> float | None:
    """The row's speedup had its steps emitted the synthetic rule's expected tokens, 1 + c_0 +
    ... + c_(k-1) a row for a step of k drafts (mixed over `k_hist` for dynamic k), instead of what
    its `decode_steps` draws gave (a few dozen draws at batch 1 wander by +-10%)."""
    if rates is None:
        return None

    def tokens(k: int) -> float:
        return sum(math.prod(rates[min(j, len(rates) - 1)] for j in range(i + 1))
                   for i in range(k)) + 1.0
    hist = row['k_hist'] or {0: 1}                   # the AR row records no choices
    mean = sum(tokens(k) * n for k, n in hist.items()) / sum(hist.values())
    return mean * ar_step_ms / row['step_ms']


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser)
    parser.add_argument('--batch-sizes', default='1,8')
    parser.add_argument('--ks', default='1,2,3,4')
    parser.add_argument('--prompt-len', type=int, default=128)
    parser.add_argument('--decode-steps', type=int, default=32)
    parser.add_argument('--warmup-steps', type=int, default=4)
    parser.add_argument('--synthetic-acceptance', default=None,
                        help='comma-separated conditional acceptance rates per draft position')
    parser.add_argument('--token-map', default=None, metavar='PATH',
                        help='draft token map (a JSON list or a safetensors token_map tensor)')
    parser.add_argument('--token-map-size', type=int, default=None, metavar='N',
                        help='dummy weights only: a token map of the first N ids')
    parser.add_argument('--dynamic', action='store_true',
                        help="add a row 'dyn' per batch size: k chosen per step (at most the "
                             "largest of --ks)")
    parser.add_argument('--dynamic-warmup-steps', type=int, default=60,
                        help='steps the dynamic row runs before it is timed (the policy '
                             'measures each k first)')
    parser.add_argument('--out', default=None)
    args = parser.parse_args()
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(',')]
    model_dir, load_format = resolve_model(args)
    if args.token_map_size is not None:
        args.token_map = first_ids_map(parser, args, model_dir, load_format)
    rates = [float(r) for r in args.synthetic_acceptance.split(',')] \
        if args.synthetic_acceptance else None
    results = {}
    ks = [int(x) for x in args.ks.split(',')]
    for k in [0] + ks + (['dyn'] if args.dynamic else []):
        dynamic = k == 'dyn'
        k_max = max(ks) if dynamic else k
        engine = make_engine(model_dir, load_format, k_max, rates, args, dynamic=dynamic)
        measure(engine, k_max, 2, args.prompt_len, 2, 2)                     # warm-up
        for batch in args.batch_sizes:
            warmup = args.dynamic_warmup_steps if dynamic else args.warmup_steps
            results[k, batch] = measure(engine, k_max, batch, args.prompt_len, warmup,
                                        args.decode_steps, label=k)
        del engine
        release_memory()
    rows = []
    for batch in args.batch_sizes:
        ar, ar_ms = results[0, batch]['decode_tok_s'], results[0, batch]['step_ms']
        rows += [dict(row, ar_tok_s=ar, speedup=row['decode_tok_s'] / ar,
                      expected_speedup=expected_speedup(row, ar_ms, rates))
                 for (_, b), row in results.items() if b == batch]
    name = args.preset or model_dir
    token_map = (f'first {args.token_map_size} ids' if args.token_map_size is not None
                 else args.token_map)
    save_json(output_path(args.out, f'bench_spec_{args.preset or "model"}_{args.device}.json'),
              {'env': environment(), 'model': name, 'load_format': load_format,
               'dtype': args.dtype, 'synthetic_acceptance': rates, 'token_map': token_map,
               'rows': rows})
    print(f'model: {name} ({load_format} weights), {args.dtype} on {environment()["device"]}; '
          f'synthetic acceptance: {rates}; draft token map: {token_map or "none (full vocab)"}')
    print_table(rows, ['batch', 'k', 'step_ms', 'decode_tok_s', 'ar_tok_s', 'speedup',
                       'expected_speedup', 'mean_accepted_len', 'acceptance', 'k_hist'])


if __name__ == '__main__':
    main()
