"""One speculative step on one rank: verify -> accept -> bonus -> draft (DESIGN.md "One step"),
for `inputs.num_spec` drafts (the StepPlan's k; 0: a plain decode step). Decode state stays on
the device per state slot (DESIGN.md invariant 7): `last_token` (the last bonus token), `drafts`
[k], `num_drafted` (a verify accepts no more) and, with a device proposer, `draft_probs` [k, V]
([k, M] over a token map; sized per spec_decode/build.py). The next decode step's inputs
`[last_token, d1..dk]` are built from them on the device; the host only learns emitted tokens.
With CUDA graphs, a greedy batch with device drafts runs a whole step in one replay per k
(`step_graphs`: verify forward, LM head, acceptance, the MTP head and its draft chain); other
batches replay the verify forward and the proposer's graphs with eager work between them.
"""
from __future__ import annotations

from functools import partial

import torch

from lmdeploy_lite.pytorch.backends import get_backend
from lmdeploy_lite.pytorch.model_agent import ModelAgent, StepResult
from lmdeploy_lite.pytorch.model_inputs import ModelInputs
from lmdeploy_lite.pytorch.sampling import SamplingInputs, sample
from lmdeploy_lite.pytorch.spec_decode.rejection import rejection_sample

# the largest batch whose greedy step is captured whole (its verify logits stay in the pool)
STEP_GRAPH_MAX_BATCH = 64


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
        self._rejection_sampler = (rejection_sample if token_map is None else
                                   partial(rejection_sample, token_map=token_map))
        self.plain_graph = None        # GraphRunner of a greedy plain step (k = 0), when captured
        # k -> GraphRunner of a whole greedy step of k device drafts (batches up to
        # STEP_GRAPH_MAX_BATCH: the verify logits [B, k + 1, V] live in the graph pool)
        self.step_graphs: dict = {}
        self._graph_args = None        # (buckets, max_blocks, recorder) the step graphs took
        # on the CPU a plain step's draft-KV write waits for the next step that is not a plain
        # step (or for DEFERRED_STEPS of them): MTPProposer.defer_kv
        self.defers_kv = proposer is not None and device.type == 'cpu'

    @property
    def rejection_sampler(self):
        """The verification rule (rejection.rejection_sample over the token map)."""
        return self._rejection_sampler

    @rejection_sampler.setter
    def rejection_sampler(self, sampler):
        """Swap it (benchmarks' synthetic acceptance, tests' recorders): the step graphs hold the
        rule they were captured with, so they are captured again."""
        self._rejection_sampler = sampler
        if self.step_graphs:
            self.step_graphs.clear()
            self._capture_step_graphs(*self._graph_args)

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
        if self.proposer is not None:
            self._capture_step_graphs(buckets, max_blocks, recorder)

    def warm_eager(self, shapes: list[list[int]], block_size: int):
        """ModelAgent.warm_eager, the draft head's pass over each step after the target's (the
        head runs prefill and mixed steps eagerly)."""
        self.target.warm_eager(shapes, block_size,
                               None if self.proposer is None else self.proposer.warm_eager)

    def _capture_step_graphs(self, buckets: list[int], max_blocks: int, recorder):
        from lmdeploy_lite.pytorch.backends.cuda.graph_runner import GraphRunner
        self._graph_args = (buckets, max_blocks, recorder)
        self._greedy = SamplingInputs.from_values([False], [1.0], [0], [1.0],
                                                  device=self.target.device)
        small = [b for b in buckets if b <= STEP_GRAPH_MAX_BATCH]
        for k in [k for k in self.draft_counts if k] if small else []:
            self.step_graphs[k] = GraphRunner(self._greedy_step, f'spec step k={k}', k + 1,
                                              small, max_blocks, [], self.target.device,
                                              pool=self.target.graph_pool, recorder=recorder)
            self.step_graphs[k].capture()

    def _greedy_step(self, inputs: ModelInputs) -> torch.Tensor:
        """`_verify_and_draft` of a greedy batch with device drafts, graphs not replayed inside
        (`step_graphs` capture it): [B * (k + 1), 2] long, each row's output tokens beside its
        num_accepted_drafts (repeated)."""
        target = self.target
        inputs.num_spec = inputs.uniform_q_len - 1      # the runner's static inputs have no k
        tokens, num_accepted, _ = self._verify_and_draft_body(
            inputs, self._greedy, lambda inputs: target.model(inputs, target.caches), False,
            cast=False)
        return torch.stack([tokens, num_accepted[:, None].expand_as(tokens)], -1).flatten(0, 1)

    @staticmethod
    def _argmax_only(sampling: SamplingInputs) -> bool:
        """Whether a step's tokens are bare argmaxes (no sampling, penalties, masks, logprobs)."""
        return (sampling.all_greedy and sampling.penalties is None and sampling.masks is None
                and sampling.logprobs is None)

    def _greedy_plain_step(self, inputs: ModelInputs) -> torch.Tensor:
        target = self.target
        hidden = target.model(inputs, target.caches)
        tokens = get_backend(hidden.device).argmax(target.model.compute_logits(hidden, False))
        if self.proposer is not None:
            self.proposer.mtp.write_kv(tokens, hidden, inputs, self.proposer.caches)
        return tokens

    @torch.inference_mode()
    def step(self, inputs: ModelInputs, sampling: SamplingInputs) -> StepResult:
        if self.defers_kv and self.proposer.deferred and not self._defers(inputs):
            self.proposer.flush_kv()        # before this step reads the head's KV or its blocks
        if not inputs.is_decoding:
            return self._prefill_and_draft(inputs, sampling)
        step = self._verify_and_draft if inputs.num_spec else self._plain_step
        return step(inputs, sampling)

    def _defers(self, inputs: ModelInputs) -> bool:
        """Whether this step is a plain step whose draft-KV write may wait (`defers_kv`)."""
        return inputs.is_decoding and not inputs.num_spec and self.proposer.can_defer()

    def _plain_step(self, inputs: ModelInputs, sampling: SamplingInputs) -> StepResult:
        """k = 0: plain decoding, then the draft head writes only its KV there. Greedy with CUDA
        graphs, one replay of forward, LM head, argmax and that write (`plain_graph`)."""
        slots = inputs.state_slots
        if inputs.draft_tokens is None:           # device drafts: the id is on the device
            inputs.input_ids = self.last_token[slots]
        # the graph returns argmax tokens only: no sampling, penalties or logprobs
        runner = self.plain_graph if self._argmax_only(sampling) else None
        logits = None
        if runner is not None and runner.can_run(inputs):
            inputs.state_index = self.target.state_index[slots]
            tokens = runner(inputs)
        else:
            hidden = self.target.forward(inputs)
            logits = self.target.last_logits(inputs, hidden)
            tokens = sample(logits, sampling)
            if self.defers_kv:
                self.proposer.defer_kv(inputs, hidden, tokens)
            elif self.proposer is not None:
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
        k = inputs.num_spec
        runner = (self.step_graphs.get(k) if inputs.draft_tokens is None
                  and self._argmax_only(sampling) else None)
        if runner is not None and runner.can_run(inputs):
            inputs.state_index = self.target.state_index[inputs.state_slots]
            packed = runner(inputs).view(-1, k + 1, 2)    # contiguous: a TP broadcast takes them
            return StepResult(packed[..., 0].contiguous(), packed[:, 0, 1].contiguous())
        output_tokens, num_accepted, logits = self._verify_and_draft_body(
            inputs, sampling, self.target.forward, True)
        # logprobs: the verify logits at each emitted position (accepted drafts, then bonus)
        return StepResult(output_tokens, num_accepted).with_logprobs(logits, sampling)

    def _verify_and_draft_body(self, inputs: ModelInputs, sampling: SamplingInputs, forward,
                               use_graphs: bool, cast: bool = True):
        """(output_tokens [B, k + 1], num_accepted [B], logits [B, k + 1, V]) of a verify step,
        the next drafts saved; `forward(inputs)`: the target's hidden states. `cast=False`
        (greedy argmax only): logits in the LM head's dtype."""
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
        hidden = forward(inputs)
        logits = self.target.model.compute_logits(hidden, cast).view(batch, k + 1, -1)
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
        self._save_drafts(inputs, hidden, next_ids, inputs.q_start_loc + num_accepted, sampling, k,
                          use_graphs)
        return output_tokens, num_accepted, logits

    def _save_drafts(self, inputs, hidden, next_ids, rows, sampling, k: int,
                     use_graphs: bool = True):
        if self.proposer is None:
            return
        slots = inputs.state_slots
        drafts, probs = self.proposer.propose(inputs, hidden, next_ids, rows, sampling, k,
                                              use_graphs)
        self.num_drafted.index_fill_(0, slots, k)
        if k:
            self.drafts[slots, :k] = drafts
        if probs is not None:
            self.draft_probs[slots, :k] = probs
