"""Plain autoregressive decoding: each step feeds every sequence's uncomputed tokens."""
from __future__ import annotations

import torch

from lmdeploy_lite.pytorch.model_inputs import ModelInputs
from lmdeploy_lite.pytorch.strategies.base import Strategy, pack_model_inputs


class ARStrategy(Strategy):

    def make_model_inputs(self, batch, device) -> ModelInputs:
        chunks = [s.token_ids[s.num_computed:s.num_computed + n]
                  for s, n in zip(batch.seqs, batch.q_lens)]
        return pack_model_inputs(chunks, [s.num_computed for s in batch.seqs],
                                 [s.blocks for s in batch.seqs],
                                 [s.state_slot for s in batch.seqs], batch.is_decoding, device)

    def emitted_per_row(self, result) -> torch.Tensor:
        return torch.ones_like(result.output_tokens[:, 0])

    def next_input_ids(self, result, q_len: int) -> torch.Tensor:
        return result.output_tokens[:, 0]            # the token each row just sampled
