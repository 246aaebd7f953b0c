"""Paged causal attention (GQA) over a block-table KV cache.

Caches are `[num_blocks, block_size, num_kv_heads, head_dim]`. The token at cache position p of
sequence b lives in slot `block_tables[b, p // block_size] * block_size + p % block_size`; this
step's tokens take cache positions `history_lens[b] .. history_lens[b] + q_lens[b] - 1`.
"""
from __future__ import annotations

import torch

from ...model_inputs import ModelInputs


def kv_slot_mapping(inputs: ModelInputs, block_size: int) -> torch.Tensor:
    """[T] long: flat cache slot of every new token."""
    device = inputs.q_lens.device
    seq_idx = torch.repeat_interleave(torch.arange(inputs.batch_size, device=device), inputs.q_lens)
    offsets = torch.arange(seq_idx.numel(), device=device) - inputs.q_start_loc[seq_idx]
    cache_pos = inputs.history_lens[seq_idx] + offsets
    blocks = inputs.block_tables[seq_idx, cache_pos // block_size]
    return blocks * block_size + cache_pos % block_size


def fill_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  inputs: ModelInputs) -> None:
    """Write k, v `[T, n_kv, head_dim]` into the caches at the step's slots."""
    num_blocks, block_size, n_kv, head_dim = k_cache.shape
    slots = kv_slot_mapping(inputs, block_size)
    k_cache.view(-1, n_kv, head_dim)[slots] = k.to(k_cache.dtype)
    v_cache.view(-1, n_kv, head_dim)[slots] = v.to(v_cache.dtype)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, inputs: ModelInputs, scale: float) -> torch.Tensor:
    """Store the step's k/v, then attend each sequence's new queries over its whole cached prefix.

    q [T, nq, d], k/v [T, n_kv, d] -> [T, nq, d]. Query i of sequence b (cache position
    `history_lens[b] + i`) sees cache positions 0..history_lens[b] + i. Softmax in fp32 (fp64 for
    float64 inputs)."""
    fill_kv_cache(k, v, k_cache, v_cache, inputs)
    block_size, n_kv, head_dim = k_cache.shape[1:]
    num_heads = q.shape[1]
    group = num_heads // n_kv
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = torch.empty_like(q)
    q_lens, history_lens = inputs.q_lens.tolist(), inputs.history_lens.tolist()
    start = 0
    for b, (q_len, hist) in enumerate(zip(q_lens, history_lens)):
        if q_len == 0:
            continue
        kv_len = hist + q_len
        blocks = inputs.block_tables[b, :(kv_len + block_size - 1) // block_size]
        keys = k_cache[blocks].reshape(-1, n_kv, head_dim)[:kv_len].to(acc)
        values = v_cache[blocks].reshape(-1, n_kv, head_dim)[:kv_len].to(acc)
        qb = q[start:start + q_len].to(acc).view(q_len, n_kv, group, head_dim)
        scores = torch.einsum('qhgd,khd->hgqk', qb, keys) * scale
        q_pos = torch.arange(hist, kv_len, device=q.device)[:, None]
        k_pos = torch.arange(kv_len, device=q.device)[None, :]
        scores = scores.masked_fill(k_pos > q_pos, float('-inf'))
        probs = scores.softmax(dim=-1)
        ob = torch.einsum('hgqk,khd->qhgd', probs, values)
        out[start:start + q_len] = ob.reshape(q_len, num_heads, head_dim).to(q.dtype)
        start += q_len
    return out
