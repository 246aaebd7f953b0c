"""User-facing configs and results. Configs are frozen and validated once, in `__post_init__`."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

DTYPES = ('auto', 'float32', 'float64', 'bfloat16', 'float16')
DEVICES = ('auto', 'cpu', 'cuda')
EXECUTOR_BACKENDS = ('uni', 'mp', 'ray')
SPEC_METHODS = ('qwen3_5_mtp', 'ngram')
LOAD_FORMATS = ('auto', 'dummy')     # 'dummy': random weights from config.json alone (benchmarks)


def _check(ok: bool, field_name: str, value, allowed: str):
    if not ok:
        raise ValueError(f'{field_name}={value!r}: must be {allowed}')


def _check_int(field_name: str, value, low: int, high: int | None = None):
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= low
    ok = ok and (high is None or value <= high)
    _check(ok, field_name, value, f'an integer in {low}..{high}' if high is not None
           else f'an integer >= {low}')


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 512
    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_words: tuple[str, ...] | list[str] | None = None
    stop_token_ids: tuple[int, ...] | list[int] | None = None
    ignore_eos: bool = False
    random_seed: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self):
        _check_int('max_new_tokens', self.max_new_tokens, 1)
        _check(isinstance(self.temperature, (int, float)) and self.temperature >= 0,
               'temperature', self.temperature, 'a number >= 0')
        _check(isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1,
               'top_p', self.top_p, 'in (0, 1]')
        _check_int('top_k', self.top_k, 0)
        if self.random_seed is not None:
            _check_int('random_seed', self.random_seed, 0)
        for name in ('stop_words', 'stop_token_ids'):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, tuple(value))
        if self.stop_words:
            _check(all(isinstance(w, str) and w for w in self.stop_words),
                   'stop_words', self.stop_words, 'a list of non-empty strings')
        if self.stop_token_ids:
            _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
                   'stop_token_ids', self.stop_token_ids, 'a list of token ids >= 0')

    @property
    def is_greedy(self) -> bool:
        """temperature 0 means greedy even with do_sample (as in lmdeploy and vLLM)."""
        return not self.do_sample or self.temperature == 0


@dataclass(frozen=True)
class SpeculativeConfig:
    """`model=None` drafts with the target checkpoint's own `mtp.*` head. `tp`: the draft
    head's tensor parallelism — None for the target's, or 1 to replicate the MTP layer on every
    rank (its experts too); the draft shares the target's DP layout, embedding and LM head."""
    method: str = 'qwen3_5_mtp'
    num_speculative_tokens: int = 3
    model: str | None = None
    ngram_min: int = 1
    ngram_max: int = 4
    tp: int | None = None

    def __post_init__(self):
        _check(self.method in SPEC_METHODS, 'method', self.method, f'one of {SPEC_METHODS}')
        _check_int('num_speculative_tokens', self.num_speculative_tokens, 1, 8)
        if self.tp is not None:
            _check_int('tp', self.tp, 1)
        _check_int('ngram_min', self.ngram_min, 1)
        _check_int('ngram_max', self.ngram_max, self.ngram_min)


@dataclass(frozen=True)
class PytorchEngineConfig:
    dtype: str = 'auto'
    device: str = 'auto'
    max_batch_size: int = 64
    max_prefill_token_num: int = 4096
    block_size: int = 64
    cache_max_entry_count: float = 0.8
    num_gpu_blocks: int = 0
    session_len: int | None = None
    tp: int = 1
    dp: int = 1
    ep: int = 1
    seed: int = 0
    distributed_executor_backend: str = 'mp'     # 'uni' (one rank), 'mp' (one host) or 'ray'
    load_format: str = 'auto'
    eager_mode: bool = False     # True: no CUDA graphs for decode steps (they are used on CUDA)
    # prepare decode step N+1 while step N runs on the device; None: on with CUDA, off on CPU
    # (where host and device share the cores, so there is nothing to overlap)
    async_scheduling: bool | None = None

    def __post_init__(self):
        _check(self.dtype in DTYPES, 'dtype', self.dtype, f'one of {DTYPES}')
        _check(self.device in DEVICES, 'device', self.device, f'one of {DEVICES}')
        _check_int('max_batch_size', self.max_batch_size, 1)
        _check_int('max_prefill_token_num', self.max_prefill_token_num, 1)
        _check_int('block_size', self.block_size, 1)
        _check(isinstance(self.cache_max_entry_count, (int, float))
               and 0 < self.cache_max_entry_count <= 1,
               'cache_max_entry_count', self.cache_max_entry_count, 'in (0, 1]')
        _check_int('num_gpu_blocks', self.num_gpu_blocks, 0)
        if self.session_len is not None:
            _check_int('session_len', self.session_len, 1)
        for name in ('tp', 'dp', 'ep'):
            _check_int(name, getattr(self, name), 1)
        _check(isinstance(self.eager_mode, bool), 'eager_mode', self.eager_mode, 'True or False')
        _check(self.async_scheduling is None or isinstance(self.async_scheduling, bool),
               'async_scheduling', self.async_scheduling, 'True, False or None (auto)')
        _check(self.distributed_executor_backend in EXECUTOR_BACKENDS,
               'distributed_executor_backend', self.distributed_executor_backend,
               f'one of {EXECUTOR_BACKENDS}')
        _check(self.distributed_executor_backend != 'uni' or self.tp * self.dp == 1,
               'distributed_executor_backend', self.distributed_executor_backend,
               f"'mp' or 'ray' for tp * dp = {self.tp * self.dp} ranks ('uni' runs one rank)")
        _check(self.load_format in LOAD_FORMATS, 'load_format', self.load_format,
               f'one of {LOAD_FORMATS}')


FinishReason = Literal['stop', 'length', 'abort', 'error']


@dataclass
class SpecDecodeStats:
    """Per-request (or engine-wide) speculative-decoding counters."""
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    @property
    def mean_accepted_length(self) -> float:
        """1 + accepted / drafts: tokens emitted per verify step (bonus included)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def add(self, num_draft_tokens: int, num_accepted: int):
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_draft_tokens:
            self.accepted_per_position += [0] * (num_draft_tokens - len(self.accepted_per_position))
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    def merge(self, other: 'SpecDecodeStats'):
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        n = max(len(self.accepted_per_position), len(other.accepted_per_position))
        a = self.accepted_per_position + [0] * (n - len(self.accepted_per_position))
        b = other.accepted_per_position + [0] * (n - len(other.accepted_per_position))
        self.accepted_per_position = [x + y for x, y in zip(a, b)]


@dataclass
class Response:
    text: str
    token_ids: list[int]               # generated ids only (for a stream: this chunk's ids)
    input_token_len: int
    generate_token_len: int
    finish_reason: FinishReason | None = None
    index: int = 0
    spec_stats: SpecDecodeStats | None = None
