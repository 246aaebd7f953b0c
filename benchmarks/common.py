"""Shared benchmark helpers: pick a model, print a table, save JSON."""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
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
