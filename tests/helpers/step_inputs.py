"""Build `ModelInputs` for hand-driven model/op tests (the engine's strategy does this for real)."""
from __future__ import annotations

import torch

from lmdeploy_lite.pytorch.model_inputs import ModelInputs


def make_inputs(chunks: list[list[int] | torch.Tensor], history_lens: list[int],
                block_tables: torch.Tensor, state_slots: list[int], state_index: list[int] | None = None,
                is_decoding: bool = False) -> ModelInputs:
    """chunks[b]: the new token ids of sequence b; positions continue from history_lens[b]."""
    chunks = [torch.as_tensor(c, dtype=torch.long) for c in chunks]
    q_lens = [len(c) for c in chunks]
    return ModelInputs(
        input_ids=torch.cat(chunks),
        positions=torch.cat([torch.arange(h, h + n) for h, n in zip(history_lens, q_lens)]),
        q_lens=torch.tensor(q_lens), history_lens=torch.tensor(history_lens),
        block_tables=block_tables, state_slots=torch.tensor(state_slots),
        state_index=torch.tensor(state_index or [0] * len(chunks)), is_decoding=is_decoding,
        uniform_q_len=q_lens[0] if is_decoding and len(set(q_lens)) == 1 else None)


def shuffled_block_tables(batch: int, blocks_per_seq: int, seed: int = 0) -> torch.Tensor:
    """[batch, blocks_per_seq] distinct, non-contiguous block ids (block 0 left unused)."""
    perm = torch.randperm(batch * blocks_per_seq, generator=torch.Generator().manual_seed(seed)) + 1
    return perm.view(batch, blocks_per_seq)
