"""The Triton routed-experts op (backends/cuda/fused_moe.py) at a MoE preset's expert shapes, bf16
and FP8 weights, per token count: microseconds of one layer's call (CUDA graph replays), the
bytes of the experts it touches over that time, and with `--sweep` a grid of (BLOCK_M, BLOCK_N,
BLOCK_K, warps, stages) beside `moe_config`'s choice (what the heuristic is tuned from).

    python benchmarks/bench_fused_moe.py --preset qwen3_5_35b_a3b --tokens 1,16,64,256 [--sweep]

Routing: each token's top-k of random router logits (softmax weights), the same for every config
of a row. `touched_gb_s`: the distinct experts' weights (and FP8 scales) over the call's time,
what a memory-bound call reads at least.
"""
from __future__ import annotations

import argparse
import itertools

import torch
from bench_fp8_gemm import time_us
from common import environment, output_path, print_table, save_json
from presets import preset_config


def expert_weights(c: dict, fp8: bool, device: str):
    """(gate_up [E, 2I, H], down [E, H, I], scales as fused_moe takes them) of random weights."""
    from lmdeploy_lite.pytorch.models.fp8 import quantize
    e, h, i = c['num_experts'], c['hidden_size'], c['moe_intermediate_size']
    gate_up = torch.randn(e, 2 * i, h, device=device, dtype=torch.bfloat16) * 0.02
    down = torch.randn(e, h, i, device=device, dtype=torch.bfloat16) * 0.02
    if not fp8:
        return gate_up, down, {}
    (gq, gs), (uq, us), (dq, ds) = (quantize(w) for w in (*gate_up.split(i, 1), down))
    return (torch.cat([gq, uq], 1), dq,
            dict(gate_up_scale=torch.cat([gs, us], 1), down_scale=ds))


def grid(num_pairs: int):
    if num_pairs <= 64:                           # one pair a block: BLOCK_M is 16
        return itertools.product((16,), (32, 64, 128), (64, 128), (4,), (2, 3, 4))
    return itertools.product((16, 32, 64), (32, 64, 128), (64, 128), (4, 8), (3, 4))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--preset', default='qwen3_5_35b_a3b')
    parser.add_argument('--tokens', default='1,16,64,256')
    parser.add_argument('--sweep', action='store_true', help='time a grid of kernel configs')
    parser.add_argument('--weights', default='bf16,fp8', help='bf16, fp8 or both')
    parser.add_argument('--out', default=None)
    args = parser.parse_args()
    from lmdeploy_lite.pytorch.backends.cuda.fused_moe import fused_moe, moe_config
    c = preset_config(args.preset)
    top_k, num_experts = c['num_experts_per_tok'], c['num_experts']
    rows = []
    for fp8 in [w == 'fp8' for w in args.weights.split(',')]:
        gate_up, down, scales = expert_weights(c, fp8, 'cuda')
        per_expert = (gate_up[0].numel() + down[0].numel()) * gate_up.element_size() + sum(
            s[0].numel() * 4 for s in scales.values())
        for tokens in map(int, args.tokens.split(',')):
            gen = torch.Generator(device='cuda').manual_seed(tokens)
            x = torch.randn(tokens, c['hidden_size'], device='cuda', dtype=torch.bfloat16,
                            generator=gen)
            logits = torch.randn(tokens, num_experts, device='cuda', generator=gen)
            weights, ids = torch.softmax(logits, -1).topk(top_k, -1)
            default = moe_config(tokens * top_k, num_experts)
            configs = itertools.chain([default], grid(tokens * top_k) if args.sweep else ())
            timed = {}
            for config in configs:
                try:
                    timed[config] = time_us(lambda: fused_moe(x, gate_up, down, weights, ids,
                                                              config=config, **scales), rep=30)
                except Exception:                   # out of shared memory, ...
                    continue
            best = min(timed, key=timed.get)
            touched = ids.unique().numel() * per_expert
            rows.append({'weights': 'fp8' if fp8 else 'bf16', 'tokens': tokens,
                         'experts_touched': ids.unique().numel(), 'default': str(default),
                         'default_us': timed[default], 'best': str(best), 'best_us': timed[best],
                         'touched_gb_s': touched / timed[default] / 1e3,
                         'best_gb_s': touched / timed[best] / 1e3,
                         'sweep': {str(c): round(us, 2) for c, us in timed.items()}})
            print({k: v for k, v in rows[-1].items() if k != 'sweep'}, flush=True)
    print(f'{args.preset}: {torch.cuda.get_device_name()}')
    print_table(rows, ['weights', 'tokens', 'experts_touched', 'default', 'default_us',
                       'touched_gb_s', 'best', 'best_us', 'best_gb_s'])
    save_json(output_path(args.out, f'bench_fused_moe_{args.preset}.json'),
              {'environment': environment(), 'preset': args.preset, 'rows': rows})


if __name__ == '__main__':
    main()
