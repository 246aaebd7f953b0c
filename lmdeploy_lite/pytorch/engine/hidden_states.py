"""extract_hidden_states: each finished request's hidden states at chosen layers, in a file.
The model keeps transformers' `output_hidden_states[i]` for the chosen ids at every fed token (no
extra collective: under TP the residual stream is whole after each all-reduce; only TP rank 0 of
a DP group keeps rows). The rows reach the host with the step's tokens and are filed by position
(a recomputed sequence overwrites its rows). `DIR/<request id>.safetensors` holds
    hidden_states [T, len(ids), hidden_size]  the model's dtype
    token_ids     [T] int64                   the prompt, then the generated tokens but the last
(T: every token fed) and the ids in its metadata (`aux_hidden_state_layer_ids`, e.g. '2,18,34').
A background thread writes it; the request's last output waits for it and carries the path, or
finish_reason 'error' and why (the engine goes on)."""
from __future__ import annotations

import logging
import os
import queue
import re
import tempfile
import threading

import torch
from safetensors.torch import save_file

logger = logging.getLogger('lmdeploy_lite')

REQUEST_ID = re.compile(r'[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}')


def check_request_id(request_id: str) -> str:
    if not isinstance(request_id, str) or not REQUEST_ID.fullmatch(request_id):
        raise ValueError(f'request_id={request_id!r}: must be 1..128 letters, digits, ".", "_" '
                         f'or "-", not starting with "." (it names the hidden-states file)')
    return request_id


def write_hidden_states(path: str, hidden_states: torch.Tensor, token_ids: list[int],
                        layer_ids: tuple[int, ...]):
    """Atomically: a temporary name next to it, then renamed (a failed write leaves none)."""
    directory, name = os.path.split(path)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f'.{name}.', suffix='.tmp')
    os.close(fd)
    try:
        save_file({'hidden_states': hidden_states.contiguous(),
                   'token_ids': torch.tensor(token_ids, dtype=torch.int64)}, tmp,
                  metadata={'format': 'pt',
                            'aux_hidden_state_layer_ids': ','.join(map(str, layer_ids))})
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


class DirectOutputs:
    """The output stage without extract_hidden_states: each output goes out as it is made."""
    pending = 0

    def add(self, seq, start: int, rows: torch.Tensor):
        pass

    def emit(self, seq, output) -> list:
        return [output]

    def drop(self, seq):
        pass

    def take_done(self, wait_s: float = 0.0) -> list:
        return []


class HiddenStatesWriter(DirectOutputs):
    """Rows per sequence (host tensors [n, len(ids), H] by position) and the thread that writes
    finished sequences' files; every other method runs in the engine's thread."""

    def __init__(self, directory: str, layer_ids: tuple[int, ...]):
        self.directory, self.layer_ids = directory, layer_ids
        self._rows: dict[object, list[torch.Tensor]] = {}      # Sequence -> chunks in order
        self._count: dict[object, int] = {}                     # Sequence -> rows held
        self._jobs, self._done = queue.Queue(), queue.Queue()       # to / from the writer
        self.pending = 0                    # finished sequences whose file is being written
        self._thread = threading.Thread(target=self._run, name='lmdeploy_lite-hidden-states',
                                        daemon=True)
        self._thread.start()

    def add(self, seq, start: int, rows: torch.Tensor):
        """`rows` [n, len(ids), H]: the hidden states of `seq`'s positions start..start+n-1. A
        start before the rows held (recomputed after preemption) replaces the rows from there."""
        if not rows.shape[0]:
            return
        if rows.untyped_storage().nbytes() > rows.nbytes:   # a view would keep the whole
            rows = rows.clone()                              # step's buffer alive
        chunks = self._rows.setdefault(seq, [])
        held = self._count.get(seq, 0)
        if start > held:
            raise RuntimeError(f'hidden states of request {seq.request_id}: rows from position '
                               f'{start} arrived with only {held} held')
        while held > start:                     # drop the rows from `start` on
            held -= chunks[-1].shape[0]
            chunks[-1] = chunks[-1][:max(start - held, 0)]
            if not chunks[-1].shape[0]:
                chunks.pop()
        chunks.append(rows)
        self._count[seq] = start + rows.shape[0]

    def drop(self, seq):
        self._rows.pop(seq, None)
        self._count.pop(seq, None)

    def emit(self, seq, output) -> list:
        """A finished sequence's last output waits for its file: it comes back from `take_done`
        once written (or 'error')."""
        if not seq.is_finished:
            return [output]
        chunks, count = self._rows.pop(seq, []), self._count.pop(seq, 0)
        path = os.path.join(self.directory, f'{seq.request_id}.safetensors')
        self.pending += 1
        self._jobs.put((seq, output, path, chunks, seq.token_ids[:count]))
        return []

    def take_done(self, wait_s: float = 0.0) -> list:
        """Outputs of the files written since the last call (`wait_s` for a first one)."""
        outputs, wait_s = [], wait_s if self.pending else 0
        while True:
            try:
                seq, output, error = self._done.get(timeout=wait_s)
            except queue.Empty:
                return outputs
            self.pending, wait_s = self.pending - 1, 0
            if error is not None:
                logger.warning('request %s failed: %s', seq.request_id, error)
                seq.finish_reason, seq.error = 'error', error
                output.finish_reason, output.error = 'error', error
            outputs.append(output)

    def _run(self):
        while True:
            seq, output, path, chunks, token_ids = self._jobs.get()
            error = None
            try:
                write_hidden_states(path, torch.cat(chunks), token_ids, self.layer_ids)
                output.hidden_states_path = path
            except Exception as e:
                error = f'hidden_states_dir: writing {path} failed: {type(e).__name__}: {e}'
            self._done.put((seq, output, error))
