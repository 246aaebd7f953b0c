"""All the engine knows of speculation (the only module of spec_decode/ engine/ imports): the
checked `SpecPlan` and one `SpecRuntime` (agent, strategy, draft-count policy) it asks each step;
without speculation it runs plain decoding (k = 0, no policy)."""
from __future__ import annotations

import dataclasses

import torch

from lmdeploy_lite.messages import SpeculativeConfig
from lmdeploy_lite.pytorch.config import DistConfig, ModelConfig
from lmdeploy_lite.pytorch.models.loader import fp8_linears
from lmdeploy_lite.pytorch.spec_decode.build import (SpecPlan, build_spec_decoding,
                                                     check_speculative_config, spec_plan,
                                                     uses_draft_model)
from lmdeploy_lite.pytorch.spec_decode.policy import DraftCountPolicy
from lmdeploy_lite.pytorch.strategies.ar import ARStrategy


__all__ = ['SpecPlan', 'SpecRuntime', 'build_spec_runtime', 'check_speculative_config',
           'plan_speculation']


def plan_speculation(spec: SpeculativeConfig | None, model_path: str, model_config: ModelConfig,
                     dtype: torch.dtype, target: DistConfig, load_format: str,
                     model_format: str | None = None, fp8_gemm: bool = False) -> SpecPlan:
    """The SpecPlan of `spec` (None: no speculation), its config checked first. `fp8_gemm`: the
    device computes FP8 linears, so the draft's are planned at the size its checkpoint (with
    `model_format`) gives them (loader.fp8_linears)."""
    fp8 = None
    if spec is not None:
        check_speculative_config(spec, model_path, target, load_format)
        if fp8_gemm and uses_draft_model(spec):
            fp8 = fp8_linears(spec.model or model_path, model_format, load_format)
    return spec_plan(spec, model_config, dtype, target, fp8)


@dataclasses.dataclass
class SpecRuntime:
    plan: SpecPlan
    agent: object                       # ModelAgent, or the SpecAgent wrapping it
    strategy: object                    # ARStrategy, or ARSpecStrategy
    policy: DraftCountPolicy | None     # each rank's proposal of a step's draft count

    def draft_modules(self) -> list:
        """The draft's own modules (the MTP layer; none for n-gram or without speculation)."""
        proposer = getattr(self.agent, 'proposer', None)
        return [proposer.mtp] if proposer is not None else []

    def choose_k(self, batch) -> int:
        """This rank's proposal (the StepPlan agrees on one); 0 without speculation or work."""
        return 0 if batch is None or self.policy is None else self.policy.propose(len(batch.seqs))

    def with_draft_count(self, batch, k: int):
        """A new batch at draft count k: a decode row feeds k + 1 tokens and verifies at most k
        drafts its last step made (`row_drafts`), then every row drafts k."""
        if batch is None or self.policy is None:
            return batch
        seqs, q_lens, row_drafts = batch.seqs, batch.q_lens, None
        if batch.is_decoding:                            # host drafts: all k made now
            q_lens = [k + 1] * len(seqs)
            host = self.plan.needs_host_tokens
            row_drafts = [k if host else min(s.drafts_ready, k) for s in seqs]
        for seq in seqs:
            seq.drafts_ready = k
        return dataclasses.replace(batch, q_lens=q_lens, num_spec=k, row_drafts=row_drafts)

    def observe_time(self, batch, k: int, seconds: float):
        """A decode step's wall time; any other step breaks the sequence of like steps."""
        if self.policy is None:
            return
        if batch is not None and batch.is_decoding:
            self.policy.observe_time(len(batch.seqs), k, seconds)
        else:
            self.policy.break_sequence()

    def observe_acceptance(self, batch, accepted: list[int] | None):
        """After a verify: each row's accepted drafts of its `row_drafts`."""
        if self.policy is not None and accepted is not None and batch.row_drafts is not None:
            self.policy.observe_acceptance(batch.row_drafts, accepted)


def build_spec_runtime(spec: SpeculativeConfig | None, plan: SpecPlan, model_path: str, agent,
                       model_config, cache_config, dtype: torch.dtype, device: torch.device,
                       progress: bool, dist, load_format: str, seed: int,
                       model_format: str | None = None) -> SpecRuntime:
    if not plan.enabled:
        return SpecRuntime(plan, agent, ARStrategy(), None)
    agent, strategy = build_spec_decoding(spec, model_path, agent, model_config, cache_config,
                                          dtype, device, progress, dist, load_format=load_format,
                                          seed=seed, model_format=model_format)
    return SpecRuntime(plan, agent, strategy,
                       DraftCountPolicy.from_config(plan.num_spec_tokens, plan.dynamic))
