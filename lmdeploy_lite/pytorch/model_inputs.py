"""What one forward pass of the model receives: a flat token batch plus per-sequence metadata.

Shapes: T = total new tokens in the step, B = sequences in the step.

Linear-attention state (DESIGN.md invariant 5, rollback is arithmetic). Every sequence owns one
row `state_slots[b]` of the state caches; each row holds S = 1 + num_spec_tokens recurrent states
and a conv window buffer of `K - 1 + num_spec_tokens` raw (pre-conv) columns, K the conv kernel.
`state_index[b]` says which one is current:
  * the current recurrent state is `recurrent[state_slots[b], state_index[b]]`;
  * the current conv window (last K-1 raw inputs) is
    `conv[state_slots[b], :, state_index[b] : state_index[b] + K - 1]`;
  * a sequence with `history_lens[b] == 0` starts from zero state (the index is ignored).
A step with n new tokens for a sequence writes:
  * prefill (`is_decoding=False`): the final recurrent state to slot 0 and the last K-1 raw
    inputs (left-zero-padded if fewer) to conv columns 0..K-2; next index = 0;
  * decode/verify (`is_decoding=True`, n <= S): the state after token t to slot t (t = 0..n-1) and
    conv columns 0..K-2+n-1 = `cat(current window, x_0..x_{n-1})[1:]`; after the caller accepts
    a of the n tokens (1 <= a <= n), the next index = a - 1.
Reads happen before writes, so reading slot j while writing slot 0 is safe.

Derived values marked "computed once" are cached on first use (ops call them in every layer);
`q_lens` and `history_lens` must not change after that (`state_index` may be reassigned)."""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from functools import cached_property
from typing import Any, Callable

import torch


