"""Runs the target model on one rank: forward, logits of the sampling positions, sampling. The
current linear-attention state slot stays on the device (DESIGN.md invariant 7)."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lmdeploy_lite.pytorch.logprobs import token_logprobs
from lmdeploy_lite.pytorch.model_inputs import ModelInputs
from lmdeploy_lite.pytorch.sampling import SamplingInputs, sample
from lmdeploy_lite.pytorch.strategies.base import pack_model_inputs

logger = logging.getLogger(__name__)


@dataclass
class StepResult:
    """output_tokens [B, n] long, -1 padded (n = 1 without speculation); num_accepted_drafts [B]
    long or None (no verify); hidden_states [T, len(ids), H] of every fed token at the extracted
    layers, or None; when a row asked for N logprobs, logprobs [B, n] and top_ids / top_logprobs
    [B, n, N] (logprobs.py), else None."""
    output_tokens: torch.Tensor
    num_accepted_drafts: torch.Tensor | None = None
    hidden_states: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None

    def with_logprobs(self, logits: torch.Tensor, sampling: SamplingInputs) -> 'StepResult':
        """The logprobs from the raw logits [B, n, V] that chose output_tokens, if asked for."""
        if sampling.logprobs is not None:
            self.logprobs, self.top_ids, self.top_logprobs = token_logprobs(
                logits, self.output_tokens, sampling.logprobs)
        return self


class ModelAgent:

    def __init__(self, model, caches, num_state_slots: int, device: torch.device):
        self.model = model
        self.caches = caches
        self.device = device
        # [num_state_slots] long: current recurrent-state slot / conv offset of each state row
        self.state_index = torch.zeros(num_state_slots, dtype=torch.long, device=device)
        # q_len -> GraphRunner for decode steps: 1, or each verify width k + 1
        self.graphs = {}
        self.prefill_graph = None        # PrefillGraphRunner of short prefill and mixed steps
        self.graph_pool = None
        # extract_hidden_states: output_hidden_states ids every forward keeps (then eagerly)
        self.hidden_state_layer_ids: tuple[int, ...] = ()

    @property
    def graph(self):
        """The runner of the widest decode step (None without graphs)."""
        return self.graphs[max(self.graphs)] if self.graphs else None

    def enable_graphs(self, buckets: list[int], max_blocks: int, q_lens: list[int] = (1,),
                      recorder=None, prefill_buckets: list[int] = (), max_prefill_q_len: int = 0,
                      long_row_from: int = 0, max_seq_tokens: int = 0):
        """Capture the decode forward of each width in `q_lens` for each batch bucket and, given
        `prefill_buckets`, prefill and mixed steps of up to that many tokens (at most
        `max_prefill_q_len` per sequence but one with `long_row_from`: PrefillGraphRunner), in one
        memory pool (a step's output is read before the next replay); `recorder`: the
        DistContext whose collective trace replays extend."""
        from lmdeploy_lite.pytorch.backends.cuda.graph_runner import GraphRunner, PrefillGraphRunner
        pool = self.graph_pool
        forward = lambda inputs: self.model(inputs, self.caches)   # noqa: E731
        for q_len in sorted(q_lens, reverse=True):
            runner = GraphRunner(forward, 'target', q_len, buckets, max_blocks, [], self.device,
                                 pool=pool, recorder=recorder)
            runner.capture()
            pool = runner.pool
            self.graphs[q_len] = runner
        if prefill_buckets:
            self.prefill_graph = PrefillGraphRunner(
                forward, 'target prefill', prefill_buckets, max(buckets), max_prefill_q_len,
                max_blocks, self.device, pool=pool, recorder=recorder,
                long_row_from=long_row_from, max_seq_tokens=max_seq_tokens)
            self.prefill_graph.capture()
            pool = self.prefill_graph.pool
        self.graph_pool = pool           # shared with other graphs of this model's forward
        self.load_logits_shapes(max(buckets), q_lens)

    @torch.inference_mode()
    def load_logits_shapes(self, max_batch: int, widths: list[int]):
        """Run the LM head (eager: outside the graphs) once at each row count a step can give it,
        a batch of 1..max_batch times 1 or a verify's width: its GEMM waits for the device the
        first time it meets a shape (measured on an H100: ~10 ms behind a busy device, 0.2 ms the
        next time, for any new row count), so a shape first met while serving stalled the host
        for the running step (the first mixed step after a prompt arrived: ~7 ms). This rank's
        shard only: no collective outside a step. CUDA only (the CPU has no such wait)."""
        if self.device.type != 'cuda':
            return
        weight = self.model.lm_head.weight
        rows = sorted({batch * w for batch in range(1, max_batch + 1) for w in {1, *widths}})
        hidden, start = weight.new_zeros(rows[-1], weight.shape[1]), time.perf_counter()
        for n in rows:
            F.linear(hidden[:n], weight)
        torch.cuda.synchronize(self.device)
        logger.info('LM head: %d row counts loaded in %.2f s', len(rows),
                    time.perf_counter() - start)

    @torch.inference_mode()
    def warm_eager(self, shapes: list[list[int]], block_size: int, then=None):
        """Run the forward eagerly once at each step shape of `shapes` (new tokens per sequence:
        graph_runner.eager_step_lens), on the reserved block 0 and state slot 0 as a graph's
        spare sequences are, so the kernels met only by eager steps compile here; `then(inputs,
        hidden)` after each (the draft head's pass). A one-token row decodes after 64 positions;
        every token is id 1 (id 0 is often padding, whose zero embedding would write zeros).
        One rank (an eager forward of several ranks runs their collectives)."""
        start = time.perf_counter()
        for lens in shapes:
            history = [64 if n == 1 else 0 for n in lens]
            tables = [[0] * -(-(h + n) // block_size) for h, n in zip(history, lens)]
            inputs = pack_model_inputs([[1] * n for n in lens], history, tables, [0] * len(lens),
                                       False, self.device)
            inputs.graphable = False
            hidden = self.forward(inputs)
            if then is not None:
                then(inputs, hidden)
        if self.device.type == 'cuda':
            torch.cuda.synchronize(self.device)
        logger.info('eager steps of %d shapes run in %.2f s (their kernels compiled)', len(shapes),
                    time.perf_counter() - start)

    def forward(self, inputs: ModelInputs) -> torch.Tensor:
        """[T, H] post-final-norm hidden states (cache restores and copies first, saves after)."""
        return self._forward(inputs)[0]

    def _forward(self, inputs: ModelInputs, layer_ids: tuple[int, ...] = ()
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(`forward`'s hidden states, [T, len(layer_ids), H] at those layers or None)."""
        if inputs.state_restores is not None:
            rows, slots = inputs.state_restores.unbind(1)
            self.caches.restore(rows, slots)
            self.state_index[slots] = 0
        if inputs.block_copies is not None:          # forks (n choices): the leader's cache
            self.caches.copy_blocks(inputs.block_copies)
        if inputs.state_copies is not None:
            self.caches.copy_states(inputs.state_copies)
            self.state_index[inputs.state_copies[:, 1]] = 0
        inputs.state_index = self.state_index[inputs.state_slots]
        inputs.state_index_zero = (self.state_index.device.type == 'cpu'
                                   and not bool(inputs.state_index.any()))
        runner = (None if layer_ids else self.graphs.get(inputs.uniform_q_len)
                  if inputs.is_decoding else self.prefill_graph)
        if runner is not None and runner.can_run(inputs):
            hidden, aux = runner(inputs), None
        elif layer_ids:
            hidden, aux = self.model.forward_with_hidden_states(inputs, self.caches, layer_ids)
        else:
            hidden, aux = self.model(inputs, self.caches), None
        if inputs.state_saves is not None:
            slots, rows = inputs.state_saves.unbind(1)
            self.caches.save(slots, rows)
        return hidden, aux

    def set_state_index(self, state_slots: torch.Tensor, index: torch.Tensor | int):
        """After a step: slot `index` holds the state after the last accepted token."""
        if isinstance(index, int):       # no host scalar copied over: no sync with the device
            self.state_index.index_fill_(0, state_slots, index)
        else:
            self.state_index[state_slots] = index

    def last_logits(self, inputs: ModelInputs, hidden: torch.Tensor) -> torch.Tensor:
        """[B, V] logits at each sequence's last fed position."""
        return self.model.compute_logits(hidden[inputs.q_start_loc + inputs.q_lens - 1])

    @torch.inference_mode()
    def step(self, inputs: ModelInputs, sampling: SamplingInputs) -> StepResult:
        hidden, aux = self._forward(inputs, self.hidden_state_layer_ids)
        self.set_state_index(inputs.state_slots, 0)    # prefill and 1-token decode write slot 0
        logits = self.last_logits(inputs, hidden)
        tokens = sample(logits, sampling)[:, None]
        return StepResult(tokens, hidden_states=aux).with_logprobs(logits[:, None], sampling)
