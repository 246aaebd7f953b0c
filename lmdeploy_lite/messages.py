"""User-facing configs (the results are in results.py, re-exported here as in lmdeploy). Configs
are frozen and validated once, in `__post_init__`."""
from __future__ import annotations

import math
import os
import numbers
from dataclasses import dataclass

from lmdeploy_lite.results import (FinishReason, Response, SpecDecodeStats,  # noqa: F401
                                   TokenLogprobs)
from lmdeploy_lite.structured import check_response_format

DTYPES = ('auto', 'float32', 'float64', 'bfloat16', 'float16')
DEVICES = ('auto', 'cpu', 'cuda')
EXECUTOR_BACKENDS = ('uni', 'mp', 'ray')
SPEC_METHODS = ('qwen3_5_mtp', 'ngram', 'extract_hidden_states')
LOAD_FORMATS = ('auto', 'dummy')     # 'dummy': random weights from config.json alone (benchmarks)
SSM_STATE_DTYPES = ('auto', 'float32', 'bfloat16')

INT32_MAX = 2**31 - 1        # the engine's int tensors (top_k, token ids, lengths, positions)
UINT64_MAX = 2**64 - 1       # torch.Generator.manual_seed takes 0..2**64-1
MAX_N = 16                   # GenerationConfig.n: choices per prompt
# Below these floors sampling is greedy: a smaller temperature (vLLM's _SAMPLING_EPS) overflows
# logits / temperature in float32, and a smaller top_p keeps only the most likely token anyway.
GREEDY_TEMPERATURE = 1e-5
GREEDY_TOP_P = 1e-8
# Penalty ranges: repetition_penalty 10 already makes any repeat all but impossible (smaller p
# divide logits towards overflow); presence and frequency as OpenAI's API allows.
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 10.0
MAX_OPENAI_PENALTY = 2.0
MAX_LOGPROBS = 20            # top logprobs per token a request may ask for (as OpenAI's chat)
# SpeculativeConfig's fields that one method alone reads (None with the others)
METHOD_FIELDS = {'tp': 'qwen3_5_mtp', 'ep': 'qwen3_5_mtp', 'draft_token_map': 'qwen3_5_mtp',
                 'aux_hidden_state_layer_ids': 'extract_hidden_states',
                 'hidden_states_dir': 'extract_hidden_states'}
_MAX_REPR = 40


def short_repr(value) -> str:
    """repr(value), cut short for huge values (a 10**309 int prints as its first digits)."""
    try:
        text = repr(value)
    except ValueError:                           # an int past Python's str-conversion limit
        return (f'<int of {value.bit_length()} bits>' if isinstance(value, int)
                else f'<{type(value).__name__} too large to print>')
    return text if len(text) <= _MAX_REPR else f'{text[:_MAX_REPR - 10]}...({len(text)} chars)'


def _check(ok: bool, field_name: str, value, allowed: str):
    if not ok:
        raise ValueError(f'{field_name}={short_repr(value)}: must be {allowed}')


def is_int(value) -> bool:
    """An integer, not a bool (a plain int first: the ABC check costs ~1 us a field)."""
    return type(value) is int or (isinstance(value, numbers.Integral)
                                  and not isinstance(value, bool))


def _check_int(field_name: str, value, low: int, high: int = INT32_MAX,
               allowed: str | None = None) -> int:
    """An integer (not a bool) in low..high, returned as a plain int."""
    _check(is_int(value) and low <= value <= high, field_name, value,
           allowed or f'an integer in {low}..{high}')
    return int(value)


def _check_float(field_name: str, value, low: float, high: float, allowed: str,
                 low_open: bool = False) -> float:
    """A finite real number (not a bool) in [low, high] ((low, high] with low_open), as a float."""
    ok = type(value) in (float, int) or (isinstance(value, numbers.Real)
                                         and not isinstance(value, bool))
    try:
        number = float(value) if ok else math.nan
    except OverflowError:                        # an int too large for a float
        number = math.nan
    _check(math.isfinite(number) and (number > low if low_open else number >= low)
           and number <= high, field_name, value, allowed)
    return number


def _check_bool(field_name: str, value):
    _check(isinstance(value, bool), field_name, value, 'True or False')


def _check_choice(field_name: str, value, choices: tuple):
    _check(value in choices, field_name, value, f'one of {choices}')


def _check_path(field_name: str, value, allowed: str, empty: bool = True) -> str:
    """A str or os.PathLike (non-empty unless `empty`), as a str."""
    _check(isinstance(value, (str, os.PathLike)) and (empty or os.fspath(value) != ''),
           field_name, value, allowed)
    return os.fspath(value)


