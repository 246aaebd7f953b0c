"""The strategy interface: how a paradigm (plain AR, AR + speculation) turns a scheduled batch
into model inputs, what a rank with no work feeds, what is shared after sampling, and what a
step's result row adds to its sequence on the host (with its counters: `stats`)."""
from __future__ import annotations

import torch

from lmdeploy_lite.messages import SpecDecodeStats
from lmdeploy_lite.pytorch.model_inputs import ModelInputs


def to_device(tensor: torch.Tensor, device) -> torch.Tensor:
    """A fresh host tensor to `device`; to a GPU through pinned memory without blocking the host
    (the caching host allocator keeps the pinned block until the copy has run)."""
    if torch.device(device).type != 'cuda':
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def dummy_table_width(num_tokens_per_seq: int) -> int:
    """Block-table width of an idle rank's dummy inputs: covers any draft positions past the
    step (all entries are the reserved block 0)."""
    return 2 * num_tokens_per_seq + 16


def pack_model_inputs(token_chunks: list[list[int]], history_lens: list[int],
                      block_tables: list[list[int]], state_slots: list[int],
                      is_decoding: bool, device) -> ModelInputs:
    """Flatten per-sequence token chunks (each continuing at its history length) into ModelInputs.
    All fields travel to the device in one copy (one int64 buffer, split there)."""
    q_lens = [len(c) for c in token_chunks]
    batch = len(q_lens)
    width = max((len(b) for b in block_tables), default=0) or 1
    flat = [t for c in token_chunks for t in c]
    flat += [h + i for h, n in zip(history_lens, q_lens) for i in range(n)]      # positions
    flat += q_lens + list(history_lens) + list(state_slots) + [0] * batch       # .., state_index
    for b in block_tables:
        flat += b + [0] * (width - len(b))
    buffer = to_device(torch.tensor(flat, dtype=torch.long), device)
    num_tokens = sum(q_lens)
    input_ids, positions, q, hist, slots, index, table = buffer.split(
        [num_tokens, num_tokens, batch, batch, batch, batch, batch * width])
    return ModelInputs(
        input_ids=input_ids, positions=positions, q_lens=q, history_lens=hist,
        block_tables=table.view(batch, width), state_slots=slots, state_index=index,
        is_decoding=is_decoding,
        uniform_q_len=q_lens[0] if is_decoding and q_lens and len(set(q_lens)) == 1 else None)


class Strategy:
    def __init__(self):
        self.stats = SpecDecodeStats()     # speculative counters of every verify step (none: AR)

    def make_model_inputs(self, batch, device) -> ModelInputs:
        raise NotImplementedError

    def batch_inputs(self, batch, device) -> ModelInputs:
        """`make_model_inputs`, with the cache copies the scheduler asked for on the device:
        state restores and saves (prefix cache), block and state copies (forking)."""
        inputs = self.make_model_inputs(batch, device)
        for field, pairs in (('state_restores', batch.restores), ('state_saves', batch.saves),
                             ('block_copies', batch.block_copies),
                             ('state_copies', batch.state_copies)):
            if pairs:
                setattr(inputs, field, to_device(torch.tensor(pairs), device))
        return inputs

    def make_next_decode_inputs(self, batch, prev: ModelInputs, prev_result, device
                                ) -> ModelInputs:
        """Async scheduling: the decode batch `prev` ran, one step on, built while that step may
        still run. Lengths advance on the device by what it emitted, so the host does not need
        to know; block tables come from the host (reserved ahead by the scheduler)."""
        history = prev.history_lens + self.emitted_per_row(prev_result)
        n = batch.q_lens[0]                  # the plan's width (speculation: k may change)
        positions = (history[:, None] + torch.arange(n, device=history.device)).flatten()
        width = max(len(s.blocks) for s in batch.seqs)
        table = to_device(torch.tensor([s.blocks + [0] * (width - len(s.blocks))
                                        for s in batch.seqs], dtype=torch.long), device)
        return ModelInputs(input_ids=self.next_input_ids(prev_result, n), positions=positions,
                           q_lens=(prev.q_lens if n == prev.uniform_q_len
                                   else torch.full_like(prev.q_lens, n)),
                           history_lens=history, block_tables=table,
                           state_slots=prev.state_slots,
                           state_index=torch.zeros_like(prev.state_slots), is_decoding=True,
                           uniform_q_len=n)

    def emitted_per_row(self, result) -> torch.Tensor:
        """[B] long on the device: tokens each row added to its sequence in `result`'s step."""
        raise NotImplementedError

    def next_input_ids(self, result, q_len: int) -> torch.Tensor:
        """[B * q_len] long on the device: the next decode step's token ids (or placeholders)."""
        raise NotImplementedError

    def make_dummy_inputs(self, num_tokens_per_seq: int, is_decoding: bool, device,
                          num_spec: int = 0) -> ModelInputs:
        """One sequence of `num_tokens_per_seq` padding tokens for a rank with no work, so that
        its collectives match the busy ranks' (sizes from the StepPlan). Every block-table entry
        is the reserved block 0 and the state row is the reserved slot 0: its cache writes
        land where no real sequence reads."""
        width = dummy_table_width(num_tokens_per_seq)
        inputs = pack_model_inputs([[0] * num_tokens_per_seq], [0], [[0] * width], [0],
                                   is_decoding=is_decoding, device=device)
        inputs.is_dummy = True
        return inputs

    def post_broadcast(self, result, agent, inputs: ModelInputs, plan, dist_ctx):
        """Make TP rank 0's sampled tokens every TP peer's, so that all TP ranks agree exactly
        even when sampling; a no-op without TP. `plan`: the step's StepPlan."""
        if dist_ctx.config.tp > 1:
            dist_ctx.tp.broadcast(result.output_tokens)
        return result

    def emitted(self, seq, q_len: int, samples: bool, row: list[int],
                num_accepted: int | None, num_drafts: int | None = None
                ) -> tuple[int, list[int]]:
        """On the host, one sequence's share of a step's result: (tokens now in its cache, the
        tokens it emits). `row`: its output tokens; `samples`: the step sampled for it (a
        non-final prefill chunk does not); `num_accepted`: its accepted drafts (None: no
        verify) out of `num_drafts` real drafts."""
        return q_len, row[:1] if samples else []
