"""Sequence parallelism inside a TP group (PytorchEngineConfig.sequence_parallel; Megatron's): the
residual stream between the TP linear layers is this rank's share `[Tp / tp, H]` of the step's
tokens, Tp the StepPlan's padded token count (`ModelInputs.sizes.tokens`, or `.seqs` for a
one-token-per-sequence draft step; a multiple of tp): TP rank r holds rows
`[r * Tp / tp, (r + 1) * Tp / tp)`; rows past the real T are zeros, never read back.
  * the embedding reduce-scatters its vocab-parallel partial rows (nn/embedding.py);
  * right after the norm before a sub-layer's column-parallel projections (attention qkv,
    gated-DeltaNet in_proj, MLP gate/up, MoE router and experts) the decoder layer all-gathers
    the normed shard to `[Tp, H]` (`dist_ctx.tp.gather_rows`);
  * the row-parallel layers (o_proj, out_proj, down_proj, the MoE block's output)
    reduce-scatter their partial sums to `[Tp / tp, H]` instead of all-reducing them;
  * norms and residual adds run on the shard, the final norm too; its rows are then gathered.
Only prefill and mixed steps split rows (`splits_rows`); decode steps run plain TP: at a few rows
per sequence two collectives per sub-layer cost more than one all-reduce (BENCHMARKS.md, 9B at
tp=2). The bytes on the wire equal plain TP's; the element-wise work and, with EP, the MoE
dispatch are 1 / tp of it. Mixers run their kernels on the first T rows (`restore_rows` pads
their output back). Nothing here decides a size: Tp comes with the inputs, from the plan.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def is_sequence_parallel(dist_ctx) -> bool:
    """Layers built with `dist_ctx` are built for sequence parallelism (see `splits_rows`)."""
    return dist_ctx is not None and getattr(dist_ctx.config, 'sequence_parallel', False)


def splits_rows(inputs) -> bool:
    """This forward runs sequence-parallel (the plan's `ForwardSizes.sequence_parallel`)."""
    return inputs.sizes is not None and inputs.sizes.sequence_parallel


def shard(x: torch.Tensor, num_rows: int, dist_ctx) -> torch.Tensor:
    """x [T, ...] zero-padded to `num_rows` (Tp) -> this rank's rows [Tp / tp, ...]; no comms."""
    tp, rank = dist_ctx.config.tp, dist_ctx.tp_rank
    share = num_rows // tp
    if x.shape[0] < num_rows:
        x = F.pad(x, (0, 0) * (x.dim() - 1) + (0, num_rows - x.shape[0]))
    return x[rank * share:(rank + 1) * share]


def restore_rows(out: torch.Tensor, num_rows: int) -> torch.Tensor:
    """A mixer's output [T, D] -> [num_rows, D], zero rows appended (its projection's input)."""
    return out if out.shape[0] == num_rows else F.pad(out, (0, 0, 0, num_rows - out.shape[0]))
