"""Fixtures shared by the tests of the server: the tiny model and one running server on it, and
a speculative server on the embedded model, whose MTP drafts get accepted."""
import os
import shutil
import sys

import pytest


@pytest.fixture(scope='session')
def model_dir(tiny_ckpt, tmp_path_factory):
    """A tiny random checkpoint with MTP tensors plus a real BPE tokenizer with a chat template."""
    from tests.serve.live_server import MODEL, ROOT
    sys.path.insert(0, os.path.join(ROOT, 'tools'))
    from make_tiny_checkpoint import train_tokenizer
    path = str(tmp_path_factory.mktemp('serve') / MODEL)
    shutil.copytree(tiny_ckpt(True, layout='multimodal'), path)
    train_tokenizer(path, 512)
    return path


@pytest.fixture(scope='session')
def server(model_dir, tmp_path_factory):
    """Speculative (MTP, k=2) server that wants an API key, shared by the tests of tests/serve."""
    from tests.serve.live_server import K, KEY, MODEL, Server
    srv = Server(model_dir, str(tmp_path_factory.mktemp('log') / 'server.log'),
                 '--speculative-num-draft-tokens', str(K), '--api-keys', KEY,
                 '--model-name', MODEL)
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope='session')
def client(server):
    openai = pytest.importorskip('openai')
    from tests.serve.live_server import KEY
    return openai.OpenAI(base_url=server.url + '/v1', api_key=KEY, timeout=60, max_retries=0)


@pytest.fixture(scope='session')
def spec_server(tmp_path_factory):
    """The embedded model (no model argument), MTP k=3, float64 (its greedy output equals plain
    greedy exactly, and its draft counts the single process's: tests/helpers/accepting), no API
    key. Fixed k (--no-speculative-dynamic): per-request draft counts are then comparable with
    the single process's."""
    from tests.serve.live_server import SPEC_K, Server
    srv = Server(None, str(tmp_path_factory.mktemp('log') / 'spec_server.log'),
                 '--speculative-num-draft-tokens', str(SPEC_K), '--no-speculative-dynamic',
                 '--dtype', 'float64',
                 '--model-name', 'embedded')
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope='session')
def spec_client(spec_server):
    openai = pytest.importorskip('openai')
    return openai.OpenAI(base_url=spec_server.url + '/v1', api_key='unused', timeout=60,
                         max_retries=0)
