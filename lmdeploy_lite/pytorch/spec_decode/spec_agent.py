"""One speculative step on one rank: verify -> accept -> bonus -> draft (DESIGN.md "One step"),
for `inputs.num_spec` drafts (the StepPlan's k; 0: a plain decode step). Decode state stays on
the device per state slot (DESIGN.md invariant 7): `last_token` (the last bonus token), `drafts`
[k], `num_drafted` (a verify accepts no more) and, with a device proposer, `draft_probs` [k, V]
([k, M] over a token map; sized per spec_decode/build.py). The next decode step's inputs
`[last_token, d1..dk]` are built from them on the device; the host only learns emitted tokens.
"""
from __future__ import annotations

from functools import partial

import torch

from lmdeploy_lite.pytorch.model_agent import ModelAgent, StepResult
from lmdeploy_lite.pytorch.model_inputs import ModelInputs
from lmdeploy_lite.pytorch.sampling import SamplingInputs, sample
from lmdeploy_lite.pytorch.spec_decode.rejection import rejection_sample


class SpecAgent:

    def __init__(self, target: ModelAgent, proposer, num_spec_tokens: int, num_state_slots: int,
                 vocab_size: int, probs_dtype: torch.dtype = torch.float32,
                 token_map: torch.Tensor | None = None, dynamic: bool = False):
        self.target = target
        # the draft counts a step may run (graphs are captured for each)
        self.draft_counts = list(range(num_spec_tokens + 1)) if dynamic else [num_spec_tokens]
        self.proposer = proposer          # MTPProposer (device drafts), or None (host drafts)
        device = target.device
        self.last_token = torch.zeros(num_state_slots, dtype=torch.long, device=device)
        self.drafts = torch.zeros(num_state_slots, num_spec_tokens, dtype=torch.long, device=device)
        self.num_drafted = torch.zeros(num_state_slots, dtype=torch.long, device=device)
        # q of each slot's drafts, written when its batch samples (None: host drafts)
        draft_vocab = vocab_size if token_map is None else token_map.numel()
        self.draft_probs = (None if proposer is None else
                            torch.zeros(num_state_slots, num_spec_tokens, draft_vocab,
                                        dtype=probs_dtype, device=device))
        self.rejection_sampler = rejection_sample         # benchmarks may swap in a synthetic one
        self.plain_graph = None        # GraphRunner of a greedy plain step (k = 0), when captured
        if token_map is not None:
            self.rejection_sampler = partial(rejection_sample, token_map=token_map)

    def enable_graphs(self, buckets: list[int], max_blocks: int, recorder=None, **prefill):
        """CUDA graphs of the verify forward and the draft steps for each of `draft_counts`
        (`prefill`: the target's prefill graphs, ModelAgent.enable_graphs)."""
        counts = self.draft_counts
        self.target.enable_graphs(buckets, max_blocks, [k + 1 for k in counts], recorder,
                                  **prefill)
        if self.proposer is not None:
            self.proposer.enable_graphs(buckets, max_blocks, counts, recorder)
        if 0 in counts:
            from lmdeploy_lite.pytorch.backends.cuda.graph_runner import GraphRunner
            self.plain_graph = GraphRunner(self._greedy_plain_step, 'plain step', 1, buckets,
                                           max_blocks, [], self.target.device,
                                           pool=self.target.graph_pool, recorder=recorder)
            self.plain_graph.capture()

    def _greedy_plain_step(self, inputs: ModelInputs) -> torch.Tensor:
        target = self.target
        hidden = target.model(inputs, target.caches)
        tokens = target.model.compute_logits(hidden).argmax(-1)
        if self.proposer is not None:
            self.proposer.mtp.write_kv(tokens, hidden, inputs, self.proposer.caches)
        return tokens

    @torch.inference_mode()
    def step(self, inputs: ModelInputs, sampling: SamplingInputs) -> StepResult:
        if not inputs.is_decoding:
            return self._prefill_and_draft(inputs, sampling)
        step = self._verify_and_draft if inputs.num_spec else self._plain_step
        return step(inputs, sampling)

    def _plain_step(self, inputs: ModelInputs, sampling: SamplingInputs) -> StepResult:
        """k = 0: plain decoding, then the draft head writes only its KV there. Greedy with CUDA
        graphs, one replay of forward, LM head, argmax and that write (`plain_graph`)."""
        slots = inputs.state_slots
        if inputs.draft_tokens is None:           # device drafts: the id is on the device
            inputs.input_ids = self.last_token[slots]
        # the graph returns argmax tokens only: no sampling, penalties or logprobs
        runner = (self.plain_graph if sampling.all_greedy and sampling.penalties is None
                  and sampling.masks is None and sampling.logprobs is None else None)
        logits = None
        if runner is not None and runner.can_run(inputs):
            inputs.state_index = self.target.state_index[slots]
            tokens = runner(inputs)
        else:
            hidden = self.target.forward(inputs)
            logits = self.target.last_logits(inputs, hidden)
            tokens = sample(logits, sampling)
            if self.proposer is not None:
                self.proposer.propose(inputs, hidden, tokens, slots, sampling, 0)
        self.target.set_state_index(slots, 0)
        self.last_token[slots] = tokens
        if self.proposer is not None:
            self.num_drafted.index_fill_(0, slots, 0)
        result = StepResult(tokens[:, None])
        return result if logits is None else result.with_logprobs(logits[:, None], sampling)

    def _prefill_and_draft(self, inputs: ModelInputs, sampling: SamplingInputs) -> StepResult:
        if inputs.block_copies is not None and self.proposer is not None:
            self.proposer.caches.copy_blocks(inputs.block_copies)   # forks: the draft's KV too
        hidden = self.target.forward(inputs)
        self.target.set_state_index(inputs.state_slots, 0)
        logits = self.target.last_logits(inputs, hidden)
        tokens = sample(logits, sampling)
        last_rows = inputs.q_start_loc + inputs.q_lens - 1
        # the token after each prompt position: the next prompt token, and after the final
        # chunk the token just sampled (a non-final chunk's drafts are discarded)
        next_ids = torch.roll(inputs.input_ids, -1)
        next_ids[last_rows] = torch.where(inputs.next_token_ids >= 0, inputs.next_token_ids, tokens)
        self._save_drafts(inputs, hidden, next_ids, last_rows, sampling, inputs.num_spec)
        self.last_token[inputs.state_slots] = tokens
        return StepResult(tokens[:, None]).with_logprobs(logits[:, None], sampling)

    def _verify_and_draft(self, inputs: ModelInputs, sampling: SamplingInputs) -> StepResult:
        slots, k = inputs.state_slots, inputs.num_spec
        batch = slots.numel()
        # 1. inputs [last accepted token, d1..dk], built on the device from the last step; a
        #    slot whose last step drafted fewer than k verifies only those (num_drafts)
        if inputs.draft_tokens is None:
            drafts = self.drafts[slots, :k]
            inputs.input_ids = torch.cat([self.last_token[slots, None], drafts], 1).flatten()
            draft_probs = None if sampling.all_greedy else self.draft_probs[slots, :k]
            num_drafts = self.num_drafted[slots].clamp_(max=k)
        else:                                   # host drafts: all k real and deterministic
            drafts, draft_probs, num_drafts = inputs.draft_tokens, None, None
        # 2. verify: one target forward over the k + 1 positions
        hidden = self.target.forward(inputs)
        logits = self.target.model.compute_logits(hidden).view(batch, k + 1, -1)
        # 3. accept a prefix of the drafts, then one correction or bonus token
        output_tokens, num_accepted = self.rejection_sampler(logits, drafts, draft_probs, sampling,
                                                             num_drafts)
        # 4. rollback is arithmetic: the next step reads the state after the last accepted token
        #    (slot num_accepted); rejected KV entries are overwritten by later steps
        self.target.set_state_index(slots, num_accepted)
        rows = torch.arange(batch, device=slots.device)
        self.last_token[slots] = output_tokens[rows, num_accepted]
        # 5. draft the next k tokens from the last accepted position; positions past it carry
        #    -1 placeholders, clamped to a valid id before the embedding lookup
        next_ids = output_tokens.clamp(min=0).flatten()
        self._save_drafts(inputs, hidden, next_ids, inputs.q_start_loc + num_accepted, sampling, k)
        # logprobs: the verify logits at each emitted position (accepted drafts, then bonus)
        return StepResult(output_tokens, num_accepted).with_logprobs(logits, sampling)

    def _save_drafts(self, inputs, hidden, next_ids, rows, sampling, k: int):
        if self.proposer is None:
            return
        slots = inputs.state_slots
        drafts, probs = self.proposer.propose(inputs, hidden, next_ids, rows, sampling, k)
        self.num_drafted.index_fill_(0, slots, k)
        if k:
            self.drafts[slots, :k] = drafts
        if probs is not None:
            self.draft_probs[slots, :k] = probs
