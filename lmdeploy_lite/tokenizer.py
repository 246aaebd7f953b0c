"""A model directory's tokenizer: the front-end detokenizes with it, every rank's stop checks
match stop words with it. Its own module so that the executors' ranks load it without importing
the front-end (api.py imports the executors)."""
from __future__ import annotations

import os


def load_tokenizer(model_path: str):
    """The model directory's tokenizer through transformers, offline; None if it has none."""
    names = ('tokenizer.json', 'tokenizer_config.json', 'vocab.json', 'tokenizer.model')
    if not any(os.path.isfile(os.path.join(model_path, n)) for n in names):
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model_path, local_files_only=True)
