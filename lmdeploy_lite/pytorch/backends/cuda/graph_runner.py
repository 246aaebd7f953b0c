"""CUDA graphs for decode steps: the one owner of capture and replay.

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
"""
from __future__ import annotations

import gc
import logging

import torch

from ...model_inputs import ForwardSizes, ModelInputs

logger = logging.getLogger('lmdeploy_lite')

_BUCKET_STEPS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


def batch_buckets(max_batch_size: int) -> list[int]:
    """Captured batch sizes: powers of two then steps of 1.5x, up to and including the max."""
    return [b for b in _BUCKET_STEPS if b < max_batch_size] + [max_batch_size]


class GraphRunner:
    """One decode forward with `q_len` tokens per sequence, captured for each batch bucket.
    max_blocks: block-table width of the static buffers (the most blocks a sequence can use);
    extras: (row shape, dtype) of each extra per-token input."""

    def __init__(self, fn, name: str, q_len: int, buckets: list[int], max_blocks: int,
                 extras: list[tuple[tuple[int, ...], torch.dtype]], device: torch.device,
                 pool=None, recorder=None):
        self.fn, self.name, self.q_len = fn, name, q_len
        # the DistContext (or None): `.trace`, the collective-trace entries replays extend,
        # and `.config.tp`, the multiple the captured token counts are rounded up to
        self.recorder = recorder
        self.tp = recorder.config.tp if recorder is not None else 1
        self.traces: dict[int, list] = {}  # bucket -> the entries its capture recorded
        self.buckets, self.max_blocks, self.device = sorted(buckets), max_blocks, device
        self.use_graphs, self.pool = device.type == 'cuda', pool
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
        self.num_replays = 0
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.static_inputs: dict[int, ModelInputs] = {}

    def _bucket_inputs(self, batch: int) -> ModelInputs:
        tokens = batch * self.q_len
        return ModelInputs(
            input_ids=self.input_ids[:tokens], positions=self.positions[:tokens],
            q_lens=self.q_lens[:batch], history_lens=self.history_lens[:batch],
            block_tables=self.block_tables[:batch], state_slots=self.state_slots[:batch],
            state_index=self.state_index[:batch], is_decoding=True, uniform_q_len=self.q_len,
            sizes=ForwardSizes.captured(tokens, batch, self.tp))

    def _run_static(self, batch: int) -> torch.Tensor:
        # graphs: inputs built once (their cached derived values are functions of shapes only);
        # static-buffer mode: fresh each call, since the default ops cache host copies of lengths
        inputs = self.static_inputs[batch] if self.use_graphs else self._bucket_inputs(batch)
        return self.fn(inputs, *(x[:batch * self.q_len] for x in self.extras))

    @torch.inference_mode()
    def capture(self):
        """Capture every bucket, largest first (smaller graphs reuse the pool's memory)."""
        if not self.use_graphs:
            return
        for batch in reversed(self.buckets):
            self.static_inputs[batch] = self._bucket_inputs(batch)
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):          # warm-up: Triton compiles, lazy inits
                self._run_static(batch)
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
                    self.outputs[batch] = self._run_static(batch)
            finally:
                if collecting:
                    gc.enable()
            if self.recorder is not None:
                self.traces[batch] = list(self.recorder.trace[start:])
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[batch] = graph
        torch.cuda.synchronize(self.device)
        logger.info('%s: captured CUDA graphs for batches %s (q_len %d)', self.name,
                    self.buckets, self.q_len)

    def bucket_for(self, inputs: ModelInputs) -> int | None:
        """The bucket this step replays, or None when it must run eagerly."""
        if (not inputs.is_decoding or not inputs.graphable or inputs.uniform_q_len != self.q_len
                or inputs.block_tables.shape[1] > self.max_blocks):
            return None
        need = max(inputs.batch_size, inputs.padded_batch_size)
        return next((b for b in self.buckets if b >= need), None)

    def can_run(self, inputs: ModelInputs) -> bool:
        return self.bucket_for(inputs) is not None

    @torch.inference_mode()
    def __call__(self, inputs: ModelInputs, *extras: torch.Tensor) -> torch.Tensor:
        bucket = self.bucket_for(inputs)
        batch, width = inputs.batch_size, inputs.block_tables.shape[1]
        tokens, padded_tokens = batch * self.q_len, bucket * self.q_len
        self.input_ids[:tokens].copy_(inputs.input_ids)
        self.positions[:tokens].copy_(inputs.positions)
        self.history_lens[:batch].copy_(inputs.history_lens)
        self.block_tables[:batch, :width].copy_(inputs.block_tables)
        self.state_slots[:batch].copy_(inputs.state_slots)
        self.state_index[:batch].copy_(inputs.state_index)
        for static, value in zip(self.extras, extras):
            static[:tokens].copy_(value)
        if bucket > batch:        # padding sequences: the dummy shape (reserved block and row)
            for buf in (self.history_lens, self.block_tables, self.state_slots, self.state_index):
                buf[batch:bucket].zero_()
            self.input_ids[tokens:padded_tokens].zero_()
            self.positions[tokens:padded_tokens].zero_()
        self.num_replays += 1
        if not self.use_graphs:
            return self._run_static(bucket)[:tokens]
        self.graphs[bucket].replay()
        if self.recorder is not None:
            self.recorder.trace.extend(self.traces[bucket])
        return self.outputs[bucket][:tokens]

