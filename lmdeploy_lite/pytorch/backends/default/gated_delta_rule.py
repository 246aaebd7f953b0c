"""Gated delta rule (Qwen3.5 linear attention) with fp32 state (fp64 for float64 models).

Per value head, with q, k L2-normalised and q scaled by dk^-0.5, for each token t:
    S <- S * exp(g_t);  delta = (v_t - S^T k_t) * beta_t;  S <- S + k_t delta^T;  o_t = S^T q_t
S is `[dk, dv]`. Value head j uses key head `j // (nv / nk)`.

State cache: `state_cache [num_state_slots, 1 + num_spec, nv, dk, dv]`, slots as in model_inputs.py.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...model_inputs import ModelInputs
from .norm import cast, compute_dtype, constant
from .varlen import seq_groups


# the chunked form's chunk (`chunk_size`): 32 tokens, or 16 where that pads a group's longest
# row less. Against 64, on the 2-core CPU with one and two threads, 32 was as fast or faster in
# all but one of 28 cells of 1-32 sequences of 20-2,048 tokens (the embedded model's and the
# 0.8B's head shapes; up to 2.9x where short rows were padded to 64), 16 up to 1.7x faster again
# where it pads less and up to 1.25x slower for one long row; 32 prompts of ~27 tokens prefill
# in ~330 ms, not ~480 (BENCHMARKS.md)
CHUNK_SIZE = 32


def chunk_size(max_q_len: int) -> int:
    return 16 if -max_q_len % CHUNK_SIZE >= 16 else CHUNK_SIZE


def gdn_gating(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """a, b [T, nv] (in_proj_a/b outputs) -> g = -exp(A_log) * softplus(a + dt_bias) (log decay,
    float32; float64 for float64 inputs) and beta = sigmoid(b) (b.dtype), both [T, nv]."""
    acc = compute_dtype(a.dtype)
    return -cast(A_log, acc).exp() * F.softplus(cast(a, acc) + dt_bias), torch.sigmoid(b)


def _prepare(q, k, v, g, beta, acc):
    """-> q, k [T, nv, dk] (normalised, expanded to value heads), v [T, nv, dv], g/beta [T, nv]."""
    ratio = v.shape[1] // q.shape[1]
    q, k, v, g, beta = (x.to(acc) for x in (q, k, v, g, beta))
    q, k = (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
    q = q * q.shape[-1] ** -0.5
    if ratio > 1:
        q, k = q.repeat_interleave(ratio, dim=1), k.repeat_interleave(ratio, dim=1)
    return q, k, v, g, beta


def recurrent_gated_delta_rule(q, k, v, g, beta, state, state_dtype: torch.dtype | None = None):
    """Token-by-token form, batched. q, k [B, n, h, dk]; v [B, n, h, dv]; g, beta [B, n, h];
    state [B, h, dk, dv] (prepared inputs). Returns o [B, n, h, dv] and states after every token
    [B, n, h, dk, dv]. `state_dtype`: the cache's dtype; each token starts from the state rounded
    to it, as if stored and read back, so n tokens in one call equal n one-token calls."""
    outs, states = [], []
    for t in range(q.shape[1]):
        if state_dtype is not None:
            state = state.to(state_dtype).to(q.dtype)
        state = state * g[:, t].exp()[..., None, None]
        kv_mem = (state * k[:, t, :, :, None]).sum(-2)                  # [B, h, dv]
        delta = (v[:, t] - kv_mem) * beta[:, t, :, None]
        state = state + k[:, t, :, :, None] * delta[:, :, None, :]
        outs.append((state * q[:, t, :, :, None]).sum(-2))
        states.append(state)
    return torch.stack(outs, 1), torch.stack(states, 1)


def chunk_gated_delta_rule(q, k, v, g, beta, state, chunk_size: int = CHUNK_SIZE):
    """Chunked (WY / UT-transform) form, batched. q, k [B, n, h, dk]; v [B, n, h, dv];
    g, beta [B, n, h]; state [B, h, dk, dv] (prepared inputs). Returns o [B, n, h, dv] and the
    final states [B, h, dk, dv]. Tokens with g = beta = 0 and k = 0 (padding) leave the state
    unchanged, so sequences of different lengths can share one call, zero-padded at the end."""
    n, pad = q.shape[1], -q.shape[1] % chunk_size
    q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)).transpose(1, 2) for x in (q, k, v))  # [B, h, N, d]
    g, beta = (F.pad(x, (0, 0, 0, pad)).transpose(1, 2) for x in (g, beta))       # [B, h, N]
    bsz, h = q.shape[:2]
    q, k, v = (x.reshape(bsz, h, -1, chunk_size, x.shape[-1]) for x in (q, k, v))  # [B, h, c, C, d]
    g, beta = (x.reshape(bsz, h, -1, chunk_size) for x in (g, beta))
    cum = g.cumsum(-1)                                                             # [B, h, c, C]
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float('-inf')).exp()
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    # (I + strictly_lower(beta_i k_i.k_j decay_ij)) u = v_beta ; same system for w
    system = (k_beta @ k.transpose(-1, -2)) * decay
    u, w = (torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
            for rhs in (v_beta, k_beta * cum.exp()[..., None]))
    intra = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * cum.exp()[..., None]
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]
    out = torch.empty_like(v)
    for c in range(q.shape[2]):
        v_new = u[:, :, c] - w[:, :, c] @ state
        out[:, :, c] = q_decayed[:, :, c] @ state + intra[:, :, c] @ v_new
        state = (state * cum[:, :, c, -1].exp()[..., None, None]
                 + k_to_end[:, :, c].transpose(-1, -2) @ v_new)
    out = out.reshape(bsz, h, -1, out.shape[-1])[:, :, :n].transpose(1, 2)
    return out, state


def initial_states(state_cache: torch.Tensor, inputs: ModelInputs) -> torch.Tensor:
    """[B, nv, dk, dv] current states (a copy), zero for fresh sequences."""
    states = state_cache[inputs.state_slots, inputs.state_index]
    return states.masked_fill((inputs.history_lens == 0)[:, None, None, None], 0)


def store_states(state_cache: torch.Tensor, rows: torch.Tensor, slots: slice,
                 states: torch.Tensor, write: torch.Tensor) -> None:
    """state_cache[rows[b], slots][t] = states[b, t] where write[b, t] (else unchanged)."""
    state_cache[rows, slots] = torch.where(write[..., None, None, None],
                                           states.to(state_cache.dtype), state_cache[rows, slots])


def gated_delta_rule_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                             beta: torch.Tensor, state_cache: torch.Tensor,
                             inputs: ModelInputs) -> torch.Tensor:
    """q, k [T, nk, dk]; v [T, nv, dv]; g (log decay), beta [T, nv] -> o [T, nv, dv] in v.dtype.
    Writes each sequence's final state to slot 0 of its row. Sequences are zero-padded to the
    longest of their group (padding leaves the state unchanged, see `chunk_gated_delta_rule`)."""
    acc = torch.float64 if torch.float64 in (state_cache.dtype, v.dtype) else torch.float32
    init = initial_states(state_cache, inputs).to(acc)
    q, k, vp, g, beta = _prepare(q, k, v, g, beta, acc)
    out = torch.empty(vp.shape, dtype=v.dtype, device=v.device)
    heads, width = vp.shape[1], max(q.shape[-1], vp.shape[-1], 64)
    for group in seq_groups(inputs, lambda n, max_q, _: (          # q/k/v and decay per chunk
            n * heads * (max_q + CHUNK_SIZE - 1 if max_q > 1 else 1) * width)):
        if group.max_q_len == 0:
            continue
        padded = [group.pad(x[group.tokens]) for x in (q, k, vp, g, beta)]
        if group.max_q_len == 1:     # 1-token rows (a mixed step's decode rows): one recurrent
            o, states = recurrent_gated_delta_rule(*padded, init[group.seqs])     # step, no chunk
            final = states[:, -1]
        else:
            o, final = chunk_gated_delta_rule(*padded, init[group.seqs],
                                              chunk_size(group.max_q_len))
        out[group.tokens] = group.unpad(o).to(v.dtype)
        store_states(state_cache, inputs.state_slots[group.seqs], slice(0, 1), final[:, None],
                     (group.q_lens > 0)[:, None])
    return out


def gated_delta_rule_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                            beta: torch.Tensor, state_cache: torch.Tensor,
                            inputs: ModelInputs) -> torch.Tensor:
    """Decode/verify, n = q_lens[b] <= 1 + num_spec tokens per sequence; shapes as in prefill.
    Writes the state after token t to slot t of the sequence's row (t < n). Different lengths
    are zero-padded to the longest (padding leaves the state unchanged and is not stored)."""
    acc = torch.float64 if torch.float64 in (state_cache.dtype, v.dtype) else torch.float32
    if inputs.uniform_q_len:
        return _decode_uniform(q, k, v, g, beta, state_cache, inputs, acc)
    init = initial_states(state_cache, inputs)
    q, k, vp, g, beta = _prepare(q, k, v, g, beta, acc)
    (group,) = seq_groups(inputs, lambda *_: 0)      # one group: padding is at most num_spec
    if group.max_q_len == 0:
        return torch.empty(vp.shape, dtype=v.dtype, device=v.device)
    o, states = recurrent_gated_delta_rule(*(group.pad(x) for x in (q, k, vp, g, beta)), init,
                                           state_dtype=state_cache.dtype)
    store_states(state_cache, inputs.state_slots, slice(0, group.max_q_len), states, group.valid())
    return group.unpad(o).to(v.dtype)


def _decode_uniform(q, k, v, g, beta, state_cache: torch.Tensor, inputs: ModelInputs,
                    acc: torch.dtype) -> torch.Tensor:
    """`gated_delta_rule_decode` when every sequence has n = `uniform_q_len` tokens: the
    recurrence of `recurrent_gated_delta_rule` on states read and written as whole rows of the
    flattened cache (`index_select` / `index_copy_`), value heads grouped under their key head
    (`[B, nk, nv / nk, dk, dv]`, no repeated q/k), products as small batched matmuls. Each token
    starts from the state rounded to the cache's dtype, as a one-token call reads it back."""
    num_new, num_seqs = inputs.uniform_q_len, inputs.q_lens.shape[0]
    (num_key_heads, key_dim), (num_value_heads, value_dim) = q.shape[1:], v.shape[1:]
    ratio, slots_per_row = num_value_heads // num_key_heads, state_cache.shape[1]
    out_dtype = v.dtype
    flat_cache = state_cache.view(-1, *state_cache.shape[2:])          # [rows * S, nv, dk, dv]
    if slots_per_row == 1:                                              # no speculative slots
        row_start = current = inputs.state_slots
    else:                                   # the same rows for every layer of the step
        row_start, current = inputs.derived(('gdn_rows', slots_per_row), lambda: (
            inputs.state_slots * slots_per_row,
            inputs.state_slots * slots_per_row + inputs.state_index), from_state_index=True)
    # one sequence, one slot, the state kept in the compute dtype on the host: update its row
    # in place (the row is a view; no copy in, no store); else work on a copy of the rows
    in_place = (num_new == 1 and num_seqs == 1 and slots_per_row == 1
                and state_cache.dtype == acc and state_cache.device.type == 'cpu')
    if in_place:
        state = flat_cache.narrow(0, int(current[0]), 1)
        if inputs.has_fresh_seqs:
            state.zero_()
    else:
        state = cast(flat_cache.index_select(0, current), acc)
        if inputs.has_fresh_seqs:
            state = state.masked_fill((inputs.history_lens == 0)[:, None, None, None], 0)
    state = state.view(num_seqs, num_key_heads, ratio, key_dim, value_dim)
    q, k, v, g, beta = (cast(x, acc) for x in (q, k, v, g, beta))
    eps = constant(1e-6, q)
    q = q * (torch.rsqrt((q * q).sum(-1, keepdim=True) + eps) * constant(key_dim ** -0.5, q))
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + eps)
    # per token t: [B, nk, 1, 1, dk] for q/k, [B, nk, ratio, 1, dv] for v, [B, nk, ratio, 1, 1]
    q, k = (x.view(num_seqs, num_new, num_key_heads, 1, 1, key_dim) for x in (q, k))
    v = v.view(num_seqs, num_new, num_key_heads, ratio, 1, value_dim)
    decay, beta = (x.view(num_seqs, num_new, num_key_heads, ratio, 1, 1) for x in (g.exp(), beta))
    if num_new == 1:                    # state is the row or a copy: update it in place
        state.mul_(decay[:, 0])
        delta = (v[:, 0] - k[:, 0] @ state) * beta[:, 0]
        state.addcmul_(k[:, 0].transpose(-1, -2), delta)                # S + k delta^T
        out = q[:, 0] @ state
        if not in_place:
            flat_cache.index_copy_(0, row_start, cast(state.flatten(1, 2), state_cache.dtype))
        return cast(out.reshape(num_seqs, num_value_heads, value_dim), out_dtype)
    # The per-token products `k_t @ S` and `q_t @ S` as the bmm calls `matmul` makes of them
    # (the same operands, laid out as it lays them out, so the same bits; `q_t @ S` for every
    # token in one bmm after the walk: a batched bmm computes each product alone), with the
    # per-token copies done once: q/k broadcast over the ratio value heads, `[n, B * nv, 1,
    # dk]`; the states token-major, `[n, B, nk, ratio, dk, dv]`, so each token's are one
    # contiguous block. One sequence whose cache holds the compute dtype: they are its row's
    # slots 0..n-1 themselves, written in place (no copy to store).
    batch_heads = num_seqs * num_value_heads
    expand = (num_seqs, num_new, num_key_heads, ratio, 1, key_dim)
    q_rows, k_rows = (x.expand(expand).transpose(0, 1).reshape(num_new, batch_heads, 1, key_dim)
                      for x in (q, k))
    rounded = state_cache.dtype != acc      # each token starts from the state as stored
    direct = num_seqs == 1 and not rounded and state_cache.device.type == 'cpu'
    if direct:
        states = flat_cache.narrow(0, int(row_start[0]), num_new).view((num_new,) + state.shape)
    else:
        states = torch.empty((num_new,) + state.shape, dtype=acc, device=state.device)
    for t, (k_t, v_t, decay_t, beta_t) in enumerate(zip(k.unbind(1), v.unbind(1),
                                                        decay.unbind(1), beta.unbind(1))):
        new = torch.mul(state.to(state_cache.dtype).to(acc) if rounded else state, decay_t,
                        out=states[t])
        kv_mem = torch.bmm(k_rows[t], new.view(batch_heads, key_dim, value_dim))
        delta = (v_t - kv_mem.view(v_t.shape)) * beta_t
        state = new.addcmul_(k_t.transpose(-1, -2), delta)
    outs = torch.bmm(q_rows.flatten(0, 1), states.view(-1, key_dim, value_dim))
    if not direct:
        new_slots = inputs.derived(('gdn_new_rows', slots_per_row), lambda: (
            row_start[None, :] + torch.arange(num_new, device=row_start.device)[:, None]
        ).flatten())
        states = states.view(-1, num_value_heads, key_dim, value_dim)   # token-major rows
        flat_cache.index_copy_(0, new_slots, cast(states, state_cache.dtype))
    out = outs.view(num_new, num_seqs, num_value_heads, value_dim).transpose(0, 1)
    return cast(out.reshape(num_seqs * num_new, num_value_heads, value_dim), out_dtype)
