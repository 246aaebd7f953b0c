"""How a paradigm (plain AR, AR + speculation) makes model inputs, what an idle rank feeds,
what is shared after sampling, and what a result row adds to its sequence (counters: `stats`)."""
from __future__ import annotations

import itertools

import torch

from lmdeploy_lite.messages import SpecDecodeStats
from lmdeploy_lite.pytorch.model_inputs import ModelInputs
from lmdeploy_lite.pytorch.sampling import to_device


def dummy_table_width(num_tokens_per_seq: int) -> int:
    """Block-table width of an idle rank's dummy inputs (any draft positions past the step)."""
    return 2 * num_tokens_per_seq + 16


def pack_model_inputs(token_chunks: list[list[int]], history_lens: list[int],
                      block_tables: list[list[int]], state_slots: list[int],
                      is_decoding: bool, device) -> ModelInputs:
    """Per-sequence token chunks as ModelInputs, in one host-to-device copy (split there); the
    positions are made there too (an 8k prompt's list cost ~1 ms of host time). Each part
    starts 16 bytes in (an even count of longs before it): Triton compiles a kernel for each
    alignment of its pointers, and a captured step's buffers are aligned, so an eager step with
    odd part sizes compiled variants of its own while serving (~1-2 s each, measured)."""
    q_lens = [len(c) for c in token_chunks]
    batch = len(q_lens)
    width = max((len(b) for b in block_tables), default=0) or 1
    tables = itertools.chain.from_iterable(b + [0] * (width - len(b)) for b in block_tables)
    parts = [list(itertools.chain.from_iterable(token_chunks)), q_lens, list(history_lens),
             list(state_slots), [0] * batch, list(tables)]                # .., state_index
    sizes = [len(p) for p in parts]
    flat = []
    for part in parts:
        flat += part
        if len(part) & 1:
            flat.append(0)
    buffer = to_device(torch.tensor(flat, dtype=torch.long), device)
    input_ids, q, hist, slots, index, table = (
        part[:n] for part, n in zip(buffer.split([n + (n & 1) for n in sizes]), sizes))
    num_tokens = sizes[0]
    # token i of sequence b sits at history_lens[b] + (i - its first index)
    first = torch.cumsum(q, 0) - q
    positions = torch.arange(num_tokens, device=buffer.device) + torch.repeat_interleave(
        hist - first, q, output_size=num_tokens)
    uniform = q_lens[0] if is_decoding and q_lens and len(set(q_lens)) == 1 else None
    return ModelInputs(input_ids=input_ids, positions=positions, q_lens=q, history_lens=hist,
                       block_tables=table.view(batch, width), state_slots=slots,
                       state_index=index, is_decoding=is_decoding, uniform_q_len=uniform,
                       host_lens=(q_lens, [h + n for h, n in zip(history_lens, q_lens)]))


