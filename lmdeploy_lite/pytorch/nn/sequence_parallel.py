"""Sequence parallelism inside a TP group (PytorchEngineConfig.sequence_parallel; Megatron's).

With it on, the residual stream between the TP linear layers is this rank's share of the step's
tokens: `[Tp / tp, H]`, where Tp is the forward's padded token count from the StepPlan
(`ModelInputs.sizes.tokens`, or `.seqs` for a one-token-per-sequence draft step: a multiple of
tp). TP rank r holds rows `[r * Tp / tp, (r + 1) * Tp / tp)`; rows past the real T are zeros
and never read back. Where the communication happens:
  * the embedding reduce-scatters its vocab-parallel partial rows (nn/embedding.py);
  * before the column-parallel projections of a sub-layer (attention qkv, gated-DeltaNet in_proj,
    MLP gate/up, MoE router and experts) the decoder layer all-gathers the normed shard to
    `[Tp, H]` (`gather`), right after the norm;
  * the row-parallel layers (o_proj, out_proj, down_proj, the MoE block's output)
    reduce-scatter their partial sums to `[Tp / tp, H]` instead of all-reducing them;
  * RMSNorms and residual adds run on the shard; the final norm too, then the rows are gathered
    whole for the LM head and the MTP draft.
Which forwards: layers built for it (the config's `sequence_parallel`) split the rows of a forward
whose ForwardSizes say so (`splits_rows`): the engine's prefill and mixed steps. Decode steps run
plain TP: at a few rows per sequence two collectives per sub-layer cost more than one
all-reduce, and the element-wise work saved is small (BENCHMARKS.md, 9B at tp=2).
Per step the bytes on the wire equal plain TP's (an all-reduce is a reduce-scatter plus an
all-gather); the element-wise work and, with EP, the MoE dispatch are 1 / tp of it. Mixers see
`[Tp, H]` and run their kernels on the first T rows (`real_rows` / `restore_rows`). Nothing
here decides a size: Tp comes with the inputs, from the plan.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def is_sequence_parallel(dist_ctx) -> bool:
    """The layers built with `dist_ctx` are built for sequence parallelism (its config says so;
    tp > 1); each forward runs it where `splits_rows` says so."""
    return dist_ctx is not None and getattr(dist_ctx.config, 'sequence_parallel', False)


def splits_rows(inputs) -> bool:
    """This forward runs sequence-parallel: the step's plan says so (`ForwardSizes.
    sequence_parallel`: prefill and mixed steps); layers built for it run plain TP otherwise."""
    return inputs.sizes is not None and inputs.sizes.sequence_parallel


def padded_tokens(inputs) -> int:
    """Tp of this forward: the StepPlan's tp-aligned token count (`ModelInputs.sizes`)."""
    if inputs.sizes is None:
        raise ValueError('a sequence-parallel forward needs ModelInputs.sizes (the StepPlan\'s '
                         'ForwardSizes, engine/step_plan.py), got None')
    return inputs.sizes.tokens


def shard(x: torch.Tensor, num_rows: int, dist_ctx) -> torch.Tensor:
    """Whole rows x [T, ...] -> this TP rank's share [num_rows / tp, ...] of x zero-padded to
    `num_rows` (the plan's Tp); no communication."""
    tp, rank = dist_ctx.config.tp, dist_ctx.tp_rank
    share = num_rows // tp
    if x.shape[0] < num_rows:
        x = F.pad(x, (0, 0) * (x.dim() - 1) + (0, num_rows - x.shape[0]))
    return x[rank * share:(rank + 1) * share]


def gather(x: torch.Tensor, dist_ctx) -> torch.Tensor:
    """This rank's rows [Tp / tp, ...] -> every rank's [Tp, ...] (all-gather over `tp`)."""
    return dist_ctx.tp.gather_rows(x)


def real_rows(hidden: torch.Tensor, inputs) -> torch.Tensor:
    """A mixer's input [Tp, H] -> its T real rows (all of them without sequence parallelism)."""
    num_tokens = inputs.num_tokens
    return hidden if hidden.shape[0] == num_tokens else hidden[:num_tokens]


def restore_rows(out: torch.Tensor, num_rows: int) -> torch.Tensor:
    """A mixer's output [T, D] -> [num_rows, D] (zero rows appended), the rows its row-parallel
    projection reduce-scatters."""
    if out.shape[0] == num_rows:
        return out
    return F.pad(out, (0, 0, 0, num_rows - out.shape[0]))
