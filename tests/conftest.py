import gc
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# One torch thread per test process unless LMDEPLOY_LITE_TEST_THREADS says otherwise: two suites
# on one small machine must not oversubscribe it. mp/ray workers started by a test take this
# process's thread count divided by the world size (at least 1); subprocesses (CLI, server) are
# told through OMP_NUM_THREADS.
TEST_THREADS = int(os.environ.get('LMDEPLOY_LITE_TEST_THREADS') or 1)
torch.set_num_threads(TEST_THREADS)
os.environ['OMP_NUM_THREADS'] = str(TEST_THREADS)
if not torch.cuda.is_available():
    # Triton kernels run in Triton's interpreter on CPU tensors (set before any kernel module
    # is imported: kernels are wrapped for the interpreter when they are defined)
    os.environ.setdefault('TRITON_INTERPRET', '1')


# The cyclic garbage collector's full collections walk every object it tracks: in this session
# torch, transformers, ray, the collected tests and what earlier modules keep (caches, session
# fixtures), over and over. Once collected, what lives at the start of a module moves out of its
# generations for good (gc.freeze): what the module itself makes is collected as before. The
# collect first frees what earlier modules dropped (their fixtures are torn down by then), so
# no garbage is frozen. ~5% of the time of in-process tests.
@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session):
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True, scope='module')
def _freeze_what_lives_before_the_module():
    gc.collect()
    gc.freeze()
    yield


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason='needs CUDA (GPU test); this machine has none')
    for item in items:
        if 'gpu' in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope='session')
def kernel_device() -> str:
    """Where Triton kernel tests run: 'cuda', else 'cpu' under Triton's interpreter; skipped
    when Triton is not installed."""
    pytest.importorskip('triton')
    return 'cuda' if torch.cuda.is_available() else 'cpu'


@pytest.fixture(scope='session')
def tiny_ckpt(tmp_path_factory):
    """tiny_ckpt(moe, **kw) -> path of a cached tiny random checkpoint (tests/helpers/tiny_models)."""
    from tests.helpers.tiny_models import make_tiny_checkpoint
    root = tmp_path_factory.mktemp('ckpt')
    cache = {}

    def get(moe: bool, **kw):
        key = (moe, tuple(sorted(kw.items())))
        if key not in cache:
            cache[key] = make_tiny_checkpoint(str(root), moe=moe, **kw)
        return cache[key]
    return get
