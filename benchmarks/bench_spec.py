"""AR vs speculative (MTP) decode tokens/s and mean accepted length for k = 1..4.

    python benchmarks/bench_spec.py [--model DIR] [--batch-sizes 1,8] [--ks 1,2,3,4]
                                    [--synthetic-acceptance 0.8,0.6,0.5] [--out out/bench_spec.json]

--synthetic-acceptance accepts draft position i with the given conditional rate (after all
earlier positions were accepted; the last rate repeats) while the engine still does the full
verify and draft work, so that speed can be measured on random weights.
"""
from __future__ import annotations

import argparse
import time

import torch
from common import default_model, environment, print_table, save_json

from lmdeploy_lite.messages import GenerationConfig, PytorchEngineConfig, SpeculativeConfig
from lmdeploy_lite.pytorch.engine.engine import Engine
from lmdeploy_lite.pytorch.spec_decode.rejection import rejection_sample


def synthetic_rejection_sampler(rates: list[float], seed: int = 0):
    generator = torch.Generator().manual_seed(seed)

    def sampler(target_logits, draft_tokens, draft_probs, sampling):
        output, _ = rejection_sample(target_logits, draft_tokens, draft_probs, sampling)
        batch, k = draft_tokens.shape
        rate = torch.tensor([rates[min(i, len(rates) - 1)] for i in range(k)])
        accept = torch.rand(batch, k, generator=generator) < rate
        num_accepted = accept.long().cumprod(-1).sum(-1).to(draft_tokens.device)
        rows = torch.arange(batch, device=draft_tokens.device)
        positions = torch.arange(k + 1, device=draft_tokens.device)
        drafts = torch.cat([draft_tokens, draft_tokens[:, :1]], 1)
        output = torch.where(positions < num_accepted[:, None], drafts, -1)
        output[rows, num_accepted] = target_logits.argmax(-1)[rows, num_accepted]
        return output, num_accepted
    return sampler


def measure(model: str, k: int, batch_size: int, new_tokens: int, rates, args) -> dict:
    spec = SpeculativeConfig(method='qwen3_5_mtp', num_speculative_tokens=k) if k else None
    engine = Engine(model, PytorchEngineConfig(dtype=args.dtype, device=args.device,
                                               max_batch_size=max(batch_size, 2),
                                               session_len=1024), spec, progress=False)
    if k and rates:
        engine.agent.rejection_sampler = synthetic_rejection_sampler(rates)
    vocab = engine.model_config.vocab_size
    prompts = [[(11 * b + 5 * i) % (vocab - 2) + 2 for i in range(args.prompt_len)]
               for b in range(batch_size)]
    engine.generate(prompts[:2], GenerationConfig(max_new_tokens=8, ignore_eos=True))   # warm-up
    engine.spec_stats.__init__()
    cfg = GenerationConfig(max_new_tokens=new_tokens, ignore_eos=True)
    seqs = [engine.add_request(p, cfg) for p in prompts]
    while not all(s.prefilled for s in seqs):
        engine.step()
    start = time.perf_counter()
    while engine.has_work:
        engine.step()
    elapsed = time.perf_counter() - start
    tokens = sum(s.num_generated - 1 for s in seqs)
    return {'k': k, 'batch': batch_size, 'decode_tok_s': tokens / elapsed,
            'mean_accepted_len': engine.spec_stats.mean_accepted_length if k else 1.0,
            'acceptance': engine.spec_stats.acceptance_rate if k else None}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--model', default=None)
    parser.add_argument('--batch-sizes', default='1,8')
    parser.add_argument('--ks', default='1,2,3,4')
    parser.add_argument('--prompt-len', type=int, default=32)
    parser.add_argument('--new-tokens', type=int, default=64)
    parser.add_argument('--synthetic-acceptance', default=None,
                        help='comma-separated conditional acceptance rates per draft position')
    parser.add_argument('--dtype', default='float32')
    parser.add_argument('--device', default='cpu')
    parser.add_argument('--out', default='out/bench_spec.json')
    args = parser.parse_args()
    model = args.model or default_model()
    rates = [float(r) for r in args.synthetic_acceptance.split(',')] \
        if args.synthetic_acceptance else None
    rows = []
    for batch in (int(b) for b in args.batch_sizes.split(',')):
        base = measure(model, 0, batch, args.new_tokens, None, args)
        rows.append(dict(base, speedup=1.0))
        for k in (int(x) for x in args.ks.split(',')):
            row = measure(model, k, batch, args.new_tokens, rates, args)
            rows.append(dict(row, speedup=row['decode_tok_s'] / base['decode_tok_s']))
    print(f'model: {model}  synthetic acceptance: {rates}')
    print_table(rows, ['batch', 'k', 'decode_tok_s', 'speedup', 'mean_accepted_len', 'acceptance'])
    save_json(args.out, {'env': environment(), 'model': model, 'synthetic_acceptance': rates,
                         'rows': rows})


if __name__ == '__main__':
    main()