@dataclass(frozen=True)
class ForwardSizes:
    """The sizes of one forward that the other ranks must agree on (DESIGN.md invariant 1), all
    from the step's StepPlan (`StepPlan.forward_sizes`), never derived here; token counts are
    multiples of the target's tp (so of any tp that divides it, e.g. the draft's).
    tokens:      this rank's tokens rounded up to a multiple of tp: the rows an EP MoE pads to
                 (each TP rank dispatches tokens / tp) and sequence parallelism splits;
    max_tokens:  the largest `tokens` of any rank in this forward (an idle rank's dummy
                 included): the EP dispatch capacity is max_tokens / tp tokens per rank;
    seqs, max_seqs: the same two for a forward of one token per sequence (the MTP draft steps
                 after the first: `one_token_per_seq()`);
    low_latency: DeepEP's mode for the step: low-latency (fixed capacity, CUDA graphs) when
                 every rank with work decodes, else normal.
    sequence_parallel: this forward splits its rows over the TP ranks: prefill and mixed steps,
                 not decode steps (nn/sequence_parallel.py says why)."""
    tokens: int
    max_tokens: int
    seqs: int
    max_seqs: int
    low_latency: bool = False
    sequence_parallel: bool = False

    @classmethod
    def captured(cls, num_tokens: int, num_seqs: int, tp: int = 1) -> 'ForwardSizes':
        """A CUDA-graph bucket's forward (every rank replays the same bucket): counts rounded up
        to a multiple of tp as the plan rounds them; DeepEP low-latency, on its start-up capacity
        (checked per step: `EPTransport.prepare`); no sequence parallelism (a decode step)."""
        tokens, seqs = -(-num_tokens // tp) * tp, -(-num_seqs // tp) * tp
        return cls(tokens, tokens, seqs, seqs, low_latency=True)

    def one_token_per_seq(self) -> 'ForwardSizes':
        return replace(self, tokens=self.seqs, max_tokens=self.max_seqs)


@dataclass
class ModelInputs:
    input_ids: torch.Tensor        # [T] long
    positions: torch.Tensor        # [T] long, absolute position of each token in its sequence
    q_lens: torch.Tensor           # [B] long, new tokens per sequence (sum = T)
    history_lens: torch.Tensor     # [B] long, tokens already in the KV cache before this step
    block_tables: torch.Tensor     # [B, max_blocks] long, padded with 0
    state_slots: torch.Tensor      # [B] long, row in the linear-attention state caches
    state_index: torch.Tensor      # [B] long, current slot inside the row (see module doc)
    is_decoding: bool              # every sequence in the step is a decode/verify step
    # host: state_index is 0 in every row (the agent checks where that costs no device sync,
    # on the CPU); ops then read slot 0 directly instead of gathering at state_index
    state_index_zero: bool = False
    is_dummy: bool = False         # a rank with no work runs this to keep collectives aligned
    uniform_q_len: int | None = None   # host int: every sequence has exactly this many new tokens
                                       # (decode/verify/draft steps); lets ops avoid host syncs
    padded_batch_size: int = 0     # from the StepPlan: a CUDA-graph decode step pads its batch to
                                   # at least this (the largest batch of any rank in the step)
    graphable: bool = True         # False: run eagerly even where a CUDA graph fits (EP steps
                                   # in DeepEP's normal mode: graphs hold its low-latency kernels)
    # the host's copies of (q_lens, history_lens + q_lens), where whoever built the step knew
    # them (no device sync to read them back); None: read from the device when an op asks
    host_lens: tuple[list[int], list[int]] | None = None
    sync_free: bool = False        # a captured prefill or mixed step (graph_runner.py): ops keep
                                   # the decode-step contract although lengths are not uniform
    # a captured step of more tokens than the recurrent gated-delta kernel takes per sequence:
    # [1] long, the one sequence whose chunk takes the chunk kernel over the whole step's width
    # (a spare dummy sequence when no chunk is that long); None: every chunk is short
    long_row: torch.Tensor | None = None
    sizes: ForwardSizes | None = None   # the StepPlan's: EP and sequence-parallel forwards need it
    # speculative decoding (strategies/ar_spec) only:
    draft_tokens: torch.Tensor | None = None    # [B, k] long, host (ngram) drafts; None: on device
    next_token_ids: torch.Tensor | None = None  # [B] long, prefill: the token after each chunk if
                                                # the host knows it (a later prompt chunk), else -1
    num_spec: int = 0              # the StepPlan's draft count: drafts a decode step verifies
                                   # per row (uniform_q_len - 1) and every step makes
    # prefix cache (engine/prefix_cache.py), prefill steps only: [R, 2] long (snapshot row, state
    # slot) copied into the slot before the forward (the slot's current index becomes 0), and
    # [S, 2] long (state slot, snapshot row) copied out after it
    state_restores: torch.Tensor | None = None
    state_saves: torch.Tensor | None = None
    # forking (n choices, engine/forking.py), prefill steps only, applied before the forward
    # after the restores: [C, 2] long (block, its copy) in every full-attention layer of the
    # target and the draft; [S, 2] long (state slot, its copy) of the linear-attention state
    block_copies: torch.Tensor | None = None
    state_copies: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return int(self.q_lens.numel())

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def q_start_loc(self) -> torch.Tensor:
        """[B] long, offset of each sequence's first token in the flat batch."""
        return torch.cumsum(self.q_lens, 0) - self.q_lens

    @cached_property
    def _host_lens(self) -> tuple[list[int], list[int]]:
        if self.host_lens is not None:
            return self.host_lens
        q_lens, history_lens = torch.stack([self.q_lens, self.history_lens]).tolist()
        return q_lens, [h + n for h, n in zip(history_lens, q_lens)]

    @property
    def host_q_lens(self) -> list[int]:
        """`q_lens` (and `host_kv_lens`) on the host: one device sync per forward, not per layer."""
        return self._host_lens[0]

    host_kv_lens = property(lambda self: self._host_lens[1])

    @cached_property
    def max_q_len(self) -> int:
        return max(self.host_q_lens, default=0)

    @cached_property
    def max_kv_len(self) -> int:
        return max(self.host_kv_lens, default=0)

    @cached_property
    def token_seq_idx(self) -> torch.Tensor:
        """[T] long, the sequence of each token (computed once; no host sync when uniform)."""
        if self.uniform_q_len is not None:
            return torch.arange(self.num_tokens, device=self.q_lens.device) // self.uniform_q_len
        batch = torch.arange(self.batch_size, device=self.q_lens.device)
        return torch.repeat_interleave(batch, self.q_lens, output_size=self.num_tokens)

    @cached_property
    def token_offsets(self) -> torch.Tensor:
        """[T] long, index of each token among its sequence's new tokens (computed once)."""
        if self.uniform_q_len is not None:
            return torch.arange(self.num_tokens, device=self.q_lens.device) % self.uniform_q_len
        flat = torch.arange(self.token_seq_idx.numel(), device=self.q_lens.device)
        return flat - self.q_start_loc[self.token_seq_idx]

    @cached_property
    def has_fresh_seqs(self) -> bool:
        """Some sequence starts from zero state (`history_lens == 0`); from the host lengths
        (computed once): decode ops skip the zero-state masking when False."""
        return any(kv == q for q, kv in zip(self.host_q_lens, self.host_kv_lens))

    @cached_property
    def op_cache(self) -> dict:
        """Values ops derive once per forward, by key (`derived`)."""
        return {}

    def derived(self, key, make: Callable[[], Any], from_state_index: bool = False) -> Any:
        """`make()` computed by the first layer of a forward that asks for `key` and reused by the
        others: index tensors an op derives from this step's lengths, positions and block tables
        (e.g. the KV cache slots of the new tokens). `from_state_index`: the value depends on
        `state_index` too; it is made again once `state_index` has been reassigned (the agents
        set it before each forward)."""
        tag = self.state_index if from_state_index else None
        hit = self.op_cache.get(key)
        if hit is None or hit[0] is not tag:
            hit = self.op_cache[key] = (tag, make())
        return hit[1]

    def to(self, device: torch.device | str) -> 'ModelInputs':
        return replace(self, **{f.name: getattr(self, f.name).to(device) for f in fields(self)
                                if isinstance(getattr(self, f.name), torch.Tensor)})
