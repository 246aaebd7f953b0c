"""A draft that gets accepted: the embedded model (trained Qwen3.5-MoE with its MTP head) on code
prompts it continues well, a single-process reference cached per run, and the acceptance floor a
test asserts before it compares anything, so it cannot silently test only the reject-all path.

The embedded model: 4 attention heads / 2 KV heads, linear attention 2 key / 4 value heads,
8 experts: tp=2, dp=2 ep=2 and tp=2 dp=2 ep=4 all fit. Measured on these prompts (float64, CPU,
greedy, 24 new tokens): mean accepted length 1.86 at k=1 (per prompt 1.85..1.92), 2.46 at k=2
(2.30..2.78), 3.06 at k=3 (2.89..3.43); many_prompts(64) with 8 new tokens: 3.05 at k=3. The
random-weight MTP heads of the tiny checkpoints accept almost nothing (1.0).
"""
import atexit
import functools
import os
import shutil
import tempfile

from lmdeploy_lite.api import EMBEDDED_MODEL_DIR
from lmdeploy_lite.messages import (GenerationConfig, PytorchEngineConfig, SpecDecodeStats,
                                    SpeculativeConfig)

TEXTS = ('def fibonacci(n):\n', 'import os\nimport sys\n', 'class Config:\n    def __init__(self',
         'for i in range(10):\n')
BASE = dict(dtype='float64', device='cpu', block_size=16, session_len=128)
GREEDY = GenerationConfig(max_new_tokens=24, ignore_eos=True)
# GREEDY less a third of its steps, for tests whose assertions do not depend on the length (not
# the dynamic-k runs: GREEDY's steps go through the whole K_CYCLE): every prompt still runs
# several verify steps, with mean accepted lengths 1.82 / 2.37 / 2.95 at k = 1 / 2 / 3
SHORT = GenerationConfig(max_new_tokens=16, ignore_eos=True)
# floors on the mean accepted length (1 + accepted / verify steps), with margin below what these
# prompts give (above)
MIN_MEAN_ACCEPTED_LENGTH = {1: 1.5, 2: 1.8, 3: 2.2}


@functools.cache
def model_dir() -> str:
    """The embedded model without its tokenizer (config and weights linked into a temporary
    directory): mp/ray ranks then skip importing transformers, which costs ~5-15 s per pipeline
    start on a 2-core machine. Prompts are token ids; the tokenizer is only needed for stop words
    given as text."""
    path = tempfile.mkdtemp(prefix='lmdeploy_lite_embedded_weights_')
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    for name in os.listdir(EMBEDDED_MODEL_DIR):
        if name == 'config.json' or name.startswith('model') and name.endswith(('.json',
                                                                                '.safetensors')):
            os.symlink(os.path.join(EMBEDDED_MODEL_DIR, name), os.path.join(path, name))
    return path


@functools.cache
def _tokenizer():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(EMBEDDED_MODEL_DIR)


@functools.cache
def prompts() -> tuple[tuple[int, ...], ...]:
    """TEXTS tokenized with the embedded model's tokenizer (3-10 tokens each)."""
    return tuple(tuple(_tokenizer().encode(t)) for t in TEXTS)


