"""Shared benchmark helpers: pick a model (a checkpoint, or a preset of real shapes on dummy
weights), measure the copy bandwidth, print a table, save JSON."""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def default_model() -> str:
    """The embedded model if shipped, else a tiny random checkpoint made by tools/."""
    from lmdeploy_lite.api import EMBEDDED_MODEL_DIR
    if os.path.isfile(os.path.join(EMBEDDED_MODEL_DIR, 'config.json')):
        return EMBEDDED_MODEL_DIR
    path = os.path.join(ROOT, 'tiny-model')
    if not os.path.isfile(os.path.join(path, 'config.json')):
        subprocess.run([sys.executable, os.path.join(ROOT, 'tools', 'make_tiny_checkpoint.py'),
                        path], check=True)
    return path


def add_model_args(parser, dtype: str = 'float32', device: str = 'cpu'):
    """--model / --preset (real shapes on random weights) / --load-format / --device / --dtype."""
    from presets import PRESETS
    parser.add_argument('--model', default=None, help='checkpoint directory (default: embedded)')
    parser.add_argument('--preset', default=None, choices=sorted(PRESETS),
                        help='config-only model dir of real shapes; implies --load-format dummy')
    parser.add_argument('--load-format', default=None, choices=('auto', 'dummy'))
    parser.add_argument('--seed', type=int, default=0, help='dummy-weight seed')
    parser.add_argument('--dtype', default=dtype)
    parser.add_argument('--device', default=device)
    parser.add_argument('--async-scheduling', action=argparse.BooleanOptionalAction,
                        default=None, help='PytorchEngineConfig.async_scheduling (default: the '
                        "engine's, on with CUDA)")


def resolve_model(args) -> tuple[str, str]:
    """(model dir, load_format) from `add_model_args`' flags; a preset is written to a temp dir."""
    if args.preset and args.model:
        raise ValueError('--model and --preset: give one of them')
    if args.preset:
        from presets import write_preset
        path = write_preset(args.preset, os.path.join(tempfile.mkdtemp(), args.preset))
        return path, args.load_format or 'dummy'
    return args.model or default_model(), args.load_format or 'auto'


def output_path(out: str | None, name: str) -> str:
    """--out if given, else `name` under $OUT (set on the GPU machine), else under out/."""
    return out or os.path.join(os.environ.get('OUT') or 'out', name)


def copy_bandwidth(device: torch.device, nbytes: int, iters: int = 10) -> float:
    """Bytes/s of a device-to-device copy of `nbytes`, counting bytes read + written (gpu.md)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    synchronize(device)
    start = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    synchronize(device)
    elapsed = time.perf_counter() - start
    del src, dst
    release_memory()                        # the engine sizes its KV cache from free memory
    return 2 * nbytes * iters / elapsed


def synchronize(device: torch.device):
    if torch.device(device).type == 'cuda':
        torch.cuda.synchronize(device)


def timed_decode(engine, prompts: list[list[int]], gen_config, warmup_steps: int,
                 decode_steps: int, around=None) -> tuple[float, int]:
    """Prefill `prompts`, run `warmup_steps` steps, reset the engine's speculative counters, then
    time `decode_steps` steps (inside the context manager `around`, e.g. a profiler, if given).
    Returns (seconds, tokens emitted in them); aborts the requests."""
    import contextlib

    from lmdeploy_lite.messages import SpecDecodeStats
    seqs = [engine.add_request(p, gen_config) for p in prompts]
    while not all(s.prefilled for s in seqs):
        engine.step()
    for _ in range(warmup_steps):
        engine.step()
    engine.spec_stats = SpecDecodeStats()
    synchronize(engine.device)
    generated = sum(s.num_generated for s in seqs)
    with around or contextlib.nullcontext():
        start = time.perf_counter()
        for _ in range(decode_steps):
            engine.step()
        synchronize(engine.device)
        elapsed = time.perf_counter() - start
    generated = sum(s.num_generated for s in seqs) - generated
    for seq in seqs:
        engine.abort(seq)
    return elapsed, generated


def release_memory():
    """Free a dropped engine's or model's device memory before the next one is built."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def environment() -> dict:
    return {'date': time.strftime('%Y-%m-%d'), 'python': platform.python_version(),
            'torch': torch.__version__, 'cpu_count': os.cpu_count(),
            'threads': torch.get_num_threads(),
            'device': torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu',
            'command': ' '.join([os.path.basename(sys.argv[0])] + sys.argv[1:])}


def print_table(rows: list[dict], columns: list[str]):
    widths = [max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns]
    print('  '.join(c.rjust(w) for c, w in zip(columns, widths)))
    for r in rows:
        print('  '.join(_fmt(r.get(c)).rjust(w) for c, w in zip(columns, widths)))


def _fmt(v) -> str:
    return f'{v:.2f}' if isinstance(v, float) else str(v)


def save_json(path: str, payload: dict):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, 'w') as f:
        json.dump(payload, f, indent=2)
    print(f'wrote {path}')