def _set(obj, name: str, value):
    object.__setattr__(obj, name, value)          # frozen dataclass: normalise in __post_init__


def _normalise(obj, name: str, check, *args, optional: bool = False, **kwargs):
    """obj.name = check(name, obj.name, *args), its normal form; `optional`: None stays None."""
    if not (optional and getattr(obj, name) is None):
        _set(obj, name, check(name, getattr(obj, name), *args, **kwargs))


@dataclass(frozen=True)
class GenerationConfig:
    """`stop_words`: one str or a list of them; `stop_token_ids`: one int or a list of them
    (stored as tuples). Greedy when do_sample is False, temperature < GREEDY_TEMPERATURE or
    top_p < GREEDY_TOP_P. max_new_tokens past the session ends at session_len ('length').
    Penalties change the target's raw logits before temperature, top-k and top-p, for greedy
    and sampled requests alike (and speculation does not change what they do):
    `repetition_penalty` p (HF/lmdeploy): the logit x of a token found in the prompt or the
    output so far becomes x * p if x < 0, else x / p (1.0: off); `presence_penalty` and
    `frequency_penalty` (OpenAI, as vLLM): logit -= presence * (count > 0) + frequency * count,
    count = the token's occurrences in the output so far (0.0: off).
    `n`: choices per prompt (1..MAX_N), sampled independently from one shared prefill;
    `pipeline()` returns every prompt's n responses, flattened, Response.index = prompt_index *
    n + i. With `random_seed`, choice i draws from seed (random_seed + i) mod 2**64, so choice
    i equals the request run alone with that seed.
    `logprobs`: None (off), or N in 0..MAX_LOGPROBS: each generated token comes back with its
    log-probability and the N most likely tokens' (Response.logprobs), from the target's raw
    logits (before penalties, temperature, top-k and top-p, as vLLM's default).
    `min_p` (vLLM): sampled rows keep the tokens of probability >= min_p x the top one's (after
    temperature, top-k, top-p). `min_tokens`: no stop id (eos, `stop_token_ids`) or stop word
    before this many tokens (`min_new_tokens`: lmdeploy's name for it). `logit_bias` (OpenAI):
    {token id: [-100, 100]} added after the penalties; `bad_token_ids` (lmdeploy): -inf there,
    never emitted. `max_new_tokens=None`: until the session ends (as
    lmdeploy; stored as INT32_MAX). `top_p=0` keeps the most likely token: greedy.
    `response_format`: the output's grammar (structured.py; needs xgrammar). All act on the
    target's logits at each emitted position: speculation does not change them."""
    max_new_tokens: int = 512
    do_sample: bool = False
    temperature: float = 0.8         # lmdeploy's defaults: they matter once do_sample is True
    top_p: float = 1.0
    top_k: int = 50
    stop_words: tuple[str, ...] | list[str] | str | None = None
    stop_token_ids: tuple[int, ...] | list[int] | int | None = None
    ignore_eos: bool = False
    random_seed: int | None = None
    skip_special_tokens: bool = True
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    n: int = 1
    logprobs: int | None = None
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    response_format: dict | None = None
    min_new_tokens: int | None = None
    bad_token_ids: tuple[int, ...] | list[int] | int | None = None
    bad_words: list[str] | None = None        # lmdeploy's; refused: pass bad_token_ids
    # lmdeploy's; only slow tokenizers add such spaces, and transformers 5 loads fast ones
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False  # True: the text ends with the stop word, not before

    def __post_init__(self):
        self.validate()

    def validate(self):
        """Check every field and normalise it (ints, floats, tuples). Runs on construction, and
        again when the engine admits the request (a frozen dataclass can still be changed)."""
        if self.max_new_tokens is None:
            _set(self, 'max_new_tokens', INT32_MAX)
        _normalise(self, 'max_new_tokens', _check_int, 1)
        for name in ('do_sample', 'ignore_eos', 'skip_special_tokens',
                     'spaces_between_special_tokens', 'include_stop_str_in_output'):
            _check_bool(name, getattr(self, name))
        _normalise(self, 'temperature', _check_float, 0, math.inf, 'a finite number >= 0')
        _normalise(self, 'top_p', _check_float, 0, 1, 'a number in [0, 1] (0: greedy)')
        _normalise(self, 'top_k', _check_int, 0)
        _normalise(self, 'n', _check_int, 1, MAX_N)
        _normalise(self, 'random_seed', _check_int, 0, UINT64_MAX, optional=True)
        _normalise(self, 'repetition_penalty', _check_float, MIN_REPETITION_PENALTY,
                   MAX_REPETITION_PENALTY, f'a number in [{MIN_REPETITION_PENALTY}, '
                   f'{MAX_REPETITION_PENALTY:g}] (1.0: off; above 1 discourages repeats)')
        for name in ('presence_penalty', 'frequency_penalty'):
            _normalise(self, name, _check_float, -MAX_OPENAI_PENALTY, MAX_OPENAI_PENALTY,
                       f'a number in [-{MAX_OPENAI_PENALTY:g}, {MAX_OPENAI_PENALTY:g}] (0.0: off)')
        _normalise(self, 'min_p', _check_float, 0, 1, 'a number in [0, 1] (0: off)')
        _normalise(self, 'min_tokens', _check_int, 0, self.max_new_tokens)
        if self.min_new_tokens is not None:
            _normalise(self, 'min_new_tokens', _check_int, 0, self.max_new_tokens)
            _check(self.min_tokens in (0, self.min_new_tokens), 'min_new_tokens',
                   self.min_new_tokens, f'equal to min_tokens={self.min_tokens} when both are '
                   f'given (it is lmdeploy\'s name for min_tokens)')
            _set(self, 'min_tokens', self.min_new_tokens)
        if (bias := self.logit_bias) is not None:
            _check(isinstance(bias, dict) and all(is_int(t) and 0 <= t <= INT32_MAX and type(v)
                                                  in (int, float) and -100 <= v <= 100
                                                  for t, v in bias.items()),
                   'logit_bias', bias, 'a dict of token id -> a number in [-100, 100]')
            _set(self, 'logit_bias', {int(t): float(v) for t, v in bias.items()} or None)
        if self.response_format is not None:
            _set(self, 'response_format', check_response_format(self.response_format))
        _normalise(self, 'logprobs', _check_int, 0, MAX_LOGPROBS, optional=True,
                   allowed=f'None (off) or an integer in 0..{MAX_LOGPROBS} (the top tokens '
                   f'returned with each generated token)')
        _check(not self.bad_words, 'bad_words', self.bad_words, 'None here; ban the words\' '
               'tokens by id with bad_token_ids (tokenizer.encode(word, add_special_tokens='
               'False))')
        words = self.stop_words
        if words is not None:
            words = (words,) if isinstance(words, str) else words    # one str is one stop word
            _check(isinstance(words, (list, tuple))
                   and all(isinstance(w, str) and w and is_unicode(w) for w in words),
                   'stop_words', self.stop_words, 'a non-empty str or a list of them '
                   '(valid unicode)')
            _set(self, 'stop_words', tuple(words))
        for name in ('stop_token_ids', 'bad_token_ids'):
            ids = getattr(self, name)
            if ids is not None:
                ids = (ids,) if is_int(ids) else ids
                _check(isinstance(ids, (list, tuple))
                       and all(is_int(t) and 0 <= t <= INT32_MAX for t in ids), name,
                       getattr(self, name), f'a token id or a list of them, each in 0..{INT32_MAX}')
                _set(self, name, tuple(int(t) for t in ids))

    @property
    def is_greedy(self) -> bool:
        """temperature 0 means greedy even with do_sample (as in lmdeploy and vLLM); so do the
        values below the floors (GREEDY_TEMPERATURE, GREEDY_TOP_P)."""
        return (not self.do_sample or self.temperature < GREEDY_TEMPERATURE
                or self.top_p < GREEDY_TOP_P)

    @property
    def has_penalties(self) -> bool:
        """Logits changed by the host's per-step tables (sampling.Penalties)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0 or self.min_tokens > 0 or bool(self.logit_bias)
                or bool(self.bad_token_ids))


def is_unicode(text: str) -> bool:
    """False for a str holding a lone surrogate (it cannot be encoded or ever be generated)."""
    return text.encode('utf-8', 'surrogatepass').decode('utf-8', 'replace') == text


@dataclass(frozen=True)
class SpeculativeConfig:
    """`model=None` drafts with the target checkpoint's own `mtp.*` head.
    The draft's own layout (DESIGN.md invariant 6; dp is always the target's, and the draft
    shares the target's embedding, LM head and block table):
      `tp`: None for the target's tp, else a divisor of it (1: the MTP layer whole on every
            rank; 1 < tp < the target's: sharded over consecutive runs of `tp` ranks of each TP
            group). TP rank 0's drafts are what every rank verifies.
      `ep`: None for the target's ep; 1: the MTP layer's experts replicated on every rank
            (TP-split over the draft's tp instead of dispatched); or the target's ep.
    Ranges are checked here; the cross-check against the target's layout (a divisor of its tp,
    its ep) is `check_speculative_config`, run before any rank starts.
    `num_speculative_tokens`: the most drafts a step verifies. `dynamic`: each step's draft
    count in 0..num_speculative_tokens follows the batch size and the measured acceptance, so
    speculation never runs slower than plain decoding; False: always the full count.
    `draft_token_map`: a file of the token ids the MTP draft may propose (a JSON list, or a
    safetensors file with an int64 tensor `token_map`), most frequent first, checked at
    start-up; the draft's LM head scores only those ids, the output is still the target's.
    method='extract_hidden_states' drafts nothing: each finished request's hidden states at
    `aux_hidden_state_layer_ids` (transformers' `output_hidden_states[i]`: 0 the embedding
    output, L the final-normed state) go to `hidden_states_dir/<request id>.safetensors` (README
    "Extracting hidden states"); the upper bound and the directory are checked at start-up."""
    method: str = 'qwen3_5_mtp'
    num_speculative_tokens: int = 3
    model: str | None = None
    ngram_min: int = 1
    ngram_max: int = 4
    tp: int | None = None
    ep: int | None = None
    dynamic: bool = True
    draft_token_map: str | None = None
    aux_hidden_state_layer_ids: tuple[int, ...] | list[int] | None = None
    hidden_states_dir: str | None = None

    def __post_init__(self):
        _check_choice('method', self.method, SPEC_METHODS)
        for name, method in METHOD_FIELDS.items():
            _check(getattr(self, name) is None or self.method == method, name,
                   getattr(self, name), f'None with method={self.method!r} (only {method} '
                   f'reads it)')
        if self.method == 'extract_hidden_states':
            self._check_extraction()
        _check_int('num_speculative_tokens', self.num_speculative_tokens, 1, 8)
        _check(self.model is None or isinstance(self.model, str), 'model', self.model,
               'None (the target checkpoint) or a path')
        _normalise(self, 'tp', _check_int, 1, optional=True)
        _normalise(self, 'ep', _check_int, 1, optional=True)
        _check_int('ngram_min', self.ngram_min, 1)
        _check_int('ngram_max', self.ngram_max, self.ngram_min)
        _check_bool('dynamic', self.dynamic)
        _normalise(self, 'draft_token_map', _check_path,
                   'None or the path of a JSON or safetensors file', optional=True)

    def _check_extraction(self):
        """The layer ids (a non-empty list of distinct ints >= 0, stored as a tuple; the upper
        bound needs the model) and the directory, both given."""
        for name in ('aux_hidden_state_layer_ids', 'hidden_states_dir'):
            _check(getattr(self, name) is not None, name, None,
                   "given with method='extract_hidden_states'")
        ids = self.aux_hidden_state_layer_ids
        _check(isinstance(ids, (list, tuple)) and len(ids) > 0
               and all(is_int(i) and 0 <= i <= INT32_MAX for i in ids)
               and len(set(ids)) == len(ids), 'aux_hidden_state_layer_ids', ids,
               'a non-empty list of distinct layer ids in 0..num_hidden_layers (0: the '
               'embedding output, num_hidden_layers: the final-normed hidden state)')
        _set(self, 'aux_hidden_state_layer_ids', tuple(int(i) for i in ids))
        _normalise(self, 'hidden_states_dir', _check_path,
                   'the path of a directory (created if missing)', empty=False)


@dataclass(frozen=True)
class PytorchEngineConfig:
    dtype: str = 'auto'
    device: str = 'auto'
    # a model given as a Hugging Face repo id: the hub cache to use and the revision to fetch
    download_dir: str | None = None
    revision: str | None = None
    max_batch_size: int | None = 64          # None (lmdeploy's default): 64
    max_prefill_token_num: int = 4096
    # tokens a step carries at most while sequences decode, decode rows included: a new prompt
    # is prefilled in chunks riding with them (README "Prefill rides with decode"); 0: prefill
    # goes first with the whole max_prefill_token_num budget
    max_mixed_token_num: int = 4096
    # > 1: that budget follows measured step times instead, a step carrying a prompt chunk
    # costing at most this many decode steps of the same batch; 0: the fixed budget
    max_mixed_step_cost: float = 0.0
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
    # 'fp8': a bf16 checkpoint's linear weights quantized block-wise at load, as Qwen's FP8
    # releases store them (lmdeploy's name); None: as stored (an FP8 checkpoint is read as FP8)
    model_format: str | None = None
    eager_mode: bool = False     # True: no CUDA graphs at all (they are used on CUDA)
    # prefill and mixed steps of up to this many tokens (at most one chunk over 512) replay
    # CUDA graphs, captured per token count 16, 32, .. 512, 768, 1024, ..; 0: they run eagerly
    max_prefill_graph_tokens: int = 4096
    # prepare decode step N+1 while step N runs on the device; None: on with CUDA, off on CPU
    # (where host and device share the cores, so there is nothing to overlap)
    async_scheduling: bool | None = None
    # storage dtype of the gated-delta recurrent state (computed in fp32, fp64 for a float64
    # model, whose 'auto' is fp64; else the checkpoint's mamba_ssm_dtype, fp32 when absent)
    ssm_state_dtype: str = 'auto'
    # reuse the KV blocks and linear-attention states of earlier requests' prompt prefixes
    # (README "Prefix caching"); a hit never changes a token
    enable_prefix_caching: bool = True
    # between the TP linear layers each TP rank keeps 1 / tp of the step's tokens (README
    # "Sequence parallelism"); needs tp > 1
    sequence_parallel: bool = False
    # lmdeploy's: every Pipeline call may come from any thread here; 0 (no KV quantization) only
    thread_safe: bool = False
    quant_policy: int = 0

    def __post_init__(self):
        if self.max_batch_size is None:
            _set(self, 'max_batch_size', 64)
        _check_choice('dtype', self.dtype, DTYPES)
        _check_choice('device', self.device, DEVICES)
        for name, low in (('max_batch_size', 1), ('max_prefill_token_num', 1),
                          ('max_mixed_token_num', 0), ('block_size', 1), ('num_gpu_blocks', 0),
                          ('max_prefill_graph_tokens', 0), ('tp', 1), ('dp', 1), ('ep', 1)):
            _check_int(name, getattr(self, name), low)
        _check_float('cache_max_entry_count', self.cache_max_entry_count, 0, 1,
                     'a number in (0, 1]', low_open=True)
        _check(self.max_mixed_step_cost == 0 or (isinstance(self.max_mixed_step_cost, (int, float))
                                                 and self.max_mixed_step_cost > 1),
               'max_mixed_step_cost', self.max_mixed_step_cost,
               '0 (the fixed max_mixed_token_num) or a number > 1 (decode steps a chunk step may '
               'cost)')
        if self.session_len is not None:
            _check_int('session_len', self.session_len, 1)
        world = self.tp * self.dp
        fix = 'ep=1' if world == 1 else f'ep to 1 or {world}'
        _check(self.ep in (1, world), 'ep', self.ep,
               f'1 or tp x dp = {world} (tp={self.tp}, dp={self.dp}): expert parallelism '
               f'shards the experts over every rank; set {fix}, or tp x dp to {self.ep}')
        _check_int('seed', self.seed, 0, UINT64_MAX)
        _check(self.async_scheduling is None or isinstance(self.async_scheduling, bool),
               'async_scheduling', self.async_scheduling, 'True, False or None (auto)')
        _check_choice('distributed_executor_backend', self.distributed_executor_backend,
                      EXECUTOR_BACKENDS)
        _check(self.distributed_executor_backend != 'uni' or world == 1,
               'distributed_executor_backend', self.distributed_executor_backend,
               f"'mp' or 'ray' for tp * dp = {world} ranks ('uni' runs one rank)")
        _check_choice('load_format', self.load_format, LOAD_FORMATS)
        _check(self.model_format in (None, 'fp8'), 'model_format', self.model_format,
               "None (as the checkpoint stores its weights) or 'fp8'")
        _check_choice('ssm_state_dtype', self.ssm_state_dtype, SSM_STATE_DTYPES)
        _check(self.quant_policy == 0, 'quant_policy', self.quant_policy,
               '0: the KV cache is kept unquantized here')
        for name in ('eager_mode', 'enable_prefix_caching', 'sequence_parallel', 'thread_safe'):
            _check_bool(name, getattr(self, name))
        _check(not self.sequence_parallel or self.tp > 1, 'sequence_parallel',
               self.sequence_parallel,
               f'False with tp={self.tp}: sequence parallelism splits tokens over the TP ranks, '
               'so it needs tp > 1')
