"""A reduced draft vocabulary (`SpeculativeConfig.draft_token_map`, after FR-Spec / SGLang's
`--speculative-token-map`): the MTP draft scores and proposes only the map's M ids (a JSON list,
or a safetensors 1-D int64 `token_map`, most frequent first; tools/build_token_map.py). The
verify still scores the full vocabulary, so output is unchanged; q is zero off the map.
"""
from __future__ import annotations

import json
import os

import torch
import torch.nn.functional as F

from lmdeploy_lite.pytorch.nn.linear import column_major

FORMAT = "a JSON list of token ids, or a .safetensors file with a 1-D int64 tensor 'token_map'"


def _error(path: str, problem: str) -> ValueError:
    return ValueError(f'SpeculativeConfig.draft_token_map={path!r}: {problem}')


def load_token_map(path: str, vocab_size: int) -> torch.Tensor:
    """The map as an int64 CPU tensor [M] of distinct ids in 0..vocab_size-1, M >= 1."""
    allowed = f'token ids must be ints in 0..{vocab_size - 1}'
    if not os.path.isfile(path):
        raise _error(path, f'no such file (expected {FORMAT})')
    if path.endswith('.safetensors'):
        ids = _read_safetensors(path).tolist()
    else:
        try:
            with open(path, encoding='utf-8') as f:
                ids = json.load(f)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise _error(path, f'cannot be read as JSON ({e}); expected {FORMAT}') from None
        if not isinstance(ids, list):
            raise _error(path, f'is a JSON {type(ids).__name__}, not a list; expected {FORMAT}')
        for i, token in enumerate(ids):
            if type(token) is not int:      # bool is an int subclass, and not a token id
                raise _error(path, f'entry [{i}] = {token!r} is a {type(token).__name__}: '
                                   f'{allowed}')
    if not ids:
        raise _error(path, f'is empty: a map needs at least one token id in 0..{vocab_size - 1}')
    first_index: dict[int, int] = {}
    for i, token in enumerate(ids):
        if not 0 <= token < vocab_size:
            raise _error(path, f'entry [{i}] = {token} is outside the vocabulary: {allowed}')
        j = first_index.setdefault(token, i)
        if j != i:
            raise _error(path, f'token id {token} appears twice, at entries [{j}] and [{i}]: '
                               f'each id may appear once')
    return torch.tensor(ids, dtype=torch.long)


def _read_safetensors(path: str) -> torch.Tensor:
    from safetensors import safe_open
    try:
        with safe_open(path, 'pt') as f:
            names = list(f.keys())
            if 'token_map' not in names:
                raise _error(path, f"has no tensor 'token_map' (it has {names}); expected "
                                   f'{FORMAT}')
            tensor = f.get_tensor('token_map')
    except ValueError:
        raise
    except Exception as e:              # safetensors raises its own error types on bad files
        raise _error(path, f'cannot be read as safetensors ({e}); expected {FORMAT}') from None
    if tensor.dtype != torch.int64:
        raise _error(path, f"tensor 'token_map' is {tensor.dtype}: must be torch.int64")
    if tensor.dim() != 1:
        raise _error(path, f"tensor 'token_map' has shape {tuple(tensor.shape)}: must be 1-D")
    return tensor


def rows_per_rank(token_map: torch.Tensor, vocab_size: int, tp: int) -> int:
    """R: the most map ids any TP rank's vocab shard (ceil(V / tp) rows) holds."""
    shard = -(-vocab_size // tp)
    return int(torch.bincount(token_map // shard, minlength=tp).max())


class ReducedLMHead:
    """The shared (vocab-parallel) LM head restricted to a token map: logits [N, M] at the map's
    ids, in map order, equal to the full head's there. Built after the target's weights load (it
    reads whatever `lm_head.weight` is, tied too). TP rank r (vocab shard [r * Vp, (r + 1) * Vp))
    copies its shard's map rows in map order, padded with its row 0 to R = rows_per_rank: `weight`
    [R, H]. A forward all-gathers [tp, N, R] and reorders [N, tp * R] to map order by `order` [M]
    (entry j, at rank s's local position p, is column s * R + p; pad columns dropped)."""

    def __init__(self, lm_head, token_map: torch.Tensor, out_dtype: torch.dtype):
        self.dist_ctx, self.tp, self.out_dtype = lm_head.dist_ctx, lm_head.tp, out_dtype
        weight = lm_head.weight
        shard = weight.shape[0]                                      # Vp
        token_map = token_map.to(weight.device)
        owner = token_map // shard
        rank = self.dist_ctx.tp_rank if self.tp > 1 else 0
        rows = rows_per_rank(token_map, lm_head.vocab_size, self.tp)
        local = token_map[owner == rank] - rank * shard
        local = torch.cat([local, local.new_zeros(rows - local.numel())])
        self.weight = weight.detach()[local].clone()                 # [R, H], a copy
        if self.weight.device.type == 'cpu' and self.weight.dtype.is_floating_point:
            self.weight = column_major(self.weight)       # as the model's (column_major_weights)
        self.order = None
        if self.tp > 1:
            # position of each entry among its owner's entries: a running count per owner
            onehot = F.one_hot(owner, self.tp)
            position = (onehot.cumsum(0) * onehot).sum(-1) - 1
            self.order = owner * rows + position                     # [M]

    def __call__(self, hidden: torch.Tensor, cast: bool = True) -> torch.Tensor:
        """hidden [N, H] -> logits [N, M] in `out_dtype` (`cast=False`: in the weight's)."""
        logits = F.linear(hidden, self.weight)
        if self.tp > 1:
            parts = self.dist_ctx.tp.all_gather(logits.contiguous())   # [tp, N, R]
            logits = parts.permute(1, 0, 2).reshape(hidden.shape[0], -1)[:, self.order]
        return logits.to(self.out_dtype) if cast else logits