def many_prompts(n: int) -> tuple[tuple[int, ...], ...]:
    """n distinct prompts of 3..(2 + n / 4) tokens: prefixes of prompts() followed by their plain
    greedy continuation (code the model wrote, so it drafts well there too)."""
    texts = [p + tuple(ids) for p, ids in zip(prompts(), reference(0).token_ids)]
    out = tuple(texts[i % len(texts)][:3 + i // len(texts)] for i in range(n))
    assert len(set(out)) == n and all(len(p) == 3 + i // len(texts) for i, p in enumerate(out)), \
        f'{n} prompts: the continuations are too short'
    return out


# the draft counts a dynamic run steps through (LMDEPLOY_LITE_SPEC_K_CYCLE, clamped to k):
# every switch up and down, to and from plain decode steps, deterministically
K_CYCLE = '3,0,2,1,3,3,0,1,2,4,4'
# the floor of a dynamic run's mean accepted length (its verify steps have 1..k drafts)
MIN_DYNAMIC_MEAN_ACCEPTED_LENGTH = 1.4


def spec(k: int, **kw) -> SpeculativeConfig | None:
    """The MTP draft with k tokens; None for k=0 (plain decoding). Fixed k (dynamic=False)
    unless told: per-request draft counts are then a function of the requests alone, comparable
    across layouts. A dynamic run's draft counts depend on the policy (and the cycle hook)."""
    kw.setdefault('dynamic', False)
    return SpeculativeConfig(num_speculative_tokens=k, **kw) if k else None


def cycle_draft_counts(monkeypatch):
    """Dynamic runs (this process and the ranks it starts) step through K_CYCLE."""
    monkeypatch.setenv('LMDEPLOY_LITE_SPEC_K_CYCLE', K_CYCLE)


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
    """One single-process run, per prompt: token_ids[i], stats[i] (SpecDecodeStats or None) and
    chunks[i], the number of tokens each step emitted (a chunk > 1 is a run of accepted drafts
    plus the bonus token)."""

    def __init__(self, token_ids: list[list[int]], stats: list, chunks: list[list[int]]):
        self.token_ids, self.stats, self.chunks = token_ids, stats, chunks

    @property
    def counts(self) -> list[tuple]:
        return [counts(s) for s in self.stats]

    def stop_inside_accepted_run(self, i: int) -> tuple[int, int]:
        """(token id, position) for a stop token that ends sequence i strictly inside a step's
        multi-token emission (tokens after it in that step must be dropped): the first such
        position past the middle of its output whose token appears nowhere before it."""
        ids, ends = self.token_ids[i], []
        for n in self.chunks[i]:
            ends += [False] * (n - 1) + [True]
        for pos in range(len(ids) // 2, len(ids)):
            if not ends[pos] and ids[pos] not in ids[:pos]:
                return ids[pos], pos
        raise AssertionError(f'sequence {i} has no fresh token inside an accepted run')


_cache: dict = {}


def reference(k: int, prompt_ids=None, gen=GREEDY, **engine_cfg) -> Reference:
    """The single-process run (Engine on model_dir(), uni executor, BASE updated by engine_cfg:
    float64 on CPU unless told otherwise) of `prompt_ids` (default: all of prompts()) with MTP
    k (0: plain), cached for the session per (k, prompts, gen, config). `gen`: one
    GenerationConfig, or one per prompt (they run as one batch: max_batch_size is the number of
    prompts unless engine_cfg says otherwise, which sizes the state slots and KV blocks, whose
    zeroing is most of an engine's build, to the batch)."""
    from lmdeploy_lite.pytorch.engine.build import build_engine
    prompt_ids = tuple(tuple(p) for p in (prompts() if prompt_ids is None else prompt_ids))
    cfg = {**BASE, 'max_batch_size': len(prompt_ids), **engine_cfg}
    key = (k, prompt_ids, repr(gen), tuple(sorted(cfg.items())))
    if key not in _cache:
        engine = build_engine(model_dir(), PytorchEngineConfig(**cfg), spec(k), progress=False)
        gens = gen if isinstance(gen, (list, tuple)) else [gen] * len(prompt_ids)
        seqs = [engine.add_request(list(p), g) for p, g in zip(prompt_ids, gens, strict=True)]
        chunks = {id(s): [] for s in seqs}
        while engine.has_work:
            for out in engine.step():
                if out.new_token_ids:
                    chunks[id(out.seq)].append(len(out.new_token_ids))
        _cache[key] = Reference([s.generated_ids for s in seqs],
                                [s.spec_stats if k else None for s in seqs],
                                [chunks[id(s)] for s in seqs])
    return _cache[key]


def stream_lagging(pipe, prompt_ids, k: int, gen=GREEDY, stall_s: float = 0.5):
    """Stream `prompt_ids` through `pipe.stream_infer` with a consumer that falls behind where it
    matters: once per request, when that request's chunks so far come within two steps of
    max_new_tokens (2 * (1 + k) tokens), it stalls `stall_s` (a step or more), so the engine or
    the mp/ray front-end's collector has usually delivered the request's last report before the
    consumer takes the next-to-last chunk. Each chunk must be read as it was sent, not from the
    request's live state. Returns (token ids per prompt, joined from the chunks; each prompt's
    final chunk, the one with a finish_reason)."""
    import time
    streamed, finals = [[] for _ in prompt_ids], [None] * len(prompt_ids)
    stalled = set()
    for chunk in pipe.stream_infer([list(p) for p in prompt_ids], gen):
        i = chunk.index
        streamed[i] += chunk.token_ids
        if chunk.finish_reason is not None:
            assert finals[i] is None, f'request {i} finished twice'
            finals[i] = chunk
        elif i not in stalled and len(streamed[i]) >= gen.max_new_tokens - 2 * (1 + k):
            stalled.add(i)
            time.sleep(stall_s)
    return streamed, finals


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


def assert_dynamic_acceptance(stats, k: int, positions: int = 1):
    """A dynamic run verified drafts and accepted enough of them, at each of the first
    `positions` draft positions at least once (ranks at different points of the cycle run the
    smallest proposal, so a many-rank run may rarely draft deep)."""
    stats = total(stats) if isinstance(stats, (list, tuple)) else stats
    assert stats is not None and stats.num_drafts > 0, 'no draft was verified'
    assert stats.mean_accepted_length >= MIN_DYNAMIC_MEAN_ACCEPTED_LENGTH, (
        f'mean accepted length {stats.mean_accepted_length:.2f} at k<={k}: the test would '
        'exercise only the reject-all path')
    per_position = list(stats.accepted_per_position) + [0] * k
    assert all(per_position[i] > 0 for i in range(min(k, positions))), \
        f'no draft accepted at some position: {stats.accepted_per_position}'


def assert_matches_reference(responses, k: int, prompt_ids=None, gen=GREEDY,
                             dynamic: bool = False):
    """Multi-rank `responses` (pipeline Responses, one per prompt, in order) against the single
    process: first the acceptance they exercised is real, then whole sequences equal plain greedy
    (k=0) and single-process MTP k output, then per-request draft counts equal the single
    process's (positions included). `dynamic`: the run chose its draft counts step by step, so
    its counts are its own; whole sequences must still equal plain greedy."""
    got_ids = [list(r.token_ids) for r in responses]
    got_counts = [counts(r.spec_stats) for r in responses]
    plain = reference(0, prompt_ids, gen)
    if dynamic:
        assert_dynamic_acceptance([r.spec_stats for r in responses], k)
        assert got_ids == plain.token_ids
        return
    assert_real_acceptance([r.spec_stats for r in responses], k)
    speculative = reference(k, prompt_ids, gen)
    assert speculative.token_ids == plain.token_ids     # the single process's own invariant
    assert got_ids == plain.token_ids
    assert got_counts == speculative.counts
