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
    from lmdeploy_lite.pytorch.engine.engine import Engine
    prompt_ids = tuple(tuple(p) for p in (prompt_ids or accepting.prompts()))
    key = (k, token_map, prompt_ids, repr(gen))
    if key not in _cache:
        engine = Engine(accepting.model_dir(), PytorchEngineConfig(**accepting.BASE),
                        spec(k, token_map), progress=False)
        seqs = engine.generate([list(p) for p in prompt_ids], gen)
        _cache[key] = ([s.generated_ids for s in seqs], [accepting.counts(s.spec_stats)
                                                         for s in seqs])
    return _cache[key]
