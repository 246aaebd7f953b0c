"""CUDA graphs for decode steps and short prefill steps: the one owner of capture and replay.

A `GraphRunner` wraps one decode forward `fn(inputs, *extras) -> Tensor [T, ...]` whose sequences
all feed `q_len` new tokens (the target: 1, or k + 1 under speculation; the MTP draft: k + 1 over
the verified positions, then 1 per draft step). At start-up it captures one graph per batch bucket
into static buffers; a call copies the step's inputs into them, pads the batch to its bucket and
replays. `extras` are tensors with one row per token (e.g. the target hidden the draft consumes).

The bucket is the smallest one >= max(batch, `inputs.padded_batch_size`), which the engine sets
from the StepPlan (the largest batch of any rank the plan spans: the world under EP, so all EP
ranks replay the same shapes; a pure-DP rank's own TP group otherwise). Every rank replays in the
same steps: the bucket is a function of the plan, and `inputs.graphable` (False when EP runs
DeepEP's normal mode this step) is the same on every rank. Collectives replay inside the graph
(DeepEP's low-latency dispatch and combine; TP's NCCL or one-shot all-reduce, the token counts
rounded up to a multiple of tp as the plan rounds them, `ForwardSizes.captured`). Replay runs no
Python, so the collective-trace entries a capture recorded (`recorder`: the DistContext) are
appended on each replay: the per-step trace check sees the same sequence either way. A capture
forbids unsafe CUDA calls only on its own thread (`capture_error_mode='thread_local'`): NCCL's
watchdog thread keeps polling its events. Padding sequences are an idle rank's dummy inputs
(history 0, the reserved block 0 and state row 0): their writes land where no real sequence
reads, and attention/recurrence are per sequence, so real rows are unaffected. On a CPU device
nothing is captured and a call runs `fn` eagerly on the padded static buffers (static-buffer
mode): the padding logic is tested on CPU.

A `PrefillGraphRunner` does the same for the target's prefill and mixed steps of up to a few
hundred tokens, bucketed by token count (its class says how it pads).
"""
from __future__ import annotations

import gc
import logging

import torch

from ...model_inputs import ForwardSizes, ModelInputs

logger = logging.getLogger('lmdeploy_lite')

_BUCKET_STEPS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
# a prefill bucket's smaller variant, in sequences (+ spares): at bucket 768 of the 0.8B, the
# conv1d alone cost 37 us a layer over 257 sequences against 16 over 65 (one H200)
SMALL_BATCH = 64


def batch_buckets(max_batch_size: int) -> list[int]:
    """Captured batch sizes: powers of two then steps of 1.5x, up to and including the max."""
    return [b for b in _BUCKET_STEPS if b < max_batch_size] + [max_batch_size]


