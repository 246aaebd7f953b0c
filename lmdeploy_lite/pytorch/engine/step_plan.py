"""The StepPlan: everything a step needs to know about the other ranks (DESIGN.md invariant 1).

Built from ONE fixed-shape all-gather of an int64 row per rank on the CPU group
`DistContext.plan`. Every padded size of the step is a pure function of it; nothing else
decides a size.

Which ranks the plan spans: the ranks that share a collective inside the step, no more. With
ep > 1 that is the world (the MoE all-to-alls join every rank), so every rank runs every step
and an idle DP rank runs dummy target and draft forwards (DESIGN.md invariant 2). With ep = 1 it
is the DP rank's own TP group: TP peers must agree on every size (they all-reduce activations),
but DP ranks share nothing, so each DP rank plans, runs or idles on its own, like vLLM's
pure-DP engines: a rank with no work runs no forward and waits for no one.

Where each size comes from:
  * a rank's token count: `local_row` rounds it up to a multiple of tp (TP ranks split tokens);
  * the CUDA-graph bucket: at least `max_batch_size` (ModelInputs.padded_batch_size);
  * an EP forward's sizes (`forward_sizes` -> ModelInputs.sizes): this rank's tp-aligned token
    count, the largest of any rank (the EP dispatch capacity, an idle rank's dummy included,
    `dummy_tokens_per_seq`), the same two for the draft's one-token-per-sequence forwards, and
    DeepEP's mode (`all_decoding`: low-latency).
  * the step's draft count k (`num_spec`: the verify width k + 1 of a decode step, the drafts
    every step makes): each rank proposes one (spec_decode/policy.py), the plan takes the
    smallest proposal of a working rank, so every rank runs the same shapes and draft loop.
The next step's mixed-step budget, when it follows measured step times (engine/mixed_budget.py),
is agreed the same way: the smallest proposal, applied by every rank's scheduler to its next
step. Whether a step ships extra data is in the plan too (`any_sampled`: TP rank 0's sampled drafts'
distributions go to its peers), so every rank of the group runs the same collectives. So is how
many inbox events (requests, aborts, stop) each rank has received: TP peers each read the same
events in the same order from their own inbox and admit, before the next step, as many as the
fewest of them has (`fewest_events`): one collective a step, none of its own for admission."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from lmdeploy_lite.pytorch.model_inputs import ForwardSizes

FIELDS = ('num_tokens', 'batch_size', 'is_decoding', 'has_work', 'shutdown', 'sampled', 'num_spec',
          'mixed_budget', 'num_events')
(_NUM_TOKENS, _BATCH, _DECODING, _WORK, _SHUTDOWN, _SAMPLED, _NUM_SPEC,
 _MIXED_BUDGET, _NUM_EVENTS) = range(len(FIELDS))


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _any(field: int) -> property:
    return property(lambda self: any(self._columns[field]))


@dataclass(frozen=True)
class StepPlan:
    rows: torch.Tensor          # [dist_ctx.plan.size, len(FIELDS)] int64
    tp: int = 1

    @staticmethod
    def local_row(batch, tp: int, shutdown: bool, sampled: bool = False, num_spec: int = 0,
                  mixed_budget: int = 0, num_events: int = 0) -> torch.Tensor:
        """This rank's row: `sampled`: some row is not greedy; `num_spec`: this rank's proposal
        (a decode batch's tokens counted at that width); `mixed_budget`: its proposal for the
        next step's mixed-step chunk tokens, beside each rank's own decode rows (0: none);
        `num_events`: the inbox events it has received so far."""
        if batch is None:
            return torch.tensor([0, 0, 0, 0, int(shutdown), 0, 0, 0, num_events],
                                dtype=torch.int64)
        tokens = ((1 + num_spec) * len(batch.seqs) if batch.is_decoding else sum(batch.q_lens))
        return torch.tensor([round_up(tokens, tp), len(batch.seqs), int(batch.is_decoding), 1,
                             int(shutdown), int(sampled), num_spec, mixed_budget, num_events],
                            dtype=torch.int64)

    @classmethod
    def gather(cls, batch, dist_ctx, shutdown: bool = False, sampled: bool = False,
               num_spec: int = 0, mixed_budget: int = 0, num_events: int = 0) -> 'StepPlan':
        row = cls.local_row(batch, dist_ctx.config.tp, shutdown, sampled, num_spec, mixed_budget,
                            num_events)
        return cls(dist_ctx.plan.all_gather(row), dist_ctx.config.tp)

    def fewest_events(self, plan_ranks: tuple[int, ...], tp_ranks: tuple[int, ...]) -> int:
        """The fewest inbox events a rank of `tp_ranks` (this rank's TP group; the plan group
        is `plan_ranks`, global ranks in row order) has received."""
        return min(self._columns[_NUM_EVENTS][plan_ranks.index(r)] for r in tp_ranks)

    @cached_property
    def _columns(self) -> list[tuple[int, ...]]:
        """One tuple of ints per field, read once (the properties are on the critical path)."""
        return list(zip(*self.rows.tolist()))

    any_work = _any(_WORK)
    shutdown = _any(_SHUTDOWN)
    any_sampled = _any(_SAMPLED)
    any_decoding = _any(_DECODING)

    def _of_working(self, field: int) -> list[int]:
        return [v for w, v in zip(self._columns[_WORK], self._columns[field]) if w]

    @property
    def all_decoding(self) -> bool:
        """Every rank with work decodes (EP may use DeepEP's fixed-capacity low-latency mode)."""
        busy = self._of_working(_DECODING)
        return bool(busy) and all(busy)

    @cached_property
    def num_spec(self) -> int:
        """The smallest draft count a working rank proposed (0 without speculation)."""
        return min(self._of_working(_NUM_SPEC), default=0)

    @cached_property
    def mixed_budget(self) -> int:
        """The next step's mixed-step chunk tokens (each rank adds its decode rows): the
        smallest proposal of a working rank (0: none)."""
        return min((b for b in self._of_working(_MIXED_BUDGET) if b), default=0)

    @cached_property
    def max_tokens(self) -> int:
        """The largest per-rank token count (EP dispatch capacity), decode rows at `num_spec`."""
        k, tp = self.num_spec, self.tp
        return max(round_up((1 + k) * b, tp) if d else n
                   for n, b, d in zip(*self._columns[_NUM_TOKENS:_DECODING + 1]))

    @property
    def max_batch_size(self) -> int:
        """The largest per-rank batch: every rank's CUDA-graph decode step pads to its bucket."""
        return max(self._columns[_BATCH])

    def forward_sizes(self, num_tokens: int, num_seqs: int, sequence_parallel: bool = False
                      ) -> ForwardSizes:
        """Tp-aligned sizes of this rank's forward (its batch or dummy), the maxima covering an
        idle rank's dummy; `sequence_parallel`: rows split over the TP ranks."""
        idle = not all(self._columns[_WORK])
        max_tokens = max(self.max_tokens, self.dummy_tokens_per_seq if idle else 0)
        max_seqs = max(self.max_batch_size, int(idle))
        sizes = (round_up(n, self.tp) for n in (num_tokens, max_tokens, num_seqs, max_seqs))
        return ForwardSizes(*sizes, self.all_decoding, sequence_parallel)

    @property
    def dummy_tokens_per_seq(self) -> int:
        """An idle rank feeds one sequence shaped like the busiest kind of step in the plan."""
        return 1 + self.num_spec if self.any_decoding else 1
