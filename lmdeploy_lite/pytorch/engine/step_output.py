"""What a step hands back: device results on their way to the host (`InFlight`), and each sequence's
result (`StepOutput`), copied off the live Sequence so that a consumer a step or more behind the
engine (async scheduling, mp/ray reports) reads the step as it stood."""
from __future__ import annotations

import dataclasses
import functools
import operator
import time
from dataclasses import dataclass

import torch

from lmdeploy_lite.messages import SpecDecodeStats
from lmdeploy_lite.pytorch.distributed import (ENV_TIMEOUT, CollectiveTimeout, DistContext,
                                               dist_timeout_s)
from lmdeploy_lite.pytorch.model_agent import StepResult
from lmdeploy_lite.pytorch.engine.scheduler import ScheduledBatch
from lmdeploy_lite.pytorch.engine.sequence import Sequence
from lmdeploy_lite.pytorch.model_inputs import ModelInputs


class StepOutput:
    """One sequence's result of one step, pickled as it is (`seq` stays behind: None there).
    `logprobs`: (logprob, top N ids, their logprobs) per new token for a request asking N."""
    # what a request's Response carries as it is (pipeline(): Response's fields of these names)
    RESPONSE_FIELDS = ('error', 'num_cached_tokens', 'num_preemptions', 'hidden_states_path')
    __slots__ = ('seq', 'new_token_ids', 'finished', 'finish_reason', 'num_generated',
                 'stats_snapshot', 'logprobs', *RESPONSE_FIELDS)

    def __init__(self, seq: Sequence | None, new_token_ids: list[int],
                 logprobs: list[tuple[float, list[int], list[float]]] | None = None):
        self.seq = seq                          # identity only: its fields move on
        self.new_token_ids = new_token_ids      # tokens emitted this step (none: a non-final chunk)
        self.logprobs = logprobs
        self.finished = seq.is_finished
        self.finish_reason = seq.finish_reason
        self.num_generated = seq.num_generated
        self.error = seq.error if seq.finish_reason == 'error' else None   # why, with 'error'
        self.num_cached_tokens = seq.num_cached_tokens      # prompt tokens from the prefix cache
        self.num_preemptions = seq.num_preemptions
        self.hidden_states_path = None          # extract_hidden_states: set once written
        stats = seq.spec_stats
        self.stats_snapshot = (None if not stats.num_drafts else
                               (stats.num_drafts, stats.num_draft_tokens,
                                stats.num_accepted_tokens, tuple(stats.accepted_per_position),
                                tuple(stats.drafted_per_position)))

    @classmethod
    def refused(cls, error: str) -> 'StepOutput':
        """The only output of a request the engine refused (it never became a Sequence)."""
        out = cls.__new__(cls)
        out.__setstate__({**dict.fromkeys(cls.__slots__), 'new_token_ids': [], 'finished': True,
                          'finish_reason': 'error', 'num_generated': 0, 'error': error,
                          'num_cached_tokens': 0, 'num_preemptions': 0})
        return out

    def __reduce__(self):
        """Pickled as the values in `PICKLED`'s order, without the live Sequence: a rank sends
        every running sequence's output each step (mp's queue pickles them in a thread that
        takes the GIL from the engine's), and a tuple pickles ~3x faster than a dict of names
        (0.84 against 2.4 us an output on the 2-core CPU: 256 outputs, ~0.4 ms a step)."""
        return _unpickle, _pickled_values(self)

    def __setstate__(self, state: dict):
        self.seq = state.pop('seq', None)
        for name, value in state.items():
            setattr(self, name, value)

    @property
    def spec_stats(self) -> SpecDecodeStats | None:
        """The request's speculative counters so far; None until its first draft."""
        if self.stats_snapshot is None:
            return None
        drafts, draft_tokens, accepted, per_position, drafted = self.stats_snapshot
        return SpecDecodeStats(drafts, draft_tokens, accepted, list(per_position), list(drafted))


PICKLED = tuple(name for name in StepOutput.__slots__ if name != 'seq')
_pickled_values = operator.attrgetter(*PICKLED)
_new = functools.partial(StepOutput.__new__, StepOutput)
_setters = tuple(getattr(StepOutput, name).__set__ for name in PICKLED)     # slot descriptors


def _unpickle(*values) -> StepOutput:
    out = _new()
    out.seq = None
    for set_value, value in zip(_setters, values):
        set_value(out, value)
    return out


@dataclass
class InFlight:
    """A launched step's batch, inputs, device results and their `host` copies under way."""
    batch: ScheduledBatch
    inputs: ModelInputs
    result: StepResult
    host: StepResult
    copied: torch.cuda.Event | None

    @classmethod
    def launch(cls, batch, inputs, result: StepResult) -> 'InFlight':
        """Start the non-blocking device-to-host copies."""
        tensors = {f.name: getattr(result, f.name) for f in dataclasses.fields(result)}
        if result.output_tokens.device.type != 'cuda':
            host = {k: t.clone() if t is not None and k != 'hidden_states' else t
                    for k, t in tensors.items()}
            return cls(batch, inputs, result, StepResult(**host), None)
        host = {k: None if t is None else torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                .copy_(t, non_blocking=True) for k, t in tensors.items()}
        copied = torch.cuda.Event()
        copied.record()
        return cls(batch, inputs, result, StepResult(**host), copied)

    def host_result(self, dist: DistContext | None = None) -> StepResult:
        """The results on the host. A CUDA copy is awaited by polling its event for at most the
        collective timeout (LMDEPLOY_LITE_DIST_TIMEOUT): a peer that never joins one of the
        step's device collectives (NCCL, DeepEP) stalls the stream, and the wait then ends in
        CollectiveTimeout naming rank (`dist`'s), step and operation instead of hanging."""
        if self.copied is not None and not self.copied.query():
            timeout, start = dist_timeout_s(), time.monotonic()
            while not self.copied.query():
                waited = time.monotonic() - start
                if waited > timeout:
                    where = f'rank {dist.rank}, step {dist.step}' if dist else 'this rank'
                    raise CollectiveTimeout(
                        f'{where}: waiting for the step\'s results on the device (the copy '
                        f'after its collectives) timed out after {timeout:g} s ({ENV_TIMEOUT})')
                time.sleep(0 if waited < 0.1 else 0.001)    # spin as synchronize() would, then nap
        return self.host


def host_logprobs(result: StepResult) -> tuple[list, list, list] | None:
    """A host StepResult's logprobs [B][n], top ids and top logprobs [B][n][N], or None."""
    if result.logprobs is None:
        return None
    return result.logprobs.tolist(), result.top_ids.tolist(), result.top_logprobs.tolist()


def row_logprobs(logprobs: tuple[list, list, list] | None, row: int, num_emitted: int,
                  num_top: int | None) -> list[tuple[float, list[int], list[float]]] | None:
    """Row `row`'s first `num_emitted` (logprob, top ids, top logprobs), cut to `num_top`."""
    if logprobs is None or num_top is None:
        return None
    chosen, top_ids, top_logprobs = (part[row] for part in logprobs)
    return [(chosen[j], top_ids[j][:num_top], top_logprobs[j][:num_top])
            for j in range(num_emitted)]
