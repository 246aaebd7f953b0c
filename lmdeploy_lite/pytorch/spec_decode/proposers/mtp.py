"""The Qwen3.5 MTP head as a proposer: k draft tokens per sequence, all on the device.

Its KV cache is its own (one full-attention layer) on the target's block table. Each call first
runs the head over every position the target just ran — the pair (target hidden h_t, token
x_{t+1}) at position t — so its cache stays complete, then drafts k tokens from the row of the
last accepted position, reusing the one layer for each step at position + 1 and feeding it its
own normed output (qwen3_5.md section 3).
"""
from __future__ import annotations

import torch

from lmdeploy_lite.pytorch.model_inputs import ModelInputs
from lmdeploy_lite.pytorch.sampling import SamplingInputs, draw_from_probs, probs_from_logits


class MTPProposer:
    drafts_on_device = True

    def __init__(self, mtp, caches, compute_logits, num_spec_tokens: int,
                 token_map: torch.Tensor | None = None):
        self.mtp = mtp
        self.caches = caches
        self.compute_logits = compute_logits          # the target's LM head (or ReducedLMHead)
        self.token_map = token_map    # [M] long: logits index it (token_map.py); None: full vocab
        self.num_spec_tokens = num_spec_tokens
        self.graphs = {}           # q_len -> GraphRunner: k + 1 (over a verify step), 1 (drafting)

    def enable_graphs(self, buckets: list[int], max_blocks: int, recorder=None):
        from lmdeploy_lite.pytorch.backends.cuda.graph_runner import GraphRunner
        weight = self.mtp.fc.weight
        hidden = ((weight.shape[0],), weight.dtype)
        for q_len in sorted({self.num_spec_tokens + 1, 1}):
            runner = GraphRunner(lambda inputs, ids, h: self.mtp(ids, h, inputs, self.caches),
                                 'mtp draft', q_len, buckets, max_blocks,
                                 [((), torch.long), hidden], weight.device,
                                 recorder=recorder)
            runner.capture()
            self.graphs[q_len] = runner

    def _run_mtp(self, input_ids: torch.Tensor, hidden: torch.Tensor,
                 inputs: ModelInputs) -> torch.Tensor:
        runner = self.graphs.get(inputs.uniform_q_len)
        if runner is not None and runner.can_run(inputs):
            return runner(inputs, input_ids, hidden)
        return self.mtp(input_ids, hidden, inputs, self.caches)

    def propose(self, inputs: ModelInputs, target_hidden: torch.Tensor, next_ids: torch.Tensor,
                rows: torch.Tensor, sampling: SamplingInputs
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """inputs/target_hidden [T, H]: the target step just run; next_ids [T] long: the token
        after each position (any valid id where unknown: that KV entry is rewritten later);
        rows [B] long: each sequence's row whose successor is the first draft.
        Returns drafts [B, k] long and, if any row samples, q [B, k, V] (the draft distribution;
        [B, k, M] over token_map's ids with a reduced vocabulary)."""
        hidden = self._run_mtp(next_ids, target_hidden, inputs)[rows]
        positions = inputs.positions[rows]
        ones = torch.ones_like(positions)
        drafts, probs = [], []
        for i in range(self.num_spec_tokens):
            if i > 0:   # the same layer again, one position on, fed its own output
                step = ModelInputs(input_ids=drafts[-1], positions=positions + i, q_lens=ones,
                                   history_lens=positions + i, block_tables=inputs.block_tables,
                                   state_slots=inputs.state_slots, state_index=inputs.state_index,
                                   is_decoding=True, is_dummy=inputs.is_dummy, uniform_q_len=1,
                                   padded_batch_size=inputs.padded_batch_size,
                                   graphable=inputs.graphable,
                                   sizes=inputs.sizes and inputs.sizes.one_token_per_seq())
                hidden = self._run_mtp(drafts[-1], hidden, step)
            logits = self.compute_logits(hidden)
            token = logits.argmax(-1)
            if not sampling.all_greedy:     # sampled rows draw from q and keep it for verify
                q = probs_from_logits(logits, sampling)
                token = torch.where(sampling.do_sample, draw_from_probs(q, sampling.generators),
                                    token)
                probs.append(q)
            drafts.append(token if self.token_map is None else self.token_map[token])
        return torch.stack(drafts, 1), (torch.stack(probs, 1) if probs else None)
