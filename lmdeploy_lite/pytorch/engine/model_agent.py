"""Runs the model on one rank: forward, logits of the sampling positions, sampling.

Decode state that the next step needs (which linear-attention state slot is current) stays on
the device (DESIGN.md invariant 7).
"""
from __future__ import annotations

import torch

from lmdeploy_lite.pytorch.model_inputs import ModelInputs
from lmdeploy_lite.pytorch.sampling import SamplingInputs, sample


class ModelAgent:

    def __init__(self, model, caches, num_state_slots: int, device: torch.device):
        self.model = model
        self.caches = caches
        self.device = device
        # [num_state_slots] long: current recurrent-state slot / conv offset of each state row
        self.state_index = torch.zeros(num_state_slots, dtype=torch.long, device=device)

    @torch.inference_mode()
    def forward_last_logits(self, inputs: ModelInputs) -> torch.Tensor:
        """[B, V] logits at each sequence's last fed position."""
        inputs.state_index = self.state_index[inputs.state_slots]
        hidden = self.model(inputs, self.caches)
        last = inputs.q_start_loc + inputs.q_lens - 1
        self.state_index[inputs.state_slots] = 0        # prefill and 1-token decode write slot 0
        return self.model.compute_logits(hidden[last])

    @torch.inference_mode()
    def step(self, inputs: ModelInputs, sampling: SamplingInputs) -> torch.Tensor:
        """[B] long sampled tokens (rows whose step does not reach the sequence end are unused)."""
        return sample(self.forward_last_logits(inputs), sampling)
