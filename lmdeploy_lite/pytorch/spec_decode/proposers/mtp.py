"""The Qwen3.5 MTP head as a proposer: k draft tokens per sequence, all on the device. Its own KV
(one full-attention layer, on the target's block table) is first written over every position the
target just ran (hidden h_t, token x_{t+1} at position t), then it drafts k tokens from the last
accepted position, the one layer reused at position + 1 on its own normed output (qwen3_5.md
section 3); with k = 0 it only writes that KV. With CUDA graphs a greedy step drafts in two
replays: the head over the verified positions, then the whole chain (LM head, argmax, k - 1 more
head steps) as ONE graph per k (`chain_graphs`). Sampled rows draw from per-request generators,
which a graph cannot hold: a step with any sampled row drafts step by step.

Deferred KV writes (`defer_kv`, SpecAgent on the CPU): the k = 0 writes of up to DEFERRED_STEPS
plain steps in a row run as one pass (`flush_kv`: fc and the projections once, then each step's
cache write in step order) at the start of the next step that is not a plain one. Only such a
step reads the head's KV (a verify drafts, a prefill drafts and copies forks' blocks); a block
freed meanwhile and taken by another sequence is written by it in a later step, so in a later
store. On a 2-core CPU a step's write is ~30 small ops (~1 ms, 3% of a batch-32 plain step of
the embedded model), ~5 in a flush.

The first pass at the drafting rows only (`_head_at_rows`; on the CPU from ROW_ONLY_MIN_TOKENS
tokens a step, elsewhere in steps where some rank prefills): only each sequence's last accepted
position (a prefill's last) goes on to draft, so the head writes the KV of every position, then
runs its layer (attention, MLP or MoE) at that row alone, as a one-token step there; the same
values as the whole pass at those rows. On a GPU that row pass replays the one-token graph, so
of a prefill step's head only the KV write runs eagerly (the whole pass, eager, held a 64-stream
server's decode steps ~4 ms behind each chunk step on an H200: BENCHMARKS.md).
"""
from __future__ import annotations

from functools import partial

import torch

from lmdeploy_lite.pytorch.backends import get_backend
from lmdeploy_lite.pytorch.model_inputs import ModelInputs
from lmdeploy_lite.pytorch.sampling import SamplingInputs, draw_from_probs, probs_from_logits

DEFERRED_STEPS = 16         # plain steps whose draft-KV writes one flush makes at most
# the CPU's first head pass at the drafting rows only from this many tokens a step (measured,
# BENCHMARKS.md: a 2k-token prefill -19%, a batch-32 k=3 step -3%; 4 tokens +3%, 32 and 64 even)
ROW_ONLY_MIN_TOKENS = 64


