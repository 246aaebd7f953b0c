"""A draft that gets accepted: the embedded model (trained Qwen3.5-MoE with its MTP head) on code
prompts it continues well, a single-process reference cached per run, and the acceptance floor a
test asserts before it compares anything, so it cannot silently test only the reject-all path.

The embedded model: 4 attention heads / 2 KV heads, linear attention 2 key / 4 value heads,
8 experts: tp=2, dp=2 ep=2 and tp=2 dp=2 ep=4 all fit. Measured on these prompts (float64, CPU,
greedy, 24 new tokens): mean accepted length 1.82 at k=1 (every prompt >= 1.85 of 1 + 1), 2.88 at
k=3 (per prompt 2.89..3.43); 2.43 at k=2.
"""
import functools

from lmdeploy_lite.api import EMBEDDED_MODEL_DIR
from lmdeploy_lite.messages import (GenerationConfig, PytorchEngineConfig, SpecDecodeStats,
                                    SpeculativeConfig)

TEXTS = ('def fibonacci(n):\n', 'import os\nimport sys\n', 'class Config:\n    def __init__(self',
         'for i in range(10):\n')
BASE = dict(dtype='float64', device='cpu', block_size=16, session_len=128)
GREEDY = GenerationConfig(max_new_tokens=24, ignore_eos=True)
# floors on the mean accepted length (1 + accepted / verify steps), with margin below what these
# prompts give (1.82 / 2.43 / 2.88); a random-weight head gives 1.0
MIN_MEAN_ACCEPTED_LENGTH = {1: 1.5, 2: 1.8, 3: 2.2}


@functools.cache
def _tokenizer():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(EMBEDDED_MODEL_DIR)


@functools.cache
def prompts() -> tuple[tuple[int, ...], ...]:
    """TEXTS tokenized with the embedded model's tokenizer (3-10 tokens each)."""
    return tuple(tuple(_tokenizer().encode(t)) for t in TEXTS)


def spec(k: int, **kw) -> SpeculativeConfig | None:
    """The MTP draft with k tokens; None for k=0 (plain decoding)."""
    return SpeculativeConfig(num_speculative_tokens=k, **kw) if k else None


def counts(stats: SpecDecodeStats | None) -> tuple:
    """(drafts, draft tokens, accepted tokens, accepted per position): comparable with ==."""
    if stats is None:
        return (0, 0, 0, ())
    return (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens,
            tuple(stats.accepted_per_position))


def total(stats_list) -> SpecDecodeStats:
    """The per-request stats summed (None entries are requests without a draft)."""
    out = SpecDecodeStats()
    for s in stats_list:
        if s is not None:
            out.merge(s)
    return out


class Reference:
    """One single-process run: token_ids[i] and stats[i] (SpecDecodeStats or None) per prompt."""

    def __init__(self, token_ids: list[list[int]], stats: list):
        self.token_ids, self.stats = token_ids, stats

    @property
    def counts(self) -> list[tuple]:
        return [counts(s) for s in self.stats]


_cache: dict = {}


def reference(k: int, prompt_ids=None, gen: GenerationConfig = GREEDY, **engine_cfg) -> Reference:
    """The single-process run (Engine, uni executor, BASE updated by engine_cfg: float64 on CPU
    unless told otherwise) of `prompt_ids` (default: all of prompts()) with MTP k (0: plain),
    cached for the session per (k, prompts, gen, config)."""
    from lmdeploy_lite.pytorch.engine.engine import Engine
    prompt_ids = tuple(tuple(p) for p in (prompts() if prompt_ids is None else prompt_ids))
    cfg = {**BASE, **engine_cfg}
    key = (k, prompt_ids, repr(gen), tuple(sorted(cfg.items())))
    if key not in _cache:
        engine = Engine(EMBEDDED_MODEL_DIR, PytorchEngineConfig(**cfg), spec(k), progress=False)
        seqs = engine.generate([list(p) for p in prompt_ids], gen)
        _cache[key] = Reference([s.generated_ids for s in seqs],
                                [s.spec_stats if k else None for s in seqs])
    return _cache[key]


def assert_real_acceptance(stats, k: int):
    """`stats` (one SpecDecodeStats, or a list of per-request ones, summed) accepted drafts at
    every one of the k positions and reached MIN_MEAN_ACCEPTED_LENGTH[k]."""
    stats = total(stats) if isinstance(stats, (list, tuple)) else stats
    assert stats is not None and stats.num_drafts > 0, 'no draft was verified'
    floor = MIN_MEAN_ACCEPTED_LENGTH[k]
    assert stats.mean_accepted_length >= floor, (
        f'mean accepted length {stats.mean_accepted_length:.2f} < {floor} at k={k} '
        f'({stats.num_accepted_tokens} of {stats.num_draft_tokens} draft tokens accepted): '
        'the test would exercise only the reject-all path')
    per_position = list(stats.accepted_per_position) + [0] * k
    assert all(per_position[i] > 0 for i in range(k)), \
        f'no draft accepted at some position: {stats.accepted_per_position}'


def assert_matches_reference(responses, k: int, prompt_ids=None, gen: GenerationConfig = GREEDY):
    """Multi-rank `responses` (pipeline Responses, one per prompt, in order) against the single
    process: first the acceptance they exercised is real, then whole sequences equal plain greedy
    (k=0) and single-process MTP k output, then per-request draft counts equal the single
    process's (positions included)."""
    got_ids = [list(r.token_ids) for r in responses]
    got_counts = [counts(r.spec_stats) for r in responses]
    assert_real_acceptance([r.spec_stats for r in responses], k)
    plain, speculative = reference(0, prompt_ids, gen), reference(k, prompt_ids, gen)
    assert speculative.token_ids == plain.token_ids     # the single process's own invariant
    assert got_ids == plain.token_ids
    assert got_counts == speculative.counts