def prefill_buckets(max_tokens: int) -> list[int]:
    """Captured token counts of prefill and mixed steps: powers of two from 16, from 1024 also
    the 1.5x steps between them (768, 1536, ..: a long chunk pads by at most a third), and the
    max rounded up to a multiple of 64 (a long row's window holds whole fla chunks)."""
    steps = {2 ** i for i in range(4, max_tokens.bit_length())} | {
        3 << i for i in range(8, max_tokens.bit_length())}
    return sorted(t for t in steps if t < max_tokens) + [-(-max_tokens // 64) * 64]


def long_row(q_lens: list[int], longer_than: int, others_at_most: int) -> int | None:
    """The sequence whose chunk takes fla as a step's long row (gated_delta_rule.long_row_prefill):
    the longest chunk, where it is over `longer_than` tokens and no other chunk is over
    `others_at_most`; else None. The one rule for captured and eager steps alike."""
    row = max(range(len(q_lens)), key=q_lens.__getitem__)
    if q_lens[row] <= longer_than or sum(n > others_at_most for n in q_lens) - (
            q_lens[row] > others_at_most):
        return None
    return row


def eager_step_lens(max_tokens: int, max_q_len: int) -> list[list[int]]:
    """New tokens per sequence of the dummy steps the eager warm-up runs (ModelAgent.warm_eager),
    so that kernels only eager steps launch compile (and fla autotunes) at start-up, not in a
    step while serving (measured on an H200: 1-2.5 s for each attention variant a draft head's
    pass met first, 40 s for fla's varlen form). Two chunks over `max_q_len` (fla's varlen form:
    never captured), then a step in each split class of the prefill attention
    (paged_attention.prefill_num_splits: up to 512, 1024, 2048 tokens, more), which the draft
    head's pass over a prefill step runs eagerly; each at a token count that is a multiple of
    16 and one that is odd with a one-token row (Triton specializes integers on the first, and
    a mixed step's decode rows take a kernel of their own)."""
    over = max_q_len + 64
    shapes = [[over + 1, over, 1], [over, over]] if 2 * over + 1 <= max_tokens else []
    for n in sorted({min(n, max_tokens) for n in (256, 1024, 2048, 4096)}):
        shapes += [[n - 2, 1], [n]] if n > 2 else [[n]]
    return shapes


class _Captured:
    """One forward `fn(inputs, *extras)` captured per key into one memory pool: the capture, its
    collective trace and the replay, for both runners below. A key is a bucket, or what
    `_keys` makes of the buckets (a variant of the forward per bucket), ordered so that the
    largest graph is captured first (smaller ones reuse the pool's memory)."""

    def __init__(self, fn, name: str, buckets: list[int], device: torch.device, pool, recorder):
        self.fn, self.name = fn, name
        # the DistContext (or None): `.trace`, the collective-trace entries replays extend,
        # and `.config.tp`, the multiple the captured token counts are rounded up to
        self.recorder = recorder
        self.tp = recorder.config.tp if recorder is not None else 1
        self.traces: dict = {}             # key -> the entries its capture recorded
        self.buckets, self.device = sorted(buckets), device
        self.use_graphs, self.pool = device.type == 'cuda', pool
        self.num_replays = 0
        self.reserved_bytes = 0            # what capturing them added to the reserved memory
        self.graphs: dict = {}             # key -> its torch.cuda.CUDAGraph
        self.outputs: dict = {}

    def _keys(self) -> list:
        return self.buckets

    def _run_static(self, key) -> torch.Tensor:
        """`fn` on the static buffers of `key`. The inputs are built anew for each run, so a
        capture records what ops derive from them (op_cache) and replays derive it again."""
        raise NotImplementedError

    @torch.inference_mode()
    def capture(self):
        """Capture every key, largest first (smaller graphs reuse the pool's memory)."""
        if not self.use_graphs:
            return
        reserved = torch.cuda.memory_reserved(self.device)
        stream = torch.cuda.Stream(self.device)   # one for every warm-up: one set of cached blocks
        for key in reversed(self._keys()):
            self._before_capture(key)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):          # warm-up: Triton compiles, lazy inits
                self._run_static(key)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            start = len(self.recorder.trace) if self.recorder is not None else 0
            # no garbage collection inside the capture: it may free another engine's graphs,
            # and destroying a graph while a stream captures invalidates the capture
            # (torch.cuda.graph collects once before it starts)
            collecting = gc.isenabled()
            gc.disable()
            try:
                with torch.cuda.graph(graph, pool=self.pool, capture_error_mode='thread_local'):
                    self.outputs[key] = self._run_static(key)
            finally:
                if collecting:
                    gc.enable()
            if self.recorder is not None:
                self.traces[key] = list(self.recorder.trace[start:])
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[key] = graph
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()                 # the warm-ups' blocks; the graphs keep their pool
        self.reserved_bytes = max(0, torch.cuda.memory_reserved(self.device) - reserved)
        logger.info('%s: captured CUDA graphs for %s (%.0f MiB more reserved)', self.name,
                    self.describe(), self.reserved_bytes / 2**20)

    def describe(self) -> str:
        return f'buckets {self.buckets}'

    def _before_capture(self, key):
        pass

    def bucket_for(self, inputs: ModelInputs) -> int | None:
        raise NotImplementedError

    def can_run(self, inputs: ModelInputs) -> bool:
        return self.bucket_for(inputs) is not None

    def _copy_inputs(self, inputs: ModelInputs, tokens: int):
        """The step's tokens and per-sequence rows into the static buffers' first rows."""
        batch, width = inputs.batch_size, inputs.block_tables.shape[1]
        self.input_ids[:tokens].copy_(inputs.input_ids)
        self.positions[:tokens].copy_(inputs.positions)
        self.history_lens[:batch].copy_(inputs.history_lens)
        self.block_tables[:batch, :width].copy_(inputs.block_tables)
        self.state_slots[:batch].copy_(inputs.state_slots)
        self.state_index[:batch].copy_(inputs.state_index)

    def _replay(self, key, rows: int) -> torch.Tensor:
        """The first `rows` rows of the key's output, once the static buffers are filled."""
        self.num_replays += 1
        if not self.use_graphs:
            return self._run_static(key)[:rows]
        self.graphs[key].replay()
        if self.recorder is not None:
            self.recorder.trace.extend(self.traces[key])
        return self.outputs[key][:rows]


class GraphRunner(_Captured):
    """One decode forward with `q_len` tokens per sequence, captured for each batch bucket.
    max_blocks: block-table width of the static buffers (the most blocks a sequence can use);
    extras: (row shape, dtype) of each extra per-token input."""

    def __init__(self, fn, name: str, q_len: int, buckets: list[int], max_blocks: int,
                 extras: list[tuple[tuple[int, ...], torch.dtype]], device: torch.device,
                 pool=None, recorder=None):
        super().__init__(fn, name, buckets, device, pool, recorder)
        self.q_len, self.max_blocks = q_len, max_blocks
        max_batch = self.buckets[-1]
        max_tokens = max_batch * q_len
        long = dict(dtype=torch.long, device=device)
        self.input_ids, self.positions = (torch.zeros(max_tokens, **long) for _ in range(2))
        self.q_lens = torch.full((max_batch,), q_len, **long)
        self.history_lens, self.state_slots, self.state_index = (
            torch.zeros(max_batch, **long) for _ in range(3))
        self.block_tables = torch.zeros(max_batch, max_blocks, **long)
        self.extras = [torch.zeros((max_tokens,) + tuple(shape), dtype=dtype, device=device)
                       for shape, dtype in extras]

    def describe(self) -> str:
        return f'batches {self.buckets} (q_len {self.q_len})'

    def _run_static(self, batch: int) -> torch.Tensor:
        tokens = batch * self.q_len
        inputs = ModelInputs(
            input_ids=self.input_ids[:tokens], positions=self.positions[:tokens],
            q_lens=self.q_lens[:batch], history_lens=self.history_lens[:batch],
            block_tables=self.block_tables[:batch], state_slots=self.state_slots[:batch],
            state_index=self.state_index[:batch], is_decoding=True, uniform_q_len=self.q_len,
            sizes=ForwardSizes.captured(tokens, batch, self.tp))
        return self.fn(inputs, *(x[:tokens] for x in self.extras))

    def bucket_for(self, inputs: ModelInputs) -> int | None:
        """The bucket this step replays, or None when it must run eagerly."""
        if (not inputs.is_decoding or not inputs.graphable or inputs.uniform_q_len != self.q_len
                or inputs.block_tables.shape[1] > self.max_blocks):
            return None
        need = max(inputs.batch_size, inputs.padded_batch_size)
        return next((b for b in self.buckets if b >= need), None)

    @torch.inference_mode()
    def __call__(self, inputs: ModelInputs, *extras: torch.Tensor) -> torch.Tensor:
        bucket, batch = self.bucket_for(inputs), inputs.batch_size
        tokens, padded_tokens = batch * self.q_len, bucket * self.q_len
        self._copy_inputs(inputs, tokens)
        for static, value in zip(self.extras, extras):
            static[:tokens].copy_(value)
        if bucket > batch:        # padding sequences: the dummy shape (reserved block and row)
            for buf in (self.history_lens, self.block_tables, self.state_slots, self.state_index):
                buf[batch:bucket].zero_()
            self.input_ids[tokens:padded_tokens].zero_()
            self.positions[tokens:padded_tokens].zero_()
        return self._replay(bucket, tokens)


class PrefillGraphRunner(_Captured):
    """The target's prefill and mixed steps (any lengths, at most `max_q_len` new tokens per
    sequence but one), captured per token bucket: a step of T tokens and B sequences replays the
    smallest bucket >= T, whose static buffers hold `min(bucket, max_seqs)` sequences and its
    spare ones, enough that none takes more than `max_seq_tokens` (a sequence's block table
    width in tokens; at least one). The bucket's spare tokens are spread over its spare
    sequences, which are idle ranks' dummies (history 0, the reserved block 0 and state row
    0): per-sequence ops keep them apart from the real ones, whose rows the replay returns.
    Inside, ops read no length on the host (`ModelInputs.sync_free`: the attention builds its
    tile map on the device, the gated delta rule takes the recurrent kernel for chunks of up to
    `max_q_len` tokens). With
    `long_row_from` (fla is there), a bucket above it is captured twice:
    once with one sequence, `long_row`, that takes fla's chunk kernel over the bucket's width
    (gated_delta_rule.long_row_prefill), replayed for a step whose longest chunk is over
    `long_row_from` (then it may be over `max_q_len` too); once without, replayed for the other
    steps, which fla would only have cost its pass over the bucket (~1 ms in 18 layers at 768
    tokens, the 0.8B). Eager steps split their rows by the same rule (the same bits).
    A bucket that holds more than SMALL_BATCH sequences is also captured with SMALL_BATCH (and
    its spares), replayed for steps of at most SMALL_BATCH: per-sequence kernels (the conv1d's
    window, the gated delta rule's one-token rows) launch programs for every sequence, spare
    ones too.
    Keys: (bucket, sequences, long)."""

    def __init__(self, fn, name: str, buckets: list[int], max_seqs: int, max_q_len: int,
                 max_blocks: int, device: torch.device, pool=None, recorder=None,
                 long_row_from: int = 0, max_seq_tokens: int = 0):
        super().__init__(fn, name, buckets, device, pool, recorder)
        self.max_q_len, self.max_blocks, self.long_row_from = max_q_len, max_blocks, long_row_from
        self.spares = {b: -(-b // max_seq_tokens) if max_seq_tokens else 1 for b in self.buckets}
        self.seqs = {b: sorted({min(b, n, max_seqs) + self.spares[b]
                                for n in (SMALL_BATCH, max_seqs)}) for b in self.buckets}
        max_tokens, most = self.buckets[-1], max(max(n) for n in self.seqs.values())
        long = dict(dtype=torch.long, device=device)
        self.input_ids, self.positions = (torch.zeros(max_tokens, **long) for _ in range(2))
        self.q_lens, self.history_lens, self.state_slots, self.state_index = (
            torch.zeros(most, **long) for _ in range(4))
        self.block_tables = torch.zeros(most, max_blocks, **long)
        self.long_row = torch.zeros(1, **long)

    def _keys(self) -> list[tuple[int, int, bool]]:
        return sorted((b, n, long) for b in self.buckets for n in self.seqs[b]
                      for long in {False, self.has_long_row(b)})

    def describe(self) -> str:
        return f'buckets {self.buckets}, sequences {self.seqs}'

    def _before_capture(self, key: tuple[int, int, bool]):
        self._pad(*key[:2], 0, 0)            # capture-time lengths: every token a spare one
        self.long_row.zero_()

    def _pad(self, bucket: int, seqs: int, tokens: int, batch: int):
        """Spare sequences batch..seqs of the bucket take its tokens after `tokens`, evenly."""
        spare, extra = seqs - batch, bucket - tokens
        for buf in (self.history_lens, self.block_tables, self.state_slots, self.state_index):
            buf[batch:seqs].zero_()
        self.q_lens[batch:seqs].fill_(extra // spare)
        self.q_lens[batch:batch + extra % spare] += 1
        self.input_ids[tokens:bucket].zero_()
        self.positions[tokens:bucket].zero_()

    def _run_static(self, key: tuple[int, int, bool]) -> torch.Tensor:
        bucket, seqs, long = key
        inputs = ModelInputs(
            input_ids=self.input_ids[:bucket], positions=self.positions[:bucket],
            q_lens=self.q_lens[:seqs], history_lens=self.history_lens[:seqs],
            block_tables=self.block_tables[:seqs], state_slots=self.state_slots[:seqs],
            state_index=self.state_index[:seqs], is_decoding=False, sync_free=True,
            long_row=self.long_row if long else None,
            sizes=ForwardSizes(*(-(-n // self.tp) * self.tp for n in (bucket, bucket, seqs,
                                                                       seqs))))
        return self.fn(inputs)

    def bucket_for(self, inputs: ModelInputs) -> tuple[int, int] | None:
        """(bucket, sequences) this step replays: the smallest bucket of enough tokens and
        sequences, its fewest that hold the step's and the spares its tokens may need. None
        when it must run eagerly (a decode step, too many tokens or sequences, two chunks
        longer than `max_q_len`, or one without long rows, rows split over TP ranks, lengths
        the host does not know)."""
        if (inputs.is_decoding or not inputs.graphable or inputs.host_lens is None
                or inputs.block_tables.shape[1] > self.max_blocks
                or (inputs.sizes is not None and inputs.sizes.sequence_parallel)):
            return None
        if inputs.max_q_len > self.max_q_len and (not self.long_row_from or sum(
                n > self.max_q_len for n in inputs.host_q_lens) > 1):
            return None
        tokens, batch = inputs.num_tokens, inputs.batch_size
        return next(((b, n) for b in self.buckets if b >= tokens for n in self.seqs[b]
                     if n - self.spares[b] >= batch), None)

    @torch.inference_mode()
    def __call__(self, inputs: ModelInputs) -> torch.Tensor:
        bucket, seqs = self.bucket_for(inputs)
        tokens, batch = inputs.num_tokens, inputs.batch_size
        self._copy_inputs(inputs, tokens)
        self.q_lens[:batch].copy_(inputs.q_lens)
        self._pad(bucket, seqs, tokens, batch)
        # bucket_for let at most one chunk over max_q_len in
        row = (long_row(inputs.host_q_lens, self.long_row_from, self.max_q_len)
               if self.has_long_row(bucket) else None)
        if row is not None:
            self.long_row.fill_(row)
        return self._replay((bucket, seqs, row is not None), tokens)

    def has_long_row(self, bucket: int) -> bool:
        """Whether the bucket has a graph that gives a sequence to fla as the long row."""
        return 0 < self.long_row_from < bucket
