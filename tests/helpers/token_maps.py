"""Token maps for the embedded model's draft (SpeculativeConfig.draft_token_map) and the
single-process runs the token-map tests compare with.

`frequency_map()`: the 2,048 most frequent of the embedded model's 4,096 ids over a few standard
library modules (the kind of text it was trained on), built with tools/build_token_map.py; it
covers most of what the model writes on tests/helpers/accepting's prompts, so acceptance stays
near the full vocabulary's (measured, float64, greedy, k=3: 59 accepted draft tokens against
66). `random_map(n)`: n ids drawn at random (not by frequency; seed 0): fewer drafts are
accepted (8 at k=1..4 with n=512), but some are.
"""
import atexit
import functools
import json
import os
import random
import shutil
import sys
import sysconfig
import tempfile

from lmdeploy_lite.api import EMBEDDED_MODEL_DIR
from lmdeploy_lite.messages import SpeculativeConfig
from tests.helpers import accepting

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STDLIB_MODULES = ('os.py', 'textwrap.py', 'heapq.py', 'argparse.py', 'string.py', 'shlex.py',
                  'glob.py', 'functools.py', 'contextlib.py', 'dataclasses.py', 'typing.py',
                  'pathlib.py', 'random.py', 'collections/__init__.py')
FREQUENCY_MAP_SIZE = 2048


@functools.cache
def _directory() -> str:
    path = tempfile.mkdtemp(prefix='lmdeploy_lite_token_maps_')
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def build_token_map_tool():
    """tools/build_token_map.py as a module."""
    sys.path.insert(0, os.path.join(ROOT, 'tools'))
    try:
        import build_token_map
    finally:
        sys.path.pop(0)
    return build_token_map


@functools.cache
def frequency_map() -> str:
    stdlib = sysconfig.get_paths()['stdlib']
    files = [os.path.join(stdlib, m) for m in STDLIB_MODULES]
    files = [f for f in files if os.path.isfile(f)]
    assert len(files) >= 8, f'too few standard-library modules found under {stdlib}'
    out = os.path.join(_directory(), f'frequency_{FREQUENCY_MAP_SIZE}.safetensors')
    build_token_map_tool().main(['--model', EMBEDDED_MODEL_DIR, '--top',
                                 str(FREQUENCY_MAP_SIZE), '--out', out, *files])
    return out


@functools.cache
def random_map(n: int, vocab_size: int = 4096, seed: int = 0) -> str:
    out = os.path.join(_directory(), f'random_{n}_of_{vocab_size}_s{seed}.json')
    with open(out, 'w') as f:
        json.dump(random.Random(seed).sample(range(vocab_size), n), f)
    return out


def read_map(path: str) -> list[int]:
    """A map of the embedded model's vocabulary (4,096 ids), as a list."""
    from lmdeploy_lite.pytorch.spec_decode.token_map import load_token_map
    return load_token_map(path, 4096).tolist()


def spec(k: int, token_map: str, **kw) -> SpeculativeConfig:
    """Fixed k unless told (accepting.spec: per-request draft counts comparable)."""
    kw.setdefault('dynamic', False)
    return SpeculativeConfig(num_speculative_tokens=k, draft_token_map=token_map, **kw)


def record_drafts(engine) -> list:
    """Wrap the engine's rejection sampler; the returned list fills with each verify step's
    (drafts [B, k], draft_probs [B, k, M] or None)."""
    calls, sampler = [], engine.agent.rejection_sampler

    def recording(logits, drafts, draft_probs, *args, **kw):
        calls.append((drafts.clone(), None if draft_probs is None else draft_probs.clone()))
        return sampler(logits, drafts, draft_probs, *args, **kw)
    engine.agent.rejection_sampler = recording
    return calls


_cache: dict = {}


def reference(k: int, token_map: str, prompt_ids=None, gen=accepting.GREEDY
              ) -> tuple[list[list[int]], list[tuple]]:
    """Single-process run with the map on accepting's model and BASE config, cached: (token ids
    per prompt, accepting.counts per prompt)."""
    from lmdeploy_lite import PytorchEngineConfig
    from lmdeploy_lite.pytorch.engine.build import build_engine
    prompt_ids = tuple(tuple(p) for p in (prompt_ids or accepting.prompts()))
    key = (k, token_map, prompt_ids, repr(gen))
    if key not in _cache:
        engine = build_engine(accepting.model_dir(), PytorchEngineConfig(**accepting.BASE),
                        spec(k, token_map), progress=False)
        seqs = engine.generate([list(p) for p in prompt_ids], gen)
        _cache[key] = ([s.generated_ids for s in seqs], [accepting.counts(s.spec_stats)
                                                         for s in seqs])
    return _cache[key]


