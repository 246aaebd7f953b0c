"""Count tokens over a corpus and write the N most frequent ids: a draft token map
(SpeculativeConfig.draft_token_map, CLI --speculative-token-map; README "Reduced draft vocabulary").

    python tools/build_token_map.py --model Qwen/Qwen3.5-9B corpus/*.txt --top 32768 \\
        --out qwen35_9b_32k.safetensors

--model: a model directory or a Hugging Face repo id; its config.json gives the vocabulary size
and the eos ids, its tokenizer encodes the text files (no special tokens added).
Corpus files, by name:
  *.json   token ids: a JSON list of ints, or a list of such lists (one per document);
  *.ids    token ids: ints separated by whitespace;
  others   UTF-8 text, encoded with the model's tokenizer (each file as one text).
Output, by --out's extension: .json (a JSON list of ints) or .safetensors (an int64 tensor
`token_map`). The map is the top N ids by count, ties (unseen ids included) broken by the lower
id, so the same corpus always gives the same map; --top is clipped to the vocabulary. Ids given
to --always-include (comma-separated; default 'eos', the model's eos ids; 'none') are kept: any
not among the top N replace the least frequent ones and go at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lmdeploy_lite.pytorch.config import ModelConfig  # noqa: E402


def read_model_config(model: str) -> ModelConfig:
    if os.path.isdir(model):
        path = os.path.join(model, 'config.json')
    else:
        from huggingface_hub import hf_hub_download
        path = hf_hub_download(model, 'config.json')
    with open(path) as f:
        return ModelConfig.from_dict(json.load(f))


def read_token_ids(path: str) -> list[int]:
    """The ids of a token-id file (.json: a list of ints or of int lists; .ids: whitespace)."""
    with open(path, encoding='utf-8') as f:
        if path.endswith('.ids'):
            try:
                return [int(t) for t in f.read().split()]
            except ValueError as e:
                raise ValueError(f'{path}: {e}; an .ids file holds integers separated by '
                                 f'whitespace') from None
        data = json.load(f)
    docs = data if isinstance(data, list) and data and all(isinstance(d, list) for d in data) \
        else [data]
    ids = [t for d in docs for t in (d if isinstance(d, list) else [d])]
    bad = next((t for t in ids if type(t) is not int), None)     # bool is no token id either
    if bad is not None:
        raise ValueError(f'{path}: {bad!r} is not a token id; a .json corpus file is a list of '
                         f'ints or a list of int lists')
    return ids


def count_tokens(files: list[str], model: str, vocab_size: int) -> torch.Tensor:
    """counts [vocab_size] int64 over every file."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    tokenizer = None
    for path in files:
        if path.endswith(('.json', '.ids')):
            ids = read_token_ids(path)
        else:
            if tokenizer is None:
                from transformers import AutoTokenizer
                tokenizer = AutoTokenizer.from_pretrained(model)
                tokenizer.model_max_length = sys.maxsize      # counting, not a forward
            with open(path, encoding='utf-8', errors='replace') as f:
                ids = tokenizer.encode(f.read(), add_special_tokens=False)
        ids = torch.tensor(ids, dtype=torch.long)
        if ids.numel() and not (0 <= int(ids.min()) and int(ids.max()) < vocab_size):
            bad = ids[(ids < 0) | (ids >= vocab_size)][0].item()
            raise ValueError(f'{path}: token id {bad} is outside the vocabulary 0..'
                             f'{vocab_size - 1}')
        counts += torch.bincount(ids, minlength=vocab_size)
    return counts


def top_ids(counts: torch.Tensor, top: int, always_include: list[int]) -> list[int]:
    """The `top` ids by count (ties: lower id first), then any of `always_include` not among
    them in place of the least frequent."""
    vocab_size = counts.numel()
    top = min(top, vocab_size)
    # a stable sort by descending count keeps ids ascending within a count
    order = torch.sort(-counts, stable=True).indices.tolist()
    chosen = order[:top]
    seen = set(chosen)
    extra = [t for t in dict.fromkeys(always_include) if t not in seen]
    if len(extra) > top:
        raise ValueError(f'--always-include: {len(extra)} ids do not fit in --top {top}')
    return chosen[:top - len(extra)] + extra


def parse_always_include(value: str, eos_ids, vocab_size: int) -> list[int]:
    """'eos,17' -> the eos ids and 17; 'none' or '' -> []."""
    ids = []
    for item in value.replace(' ', '').split(','):
        if item == 'eos':
            ids += eos_ids
        elif item not in ('', 'none'):
            if not (item.isdigit() and int(item) < vocab_size):
                raise ValueError(f"--always-include={value!r}: {item!r} is not 'eos', 'none' or "
                                 f"an id in 0..{vocab_size - 1}")
            ids.append(int(item))
    return ids


def write_token_map(ids: list[int], out: str):
    if out.endswith('.json'):
        with open(out, 'w') as f:
            json.dump(ids, f)
    elif out.endswith('.safetensors'):
        from safetensors.torch import save_file
        save_file({'token_map': torch.tensor(ids, dtype=torch.long)}, out)
    else:
        raise ValueError(f'--out={out!r}: must end in .json or .safetensors')


def main(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('files', nargs='+', help='corpus files (text, .json or .ids token ids)')
    parser.add_argument('--model', required=True, help='model directory or Hugging Face repo id')
    parser.add_argument('--top', type=int, default=32768, help='map size N (default 32768)')
    parser.add_argument('--out', required=True, help='output .json or .safetensors')
    parser.add_argument('--always-include', default='eos', metavar='IDS',
                        help="comma-separated ids kept in the map; 'eos' stands for the model's "
                             "eos ids (default: eos; 'none': nothing)")
    args = parser.parse_args(argv)
    if args.top < 1:
        parser.error(f'--top={args.top}: must be >= 1')
    if not args.out.endswith(('.json', '.safetensors')):
        parser.error(f'--out={args.out!r}: must end in .json or .safetensors')
    missing = [f for f in args.files if not os.path.isfile(f)]
    if missing:
        parser.error(f'corpus files not found: {missing}')
    config = read_model_config(args.model)
    vocab_size = config.vocab_size
    try:
        always = parse_always_include(args.always_include, config.eos_token_ids, vocab_size)
    except ValueError as e:
        parser.error(str(e))
    counts = count_tokens(args.files, args.model, vocab_size)
    ids = top_ids(counts, args.top, always)
    write_token_map(ids, args.out)
    total = int(counts.sum())
    covered = int(counts[torch.tensor(ids)].sum())
    print(f'{args.out}: {len(ids)} of {vocab_size} ids, covering {covered} of {total} corpus '
          f'tokens ({100 * covered / max(total, 1):.1f}%)')


if __name__ == '__main__':
    try:
        main()
    except ValueError as e:               # a bad corpus file: its name and the entry
        sys.exit(f'error: {e}')
