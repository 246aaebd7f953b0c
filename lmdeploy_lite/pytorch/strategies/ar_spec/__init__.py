"""Autoregressive decoding with k drafts per step. Prefill: plain AR's chunks plus `next_token_ids`
(the prompt token after each chunk, when known) so the draft head runs over every prompt position.
Decode: each sequence feeds `[last accepted token, d1..dk]`: -1 placeholders the device fills in
with a device proposer (DESIGN.md invariant 7), real ids and `draft_tokens` with a host one (ngram).
"""
from __future__ import annotations

import torch

from lmdeploy_lite.pytorch.model_inputs import ModelInputs
from lmdeploy_lite.pytorch.strategies.base import Strategy, pack_model_inputs


class ARSpecStrategy(Strategy):

    def __init__(self, num_spec_tokens: int, host_proposer=None):
        super().__init__()
        self.num_spec_tokens = num_spec_tokens
        self.host_proposer = host_proposer      # .propose(token_ids) -> k drafts, or None

    def make_model_inputs(self, batch, device) -> ModelInputs:
        seqs = batch.seqs
        history = [s.num_computed for s in seqs]
        if not batch.is_decoding:
            inputs = super().make_model_inputs(batch, device)
            nexts = [s.token_ids[h + n] if h + n < len(s.token_ids) else -1
                     for s, h, n in zip(seqs, history, batch.q_lens)]
            inputs.next_token_ids = torch.tensor(nexts, dtype=torch.long, device=device)
            return inputs
        k = batch.num_spec
        if self.host_proposer is not None:
            drafts = [self.host_proposer.propose(s.token_ids)[:k] for s in seqs]
            chunks = [[s.token_ids[-1]] + d for s, d in zip(seqs, drafts)]
        else:
            drafts, chunks = None, [[-1] * (k + 1) for _ in seqs]
        inputs = pack_model_inputs(chunks, history, [s.blocks for s in seqs],
                                   [s.state_slot for s in seqs], True, device)
        if drafts is not None:
            inputs.draft_tokens = torch.tensor(drafts, dtype=torch.long, device=device)
        return inputs

    def emitted_per_row(self, result) -> torch.Tensor:
        if result.num_accepted_drafts is None:        # a plain step (k = 0): one token
            return super().emitted_per_row(result)
        return result.num_accepted_drafts + 1         # accepted drafts and the bonus token

    def next_input_ids(self, result, q_len: int) -> torch.Tensor:
        # placeholders: the spec agent builds [bonus, drafts] from its device tables
        return result.output_tokens.new_full((result.output_tokens.shape[0] * q_len,), -1)

    def make_dummy_inputs(self, num_tokens_per_seq: int, is_decoding: bool, device,
                          num_spec: int = 0) -> ModelInputs:
        inputs = super().make_dummy_inputs(num_tokens_per_seq, is_decoding, device)
        if self.host_proposer is not None and is_decoding:
            inputs.draft_tokens = torch.zeros(1, num_spec, dtype=torch.long, device=device)
        inputs.next_token_ids = torch.zeros(1, dtype=torch.long, device=device)
        return inputs

    def post_broadcast(self, result, agent, inputs: ModelInputs, plan, dist_ctx):
        """TP rank 0's emitted tokens, accepted counts and next drafts become every TP peer's
        (the peers re-derive state slot and last token). q travels only in a step the plan
        marks `any_sampled`: greedy steps ship no [B, k, V] table."""
        if dist_ctx.config.tp == 1:
            return result
        slots, tp = inputs.state_slots, dist_ctx.tp
        tp.broadcast(result.output_tokens)
        agent.drafts[slots] = tp.broadcast(agent.drafts[slots].contiguous())
        if agent.draft_probs is not None and plan.any_sampled:
            agent.draft_probs[slots] = tp.broadcast(agent.draft_probs[slots].contiguous())
        if result.num_accepted_drafts is None:           # prefill: the sampled token
            agent.last_token[slots] = result.output_tokens[:, 0]
            return result
        accepted = tp.broadcast(result.num_accepted_drafts)
        agent.target.set_state_index(slots, accepted)
        rows = torch.arange(slots.numel(), device=slots.device)
        agent.last_token[slots] = result.output_tokens[rows, accepted]
        return result

    def emitted(self, seq, q_len: int, samples: bool, row: list[int],
                num_accepted: int | None, num_drafts: int | None = None
                ) -> tuple[int, list[int]]:
        if num_accepted is None:                  # prefill chunk: one token at most
            return super().emitted(seq, q_len, samples, row, num_accepted)
        num_drafts = q_len - 1 if num_drafts is None else num_drafts
        if num_drafts:                            # a row with no drafts verified nothing
            seq.spec_stats.add(num_drafts, num_accepted)
            self.stats.add(num_drafts, num_accepted)
        # fed [last, d1..dk]: last and the accepted drafts are now in the cache
        return 1 + num_accepted, row[:num_accepted + 1]
