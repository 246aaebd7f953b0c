"""Greedy decisions in few launches (references in `backends/default/greedy.py`).

`argmax`: torch's reduction spends ~8-10 us on one row of 32k-248k logits (one block walks it);
here each row is cut into chunks, one program each, then one program per row takes the first
maximum of its chunks' winners: two launches of ~2 us. Values are compared as ordered int32 keys
of their float32 values (exact for 16- and 32-bit floats): -0.0 equals +0.0, a NaN is above
everything, and ties go to the first index, as in torch. float64 logits take torch's argmax.

`greedy_accept`: a greedy verify's accepted prefix and emitted tokens, one program per row (the
torch version is ten small launches).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024              # logits a program compares per iteration
TARGET_CHUNKS = 64        # chunks per row, at most (fewer where a row has fewer blocks)


@triton.jit
def _key(x):
    """float32 -> int32, ordered as the floats (-0.0 as +0.0; NaN above +inf)."""
    bits = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return tl.where(x != x, 2147483647, key)


@triton.jit
def _first_max(keys, index):
    """The largest key and its smallest index."""
    best = tl.max(keys, 0)
    return best, tl.min(tl.where(keys == best, index, 2147483647), 0)


@triton.jit
def _argmax_chunk_kernel(x_ptr, key_ptr, idx_ptr, stride_row, vocab, chunk, num_chunks,
                         BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    start = part * chunk
    end = tl.minimum(start + chunk, vocab)
    offs = start + tl.arange(0, BLOCK)
    best = _key(tl.load(x_ptr + row * stride_row + offs, mask=offs < end,
                        other=float('-inf')).to(tl.float32))
    best_idx = offs                 # lanes past the end lose every tie to a lane before it
    first = start + BLOCK
    while first < end:              # (Triton's interpreter takes no computed bound in a range)
        offs = first + tl.arange(0, BLOCK)
        key = _key(tl.load(x_ptr + row * stride_row + offs, mask=offs < end,
                           other=float('-inf')).to(tl.float32))
        take = key > best           # strictly: a lane keeps its first maximum
        best = tl.where(take, key, best)
        best_idx = tl.where(take, offs, best_idx)
        first += BLOCK
    key, idx = _first_max(best, best_idx)
    tl.store(key_ptr + row * num_chunks + part, key)
    tl.store(idx_ptr + row * num_chunks + part, idx)


@triton.jit
def _argmax_rows_kernel(key_ptr, idx_ptr, out_ptr, num_chunks, BLOCK_C: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    mask = c < num_chunks
    keys = tl.load(key_ptr + row * num_chunks + c, mask=mask, other=-2147483648)
    index = tl.load(idx_ptr + row * num_chunks + c, mask=mask, other=2147483647)
    _, idx = _first_max(keys, index)
    tl.store(out_ptr + row, idx.to(tl.int64))


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [..., V] -> [...] long: each row's first maximum (a NaN counts as the maximum)."""
    if logits.dtype == torch.float64 or logits.shape[-1] == 0:
        return logits.argmax(-1)
    rows = logits.reshape(-1, logits.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    num_rows, vocab = rows.shape
    blocks = triton.cdiv(vocab, BLOCK)
    chunk = BLOCK * triton.cdiv(blocks, TARGET_CHUNKS)
    num_chunks = triton.cdiv(vocab, chunk)
    out = torch.empty(num_rows, dtype=torch.long, device=logits.device)
    if num_rows:
        keys = torch.empty(num_rows, num_chunks, dtype=torch.int32, device=logits.device)
        index = torch.empty_like(keys)
        _argmax_chunk_kernel[(num_rows, num_chunks)](rows, keys, index, rows.stride(0), vocab,
                                                     chunk, num_chunks, BLOCK=BLOCK, num_warps=4)
        _argmax_rows_kernel[(num_rows,)](keys, index, out, num_chunks,
                                         BLOCK_C=triton.next_power_of_2(num_chunks), num_warps=1)
    return out.view(logits.shape[:-1])


@triton.jit
def _greedy_accept_kernel(argmax_ptr, drafts_ptr, num_drafts_ptr, out_ptr, accepted_ptr,
                          K: tl.constexpr, HAS_NUM_DRAFTS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)
    target = tl.load(argmax_ptr + row * (K + 1) + i, mask=i <= K, other=-1)
    draft = tl.load(drafts_ptr + row * K + i, mask=i < K, other=-1)
    match = (draft == target) & (i < K)        # position K (the bonus) never matches
    if HAS_NUM_DRAFTS:
        match = match & (i < tl.load(num_drafts_ptr + row))
    accepted = tl.min(tl.where(match, BLOCK, i), 0)          # the first mismatch
    tl.store(out_ptr + row * (K + 1) + i, tl.where(i <= accepted, target, -1), mask=i <= K)
    tl.store(accepted_ptr + row, accepted.to(tl.int64))


def greedy_accept(target_argmax: torch.Tensor, draft_tokens: torch.Tensor,
                  num_drafts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The default op's accepted prefix in one launch (see backends/default/greedy.py)."""
    batch, k = draft_tokens.shape
    target_argmax, draft_tokens = target_argmax.contiguous(), draft_tokens.contiguous()
    num_drafts = None if num_drafts is None else num_drafts.contiguous()     # read at row
    out = torch.empty_like(target_argmax)
    num_accepted = torch.empty(batch, dtype=torch.long, device=target_argmax.device)
    if batch:
        _greedy_accept_kernel[(batch,)](
            target_argmax, draft_tokens, num_drafts if num_drafts is not None else num_accepted,
            out, num_accepted, K=k, HAS_NUM_DRAFTS=num_drafts is not None,
            BLOCK=triton.next_power_of_2(k + 1), num_warps=1)
    return out, num_accepted
