"""The mixed-step token budget from measured step times (`PytorchEngineConfig.max_mixed_step_cost`):
while sequences decode, a step that carries a prefill chunk (beside the decode rows, or in its own
chunk step under speculation) may cost at most `cost` times a decode step of the same batch, so an
arriving prompt is spread over steps instead of stalling every stream.

Measured per batch-size bucket b (powers of two): t(b), a decode step's wall time, recorded only
when the step before was a decode step of the same bucket (with async scheduling a decode step's
wall time is its predecessor's device time); m(b, r), a chunk step's time from its scheduling to
its sampled tokens, per rung r: the step's tokens, decode rows included, rounded up to the token
counts that prefill CUDA graphs capture (16, 32, .. 512, 768, 1024, 1536, .. 8192: a captured
step costs its whole bucket, so a budget between two rungs would pay for padding). The budget is
the largest rung over the decode rows whose m(b, r) <= cost x t(b), trying the next rung up once
while it is unmeasured (the cost is not linear: a chunk that still fits a CUDA graph is far
cheaper than one that does not), at least the smallest, at most the configured
`max_mixed_token_num`. Until a decode step at b is measured (prompts that keep arriving leave
none), the smallest rung's chunk step stands in for t(b). Where even that step costs more than
`cost` x t(b) (on a CPU a prefill-mode step has a fixed cost of ~2.5 decode steps whatever its
chunk), the bound is `FLAT` x the smallest chunk's step instead: a smaller chunk would only
stretch the prompt's prefill. Every rank proposes its chunk (the budget less its decode rows); the
StepPlan applies the smallest proposal of a working rank to the next step's scheduling, each rank
adding its own decode rows (DESIGN.md invariant 1): TP ranks schedule alike whatever their own
clocks say, and DP ranks of different batches under EP get the same chunk, not one rank's rows.
"""
from __future__ import annotations

from lmdeploy_lite.pytorch.backends.cuda.graph_runner import prefill_buckets

RUNGS = tuple(prefill_buckets(8192))   # a step's tokens, its decode rows included: 16 .. 8192
FLAT = 1.25           # a chunk step within this of the smallest chunk's costs the streams nothing


def batch_bucket(batch_size: int) -> int:
    return 1 << max(0, batch_size - 1).bit_length()


class MixedBudget:

    def __init__(self, cost: float, ceiling: int, alpha: float = 0.3):
        self.cost, self.ceiling, self.alpha = cost, ceiling, alpha
        self.decode: dict[int, float] = {}                   # bucket -> seconds a decode step
        self.chunk: dict[tuple[int, int], float] = {}        # (bucket, rung) -> seconds
        self._last_decode: int | None = None                 # bucket of the last decode step

    def _average(self, table: dict, key, seconds: float):
        old = table.get(key)
        table[key] = seconds if old is None else old + self.alpha * (seconds - old)

    def observe_decode(self, batch_size: int, seconds: float):
        bucket = batch_bucket(batch_size)
        if self._last_decode == bucket:
            self._average(self.decode, bucket, seconds)
        self._last_decode = bucket

    def observe_chunk(self, decoding: int, step_tokens: int, seconds: float):
        """A step of `step_tokens` tokens that carried prompt chunks while `decoding` sequences
        decode (beside them: their rows are among its tokens; under speculation, in a chunk
        step of its own)."""
        self._last_decode = None
        if decoding and step_tokens:
            rung = next((r for r in RUNGS if r >= step_tokens), RUNGS[-1])
            self._average(self.chunk, (batch_bucket(decoding), rung), seconds)

    def propose(self, decoding: int) -> int:
        """The budget (decode rows included) of the next step with `decoding` sequences."""
        if not decoding:
            return self.ceiling
        bucket = batch_bucket(decoding)
        rungs = [r for r in RUNGS if r > decoding] or [decoding + RUNGS[0]]
        # while prompts keep arriving no pure decode step runs: the smallest chunk's step
        # stands in for one until it does (and is measured first)
        smallest = self.chunk.get((bucket, rungs[0]))
        decode = self.decode.get(bucket, smallest)
        if decode is None:
            return min(rungs[0], self.ceiling)
        # where even the smallest chunk's step costs more (a fixed cost of a prefill-mode step),
        # shrinking buys nothing: chunks grow while their steps stay near that one's
        limit = max(self.cost * decode, FLAT * (smallest or 0.0))
        total = rungs[0]
        for rung in rungs:
            seconds = self.chunk.get((bucket, rung))
            if seconds is not None and seconds > limit:
                break
            total = rung
            if seconds is None:              # the first rung not measured yet: try it
                break
        return min(total, self.ceiling)
