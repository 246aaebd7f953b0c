"""Paged causal attention (GQA) over a block-table KV cache. Caches are `[num_blocks, block_size,
num_kv_heads, head_dim]`; the token at cache position p of sequence b lives in slot
`block_tables[b, p // block_size] * block_size + p % block_size`; this step's tokens take cache
positions `history_lens[b] .. history_lens[b] + q_lens[b] - 1`.
"""
from __future__ import annotations

import torch

from ...model_inputs import ModelInputs
from .norm import cast, compute_dtype
from .varlen import SeqGroup, seq_groups


def kv_slot_mapping(inputs: ModelInputs, block_size: int) -> torch.Tensor:
    """[T] long: flat cache slot of every new token (no host sync when `uniform_q_len`)."""
    seq_idx = inputs.token_seq_idx
    cache_pos = inputs.history_lens[seq_idx] + inputs.token_offsets
    blocks = inputs.block_tables[seq_idx, cache_pos // block_size]
    return blocks * block_size + cache_pos % block_size


def fill_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  inputs: ModelInputs) -> None:
    """Write k, v `[T, n_kv, head_dim]` into the caches at the step's slots."""
    block_size, n_kv, head_dim = k_cache.shape[1:]
    # the same for every attention layer of the step
    slots = inputs.derived(('kv_slots', block_size), lambda: kv_slot_mapping(inputs, block_size))
    k_cache.view(-1, n_kv, head_dim).index_copy_(0, slots, cast(k, k_cache.dtype))
    v_cache.view(-1, n_kv, head_dim).index_copy_(0, slots, cast(v, v_cache.dtype))


def _masks(history_lens: torch.Tensor, q_lens: torch.Tensor | int, max_q: int,
           max_kv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden [n, max_q, L]: cache positions past each query's own, stale [n, L]: past each
    sequence's kv_len; real queries give stale data probability 0, which must not meet a
    non-finite value). q_lens [n], or one int for every sequence."""
    k_pos = torch.arange(max_kv, device=history_lens.device)
    q_pos = history_lens[:, None] + torch.arange(max_q, device=history_lens.device)
    return k_pos > q_pos[:, :, None], k_pos >= (history_lens + q_lens)[:, None]


def _attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            block_tables: torch.Tensor, group: SeqGroup, scale: float) -> torch.Tensor:
    """q [t, nq, d] (the group's queries, accumulation dtype) -> [t, nq, d]."""
    block_size, n_kv, head_dim = k_cache.shape[1:]
    num_seqs, max_q, max_kv = group.num_seqs, group.max_q_len, group.max_kv_len
    blocks = block_tables[:, :(max_kv + block_size - 1) // block_size]
    keys, values = (cache[blocks].flatten(1, 2)[:, :max_kv].to(q.dtype)  # [n, L, n_kv, d]
                    for cache in (k_cache, v_cache))
    hidden, stale = _masks(group.history_lens, group.q_lens, max_q, max_kv)
    values = values.masked_fill(stale[:, :, None, None], 0)
    queries = group.pad(q).view(num_seqs, max_q, n_kv, -1, head_dim)      # [n, max_q, n_kv, g, d]
    scores = torch.einsum('bqhgd,bkhd->bhgqk', queries, keys) * scale
    probs = scores.masked_fill(hidden[:, None, None], float('-inf')).softmax(dim=-1)
    out = torch.einsum('bhgqk,bkhd->bqhgd', probs, values)
    return group.unpad(out).flatten(1, 2)


def _attend_uniform(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    inputs: ModelInputs, scale: float) -> torch.Tensor:
    """`paged_attention`'s attention when every sequence has n = `uniform_q_len` queries (decode,
    verify): q [B * n, nq, d] (accumulation dtype) -> [B * n, nq, d]; whole blocks gathered with
    `index_select`, scores `[B, n_kv, n * g, max_kv]` from batched matmuls; masks only where a
    query could see a padded or future position (not for one sequence decoding one token)."""
    num_new, num_seqs, max_kv = inputs.uniform_q_len, inputs.q_lens.shape[0], inputs.max_kv_len
    block_size, n_kv, head_dim = k_cache.shape[1:]
    blocks = inputs.derived(('kv_blocks', block_size), lambda: inputs.block_tables[
        :, :(max_kv + block_size - 1) // block_size].reshape(-1))
    keys, values = (cast(c.index_select(0, blocks).view(num_seqs, -1, n_kv, head_dim)[:, :max_kv],
                         q.dtype).transpose(1, 2) for c in (k_cache, v_cache))   # [B, n_kv, L, d]
    group = q.shape[1] // n_kv
    queries = q.view(num_seqs, num_new, n_kv, group, head_dim).permute(0, 2, 1, 3, 4)
    scores = queries.reshape(num_seqs, n_kv, num_new * group, head_dim) @ keys.transpose(-1, -2)
    scores = scores * scale
    if num_seqs > 1 or num_new > 1:
        hidden, stale = inputs.derived(('attn_masks', num_new), lambda: tuple(   # every layer's:
            m[:, None, :, None] for m in _masks(inputs.history_lens, num_new, num_new, max_kv)))
        scores = scores.view(num_seqs, n_kv, num_new, group, max_kv).masked_fill(
            hidden, float('-inf')).view(num_seqs, n_kv, num_new * group, max_kv)
        values = values.masked_fill(stale, 0)
    out = scores.softmax(dim=-1) @ values                               # [B, n_kv, n * g, d]
    out = out.view(num_seqs, n_kv, num_new, group, head_dim).permute(0, 2, 1, 3, 4)
    return out.reshape(num_seqs * num_new, n_kv * group, head_dim)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, inputs: ModelInputs, scale: float) -> torch.Tensor:
    """Store the step's k/v, then attend each sequence's new queries over its whole cached prefix.

    q [T, nq, d], k/v [T, n_kv, d] -> [T, nq, d]. Query i of sequence b (cache position
    `history_lens[b] + i`) sees cache positions 0..history_lens[b] + i. Softmax in fp32 (fp64 for
    float64 inputs). Sequences are padded to the longest query run and longest KV prefix of their
    group (scores `[n, nq, max_q, max_kv]`); padded queries are computed and dropped."""
    fill_kv_cache(k, v, k_cache, v_cache, inputs)
    acc = compute_dtype(q.dtype)
    if inputs.uniform_q_len:
        return cast(_attend_uniform(cast(q, acc), k_cache, v_cache, inputs, scale), q.dtype)
    num_heads = q.shape[1]
    out = torch.empty_like(q)
    for group in seq_groups(inputs, lambda n, max_q, max_kv: n * num_heads * max_q * max_kv):
        if group.max_q_len == 0:
            continue
        out[group.tokens] = _attend(q[group.tokens].to(acc), k_cache, v_cache,
                                    inputs.block_tables[group.seqs], group, scale).to(q.dtype)
    return out