class Strategy:
    """Plain AR by default: each step feeds every sequence's uncomputed tokens."""

    def __init__(self):
        self.stats = SpecDecodeStats()     # speculative counters of every verify step (none: AR)

    def make_model_inputs(self, batch, device) -> ModelInputs:
        seqs = batch.seqs
        chunks = [s.token_ids[s.num_computed:s.num_computed + n]
                  for s, n in zip(seqs, batch.q_lens)]
        return pack_model_inputs(chunks, [s.num_computed for s in seqs], [s.blocks for s in seqs],
                                 [s.state_slot for s in seqs], batch.is_decoding, device)

    def batch_inputs(self, batch, device) -> ModelInputs:
        """`make_model_inputs` with the batch's cache copies on the device."""
        return self._with_copies(self.make_model_inputs(batch, device), batch, device)

    @staticmethod
    def _with_copies(inputs: ModelInputs, batch, device) -> ModelInputs:
        for field, pairs in (('state_restores', batch.restores), ('state_saves', batch.saves),
                             ('block_copies', batch.block_copies),
                             ('state_copies', batch.state_copies)):
            if pairs:
                setattr(inputs, field, to_device(torch.tensor(pairs), device))
        return inputs

    def make_next_decode_inputs(self, batch, prev: ModelInputs, prev_result, device) -> ModelInputs:
        """Async scheduling: `prev`'s decode batch one step on, built while it may still run:
        lengths advance on the device; block tables from the host (reserved ahead). After a
        mixed step, `make_next_mixed_inputs` (rows that decode, no chunk)."""
        if not prev.is_decoding:
            return self.make_next_mixed_inputs(batch, prev_result, device)
        history = prev.history_lens + self.emitted_per_row(prev_result)
        n = batch.q_lens[0]                  # the plan's width (speculation: k may change)
        positions = (history[:, None] + torch.arange(n, device=history.device)).flatten()
        width = max(len(s.blocks) for s in batch.seqs)
        table = to_device(torch.tensor([s.blocks + [0] * (width - len(s.blocks))
                                        for s in batch.seqs], dtype=torch.long), device)
        q_lens = prev.q_lens if n == prev.uniform_q_len else torch.full_like(prev.q_lens, n)
        return ModelInputs(input_ids=self.next_input_ids(prev_result, n), positions=positions,
                           q_lens=q_lens, history_lens=history, block_tables=table,
                           state_slots=prev.state_slots, is_decoding=True, uniform_q_len=n,
                           state_index=torch.zeros_like(prev.state_slots))

    def make_next_mixed_inputs(self, batch, prev_result, device) -> ModelInputs:
        """Async scheduling: a step after one still running (Scheduler.continuation): its first
        rows decode the tokens that step's rows `batch.prev_rows` sample, read on the device,
        one position past what the host knows (a row whose prompt that step ended: at the
        prompt's end); its chunks come from the host."""
        seqs, decode = batch.seqs, len(batch.prev_rows)
        chunks = [[0] if i < decode else s.token_ids[s.num_computed:s.num_computed + n]
                  for i, (s, n) in enumerate(zip(seqs, batch.q_lens))]
        inputs = pack_model_inputs(chunks, [s.num_computed + (i < decode and s.prefilled)
                                            for i, s in enumerate(seqs)],
                                   [s.blocks for s in seqs], [s.state_slot for s in seqs],
                                   batch.is_decoding, device)
        rows = to_device(torch.tensor(batch.prev_rows), device)
        inputs.input_ids[:decode] = self.next_input_ids(prev_result, 1)[rows]
        return self._with_copies(inputs, batch, device)

    def emitted_per_row(self, result) -> torch.Tensor:
        """[B] long on the device: tokens each row added to its sequence in `result`'s step."""
        return torch.ones_like(result.output_tokens[:, 0])

    def next_input_ids(self, result, q_len: int) -> torch.Tensor:
        """[B * q_len] long on the device: the next decode step's token ids (or placeholders)."""
        return result.output_tokens[:, 0]            # the token each row just sampled

    def make_dummy_inputs(self, num_tokens_per_seq: int, is_decoding: bool, device,
                          num_spec: int = 0) -> ModelInputs:
        """An idle rank's padding sequence (writing only reserved block 0 and state slot 0)."""
        width = dummy_table_width(num_tokens_per_seq)
        inputs = pack_model_inputs([[0] * num_tokens_per_seq], [0], [[0] * width], [0],
                                   is_decoding=is_decoding, device=device)
        inputs.is_dummy = True
        return inputs

    def post_broadcast(self, result, agent, inputs: ModelInputs, plan, dist_ctx):
        """TP rank 0's sampled tokens become every TP peer's (they agree even when sampling)."""
        if dist_ctx.config.tp > 1:
            dist_ctx.tp.broadcast(result.output_tokens)
        return result

    def emitted(self, seq, q_len: int, samples: bool, row: list[int],
                num_accepted: int | None, num_drafts: int | None = None
                ) -> tuple[int, list[int]]:
        """On the host: (tokens now in `seq`'s cache, tokens it emits) from its output `row`;
        `samples`: False for a non-final prefill chunk; `num_accepted` (None: no verify) of
        `num_drafts` real drafts."""
        return q_len, row[:1] if samples else []
