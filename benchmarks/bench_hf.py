"""HF transformers decode step time on the same shape (the anchor of ../shared/reference/gpu.md).

    python benchmarks/bench_hf.py --preset qwen3_5_9b --device cuda --dtype bfloat16 \
        [--batch-sizes 1,16] [--prompt-len 128] [--decode-steps 32]

Builds `AutoModelForCausalLM.from_config(<text config>)` (random weights) directly on the device,
prefills `prompt_len` random tokens per sequence, then times `decode_steps` greedy steps of
`model(input_ids=<last token>, past_key_values=...)` after `warmup` untimed ones (prefill
excluded). bench_decode.py --hf runs the same and prints it beside the engine.
"""
from __future__ import annotations

import argparse
import importlib.util
import time

import torch
from common import (add_model_args, environment, output_path, print_table, release_memory,
                    resolve_model, save_json, synchronize)

_DTYPES = {'float32': torch.float32, 'bfloat16': torch.bfloat16, 'float16': torch.float16}


def hf_info() -> dict:
    """transformers' version and whether its fast GDN paths (fla, causal-conv1d) import."""
    import transformers
    return {'transformers': transformers.__version__,
            'fla': importlib.util.find_spec('fla') is not None,
            'causal_conv1d': importlib.util.find_spec('causal_conv1d') is not None}


def build_hf_model(model_dir: str, dtype: torch.dtype, device: torch.device):
    """The text model of `model_dir`'s config.json with random weights, in eval mode."""
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.from_pretrained(model_dir).get_text_config()
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


@torch.no_grad()
def measure_hf(model, batch_size: int, prompt_len: int, decode_steps: int,
               warmup: int = 3) -> dict:
    """Per-step ms and tokens/s of greedy decode at `batch_size` after a `prompt_len` prefill."""
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(batch_size)
    prompt = torch.randint(model.config.vocab_size, (batch_size, prompt_len), generator=generator)
    out = model(input_ids=prompt.to(device), use_cache=True, logits_to_keep=1)
    cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    for step in range(warmup + decode_steps):
        if step == warmup:
            synchronize(device)
            start = time.perf_counter()
        out = model(input_ids=token, past_key_values=cache, use_cache=True)
        cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    synchronize(device)
    step_s = (time.perf_counter() - start) / decode_steps
    return {'impl': 'hf', 'batch': batch_size, 'context': prompt_len, 'step_ms': 1000 * step_s,
            'tok_s': batch_size / step_s}


def run_hf(model_dir: str, dtype: str, device: str, batch_sizes: list[int], prompt_len: int,
           decode_steps: int) -> list[dict]:
    """Build, measure each batch size, free the model (the engine is built after it)."""
    model = build_hf_model(model_dir, _DTYPES[dtype], torch.device(device))
    rows = [measure_hf(model, bs, prompt_len, decode_steps) for bs in batch_sizes]
    del model
    release_memory()
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser)
    parser.add_argument('--batch-sizes', default='1,16')
    parser.add_argument('--prompt-len', type=int, default=128)
    parser.add_argument('--decode-steps', type=int, default=32)
    parser.add_argument('--out', default=None)
    args = parser.parse_args()
    model_dir, _ = resolve_model(args)
    rows = run_hf(model_dir, args.dtype, args.device,
                  [int(b) for b in args.batch_sizes.split(',')], args.prompt_len,
                  args.decode_steps)
    print(f'model: {args.preset or model_dir}  {hf_info()}')
    print_table(rows, ['impl', 'batch', 'context', 'step_ms', 'tok_s'])
    save_json(output_path(args.out, f'bench_hf_{args.preset or "model"}_{args.device}.json'),
              {'env': environment(), 'hf': hf_info(), 'model': args.preset or model_dir,
               'rows': rows})


if __name__ == '__main__':
    main()