# ---- the sharded reduced head on real TP ranks (tests/pytorch/spec_decode/test_token_map_ranks.py)
HEAD_VOCAB, HEAD_HIDDEN = 103, 16         # 103: not a multiple of tp, the last shard is short


def head_maps() -> dict:
    """name -> token map [M] for the head test: 40 random ids, four ids all in rank 0's shard
    (rank 1 holds only padding), one id in the short last shard."""
    import torch
    return {'random': torch.randperm(HEAD_VOCAB, generator=torch.Generator().manual_seed(11))[:40],
            'one_shard': torch.tensor([30, 2, 17, 5]), 'single': torch.tensor([102])}


REDUCED_HEAD_DIR = 'REDUCED_HEAD_DIR'


def check_reduced_heads(engine):
    """A worker hook (MPEngineLoop's `worker_hook`; env REDUCED_HEAD_DIR names where results go)
    run by every rank of a TP group right after its engine is built, before any request: the
    ranks run its collectives in lockstep, with the collective trace check.
    1. The engine's own reduced head: its rows are exactly the map ids of this rank's vocab
       shard (a copy), padded to the same count on every rank, fewer than the shard holds; its
       logits equal the full head's at the map ids up to summation order (real weights: BLAS
       may sum a [R, H] and a [Vp, H] product in different orders).
    2. A head of small integer weights (exact in any summation order), untied and tied (the
       vocab-parallel embedding's table), reduced for each of head_maps(): logits exactly the
       full head's at the map ids.
    Saves {name: value} to REDUCED_HEAD_DIR/rank{r}.pt."""
    import torch
    from lmdeploy_lite.pytorch.nn.embedding import ParallelLMHead, VocabParallelEmbedding
    from lmdeploy_lite.pytorch.spec_decode.token_map import ReducedLMHead
    ctx, rank = engine.dist, engine.dist.tp_rank
    results = {}
    lm_head, reduced = engine.agent.target.model.lm_head, engine.agent.proposer.compute_logits
    token_map = engine.agent.proposer.token_map
    shard = lm_head.weight.shape[0]
    local = token_map[token_map // shard == rank] - rank * shard
    held = reduced.weight[:local.numel()]
    results['engine_rows'] = (reduced.weight.shape[0], shard, token_map.numel())
    results['engine_rows_copied'] = (torch.equal(held, lm_head.weight[local]) and
                                     held.data_ptr() != lm_head.weight.data_ptr())
    hidden = torch.randn(3, lm_head.weight.shape[1], dtype=lm_head.weight.dtype,
                         generator=torch.Generator().manual_seed(0))
    ctx.begin_step(-1)
    full, got = lm_head(hidden), reduced(hidden)
    ctx.end_step()
    results['engine_logits_error'] = float((got - full[:, token_map]).abs().max())
    vocab, width = HEAD_VOCAB, HEAD_HIDDEN
    weights = torch.randint(-8, 9, (vocab, width), generator=torch.Generator().manual_seed(0))
    hidden = torch.randint(-8, 9, (5, width), generator=torch.Generator().manual_seed(1)).double()
    for tied in (False, True):
        head = ParallelLMHead(vocab, width, torch.float64, 'cpu', ctx)
        if tied:
            head.weight = VocabParallelEmbedding(vocab, width, torch.float64, 'cpu', ctx).weight
        rows = weights[rank * head.weight.shape[0]:(rank + 1) * head.weight.shape[0]]
        with torch.no_grad():
            head.weight.zero_()
            head.weight[:rows.shape[0]] = rows
        for name, head_map in head_maps().items():
            small = ReducedLMHead(head, head_map, torch.float64)
            ctx.begin_step(-2 - len(results))
            full, got = head(hidden), small(hidden)
            ctx.end_step()
            results[tied, name] = (torch.equal(got, full[:, head_map]),
                                   torch.equal(full, hidden @ weights.double().T),
                                   small.weight.shape[0], head.weight.shape[0])
    torch.save(results, os.path.join(os.environ[REDUCED_HEAD_DIR], f'rank{engine.dist.rank}.pt'))