class MTPProposer:

    def __init__(self, mtp, caches, compute_logits, num_spec_tokens: int,
                 token_map: torch.Tensor | None = None):
        self.mtp, self.caches = mtp, caches
        self.compute_logits = compute_logits          # the target's LM head (or ReducedLMHead)
        self.token_map = token_map    # [M] long: logits index it (token_map.py); None: full vocab
        self.num_spec_tokens = num_spec_tokens
        self.argmax = get_backend(mtp.fc.weight.device).argmax
        # q_len -> GraphRunner: k + 1 over a verify of k drafts, 1 for a draft step;
        # `kv_graphs`: the KV-only pass of k = 0; `chain_graphs`: k -> the greedy draft chain
        self.graphs, self.kv_graphs, self.chain_graphs = {}, {}, {}
        self.deferred: list[tuple[ModelInputs, torch.Tensor, torch.Tensor]] = []
        # the CPU's head runs its layer at the drafting rows only in steps of ROW_ONLY_MIN_TOKENS
        # or more (`_head_at_rows`), other devices' in steps where some rank prefills
        # (`_rows_only`)
        self.row_only = mtp.fc.weight.device.type == 'cpu'

    def can_defer(self) -> bool:
        """Whether one more plain step's KV write may wait (fewer than DEFERRED_STEPS wait)."""
        return len(self.deferred) < DEFERRED_STEPS

    def defer_kv(self, inputs: ModelInputs, target_hidden: torch.Tensor, next_ids: torch.Tensor):
        """`propose(..., num_drafts=0)` left for `flush_kv` (the caller checked `can_defer`)."""
        self.deferred.append((inputs, next_ids, target_hidden))

    def flush_kv(self):
        """Every deferred KV write, in order, as one pass of the head's fc and projections."""
        if self.deferred:
            steps, self.deferred = self.deferred, []
            self.mtp.write_kv_steps(steps, self.caches)

    def enable_graphs(self, buckets: list[int], max_blocks: int, draft_counts: list[int],
                      recorder=None):
        from lmdeploy_lite.pytorch.backends.cuda.graph_runner import GraphRunner
        weight = self.mtp.fc.weight
        extras = [((), torch.long), ((weight.shape[0],), weight.dtype)]
        counts = sorted(draft_counts, reverse=True)
        pool = None

        def capture(fn, name: str, q_len: int = 1):
            nonlocal pool
            runner = GraphRunner(fn, name, q_len, buckets, max_blocks, extras, weight.device,
                                 pool=pool, recorder=recorder)
            runner.capture()
            pool = runner.pool
            return runner
        for q_len in [k + 1 for k in counts if k] + [1]:
            self.graphs[q_len] = capture(self._head, 'mtp draft', q_len)
        if 0 in counts:
            self.kv_graphs[1] = capture(self._write_kv, 'mtp kv')
        for k in [k for k in counts if k]:
            self.chain_graphs[k] = capture(
                lambda inputs, ids, h, k=k: self._draft(inputs, h, k, self._head)[0],
                f'mtp chain k={k}')

    def warm_eager(self, inputs: ModelInputs, target_hidden: torch.Tensor):
        """The head's eager passes over a warm-up step (SpecAgent.warm_eager): the KV write a
        prefill step's rows-only pass runs, and the whole pass (batches past the graphs'
        buckets). The whole pass stores the same KV with the same kernels, so the write may
        compile nothing of its own; it is run so that nothing a prefill step runs is left out
        (not measured apart)."""
        self.mtp.write_kv(inputs.input_ids, target_hidden, inputs, self.caches)
        self._head(inputs, inputs.input_ids, target_hidden)

    def _draft(self, first: ModelInputs, hidden: torch.Tensor, k: int, head,
               sampling: SamplingInputs | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`propose`'s drafts and q (`sampling` None: greedy) from the head's output `hidden`
        [B, H], the head run again by `head(step, ids, hidden)`; `first`: draft 2's step."""
        drafts, probs = [], []
        for i in range(k):
            if i > 0:   # the same layer again, one position on, fed its own output
                step = self._draft_step_inputs(first, drafts[-1], first.positions + (i - 1))
                hidden = head(step, drafts[-1], hidden)
            greedy = sampling is None or sampling.all_greedy
            logits = self.compute_logits(hidden, cast=not greedy)  # an argmax needs no cast
            token = self.argmax(logits)
            if not greedy:                  # sampled: draw, keep q to verify
                q = probs_from_logits(logits, sampling)
                token = torch.where(sampling.do_sample, draw_from_probs(q, sampling.generators),
                                    token)
                probs.append(q)
            drafts.append(token if self.token_map is None else self.token_map[token])
        return torch.stack(drafts, 1), (torch.stack(probs, 1) if probs else None)

    @staticmethod
    def _draft_step_inputs(inputs: ModelInputs, ids: torch.Tensor, positions: torch.Tensor
                           ) -> ModelInputs:
        """One draft token per sequence at `positions` (its history: every earlier position)."""
        return ModelInputs(input_ids=ids, positions=positions, q_lens=torch.ones_like(positions),
                           history_lens=positions, block_tables=inputs.block_tables,
                           state_slots=inputs.state_slots, state_index=inputs.state_index,
                           is_decoding=True, is_dummy=inputs.is_dummy, uniform_q_len=1,
                           padded_batch_size=inputs.padded_batch_size, graphable=inputs.graphable,
                           sizes=inputs.sizes and inputs.sizes.one_token_per_seq())

    def _write_kv(self, inputs: ModelInputs, input_ids: torch.Tensor, hidden: torch.Tensor):
        self.mtp.write_kv(input_ids, hidden, inputs, self.caches)
        return hidden[:, :0]                  # a graph runner returns a tensor; nothing to read

    def _head(self, inputs: ModelInputs, input_ids: torch.Tensor, hidden: torch.Tensor):
        return self.mtp(input_ids, hidden, inputs, self.caches)

    @staticmethod
    def _plan_tokens(inputs: ModelInputs) -> int:
        """The step's token count every rank agrees on (the plan's largest where there is one:
        an EP MoE's dispatch must have one shape on every rank), else this rank's."""
        return inputs.sizes.max_tokens if inputs.sizes is not None else inputs.num_tokens

    def _rows_only(self, inputs: ModelInputs) -> bool:
        """Whether the step's first head pass is `_head_at_rows`: on the CPU from
        ROW_ONLY_MIN_TOKENS tokens (measured: module docstring), elsewhere where no graph holds
        the whole pass: in a step where some rank prefills (a verify's pass is captured per k).
        Every rank of a step chooses alike, from the plan (`sizes.low_latency`: every working
        rank decodes), since the layer's MoE dispatches across EP ranks."""
        if self.row_only:
            return self._plan_tokens(inputs) >= ROW_ONLY_MIN_TOKENS
        return not (inputs.sizes.low_latency if inputs.sizes is not None else inputs.is_decoding)

    def _head_at_rows(self, inputs: ModelInputs, next_ids: torch.Tensor, target_hidden,
                      rows: torch.Tensor, positions: torch.Tensor, graphs: dict) -> torch.Tensor:
        """`_head` over the step's positions, kept at `rows` only: their KV written for every
        position, then the layer (attention, MLP or MoE) run at each sequence's row alone, as a
        one-token step at its position (its attention reads the positions up to it), by the
        one-token graph where `graphs` has one."""
        self.mtp.write_kv(next_ids, target_hidden, inputs, self.caches)
        ids = next_ids[rows]
        return self._run(graphs, self._head, self._draft_step_inputs(inputs, ids, positions),
                         ids, target_hidden[rows])

    def _run(self, graphs: dict, fn, inputs: ModelInputs, input_ids, hidden) -> torch.Tensor:
        """`fn(inputs, input_ids, hidden)`, by its graph for this q_len when one is captured."""
        runner = graphs.get(inputs.uniform_q_len)
        run = runner if runner is not None and runner.can_run(inputs) else fn
        return run(inputs, input_ids, hidden)

    def propose(self, inputs: ModelInputs, target_hidden: torch.Tensor, next_ids: torch.Tensor,
                rows: torch.Tensor, sampling: SamplingInputs, num_drafts: int | None = None,
                use_graphs: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """inputs/target_hidden [T, H]: the target step just run; next_ids [T] long: the token
        after each position (any valid id where unknown: that KV entry is rewritten later);
        rows [B] long: each sequence's row whose successor is the first draft; num_drafts: k
        (default the maximum; 0: write the head's KV only). Returns drafts [B, k] long and, if
        any row samples, q [B, k, V] ([B, k, M] over token_map's ids with a reduced vocabulary).
        use_graphs False: run eagerly (inside another graph's capture)."""
        k = self.num_spec_tokens if num_drafts is None else num_drafts
        graphs, kv_graphs, chain_graphs = ((self.graphs, self.kv_graphs, self.chain_graphs)
                                           if use_graphs else ({}, {}, {}))
        if k == 0:
            self._run(kv_graphs, self._write_kv, inputs, next_ids, target_hidden)
            return rows.new_empty((rows.numel(), 0)), None
        positions = inputs.positions[rows]
        if self._rows_only(inputs):
            hidden = self._head_at_rows(inputs, next_ids, target_hidden, rows, positions, graphs)
        else:
            hidden = self._run(graphs, self._head, inputs, next_ids, target_hidden)[rows]
        first = self._draft_step_inputs(inputs, positions, positions + 1)
        chain = chain_graphs.get(k) if sampling.all_greedy else None
        if chain is not None and chain.can_run(first):
            return chain(first, positions, hidden), None
        return self._draft(first, hidden, k, partial(self._run, graphs, self._head), sampling)
