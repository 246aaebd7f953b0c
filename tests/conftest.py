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
    _start_the_fork_server()
    _patch_the_language_once_per_launch()
    gc.collect()
    gc.freeze()


def _start_the_fork_server():
    """The mp executor's ranks are forked by multiprocessing's fork server, which imports torch
    and transformers first (~5 s of one core): started now, it does that beside the first tests
    instead of inside the first test that starts ranks. (It forks each rank with the environment
    the rank is given, so starting it early changes nothing a rank sees.)"""
    import multiprocessing.forkserver

    from lmdeploy_lite.pytorch.engine.executor.mp import rank_context
    if rank_context().get_start_method() == 'forkserver':
        multiprocessing.forkserver.ensure_running()


def pytest_runtest_setup(item):
    _start_the_next_module_ahead(item)


_started_ahead: set = set()
_module_order: dict = {}                  # id(session) -> {module: the module run after it}


def _start_the_next_module_ahead(item):
    """A test module may define start_ahead(), which starts processes its tests take (a
    start-up that is seconds of imports on one core): it is called once, when the module
    before it in the run begins, so the start-up overlaps that module's tests."""
    if id(item.session) not in _module_order:
        modules = list(dict.fromkeys(getattr(i, 'module', None) for i in item.session.items))
        _module_order[id(item.session)] = dict(zip(modules, modules[1:]))
    following = _module_order[id(item.session)].get(getattr(item, 'module', None))
    if following is not None and hasattr(following, 'start_ahead') \
            and following not in _started_ahead:
        _started_ahead.add(following)
        following.start_ahead()


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


def _share_httpx_ssl_context():
    """httpx makes an SSL context for every client, and every httpx.get / post / stream call
    makes a client: it reads the CA bundle each time (~33 ms of CPU where SSL_CERT_FILE names
    the system bundle), also while a test polls a starting server on the two cores it needs.
    The tests speak plain http to 127.0.0.1; one context per set of arguments serves them all."""
    import functools
    try:
        from httpx._transports import default
    except ImportError:
        return
    create = getattr(default, 'create_ssl_context', None)
    if create is None or hasattr(create, 'cache_info'):
        return

    @functools.lru_cache(maxsize=None)
    def shared(verify=True, cert=None, trust_env=True):
        return create(verify=verify, cert=cert, trust_env=trust_env)

    def create_ssl_context(verify=True, cert=None, trust_env=True):
        try:
            return shared(verify, cert, trust_env)
        except TypeError:                      # an unhashable argument: as httpx does
            return create(verify=verify, cert=cert, trust_env=trust_env)
    create_ssl_context.cache_info = shared.cache_info
    default.create_ssl_context = create_ssl_context


_share_httpx_ssl_context()


def _patch_the_language_once_per_launch():
    """Triton's interpreter (CPU) re-patches triton.language for every call of a @triton.jit
    helper inside a kernel: `inspect.getmembers` over four modules, ~0.5 ms a call, called per
    tile or per token (~10% of the interpreted kernel tests' time). Within one launch each
    helper's first call patches as before and later calls of it skip what is then already in
    place: the patches a helper sets are never undone before the launch ends (the launch's own
    are restored at its end; a helper's are left, as Triton leaves them), so a repeat would set
    the same attributes to equal values."""
    if os.environ.get('TRITON_INTERPRET') != '1':
        return
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    functions, executor = interpreter.InterpretedFunction, interpreter.GridExecutor
    if getattr(functions.__call__, 'patches_once_per_launch', False):
        return
    patched: set = set()                   # helpers called (so patched) in the running launch
    launch, call = executor.__call__, functions.__call__

    def launch_once(self, *args, **kwargs):
        patched.clear()
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched.clear()

    def call_patched_once(self, *args, **kwargs):
        if self.fn not in patched:
            patched.add(self.fn)
            return call(self, *args, **kwargs)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e
    call_patched_once.patches_once_per_launch = True
    executor.__call__, functions.__call__ = launch_once, call_patched_once
    _look_up_numpy_dtypes_in_one_table(interpreter)
    _type_triton_tuples_when_asked()
    _skip_overflow_checks_whose_assert_is_off(interpreter)


def _look_up_numpy_dtypes_in_one_table(interpreter):
    """Triton's interpreter maps a Triton dtype to numpy's (`_get_np_dtype`) by building a
    19-entry dict of np.dtype objects on every call: ~30 calls per interpreted operation, ~10%
    of the interpreted kernel tests' time. The same mapping, its dict built once (a dtype it
    does not hold: the original function, which raises as before)."""
    original = getattr(interpreter, '_get_np_dtype', None)
    if original is None or getattr(original, 'one_table', False):
        return
    import numpy as np
    import triton.language as tl
    names = ('int1', 'float16', 'float32', 'float64', 'int8', 'uint8', 'int16', 'uint16',
             'int32', 'uint32', 'int64', 'uint64', 'bfloat16', 'float8e5', 'float8e5b16',
             'float8e4nv', 'float8e4b8', 'float8e4b15')
    table = {getattr(tl, n): original(getattr(tl, n)) for n in names if hasattr(tl, n)}
    pointer, block, uint64 = tl.pointer_type, tl.block_type, np.dtype(np.uint64)

    def get_np_dtype(tt_dtype):
        element = tt_dtype.element_ty if isinstance(tt_dtype, block) else tt_dtype
        if isinstance(element, pointer):
            return uint64
        found = table.get(element)
        return found if found is not None else original(tt_dtype)
    get_np_dtype.one_table = True
    interpreter._get_np_dtype = get_np_dtype



def _type_triton_tuples_when_asked():
    """A `triton.language.tuple` (every shape of every interpreted tensor is one) builds its
    tuple_type, a name string of its values' reprs, when it is made: ~25% of the interpreted
    kernel tests' time, though the interpreter seldom reads a tuple's type. The type is made from
    the same values when first read instead (the one method that changes `values`, _setitem,
    sets the type after); a type given to the constructor is kept as before."""
    from triton.language import core
    cls = core.tuple
    if getattr(cls.__init__, 'typed_when_asked', False) or not hasattr(
            core, '_type_for_tuple_values'):          # another Triton: left as it is
        return

    def __init__(self, args, type=None):
        self.values = [i for i in args]
        if isinstance(type, core.tuple_type):
            self._type = type
        elif type is not None:      # make_template in ASTFunction.deserialize: a list/tuple
            self._type = core.tuple_type(type)
        else:
            self._type = None

    def get_type(self):
        made = self.__dict__
        if made.get('_type') is None:          # (one made before this: its own `type`)
            made['_type'] = made.get('type') or core._type_for_tuple_values(self.values)
        return made['_type']

    def set_type(self, value):
        self._type = value
    __init__.typed_when_asked = True
    cls.__init__, cls.type = __init__, property(get_type, set_type)


def _skip_overflow_checks_whose_assert_is_off(interpreter):
    """Every int32 add, sub and mul of an interpreted kernel is checked for overflow
    (InterpreterOptions.sanitize_overflow): the operands cast to int64, the op, two compares and
    an `and`, each through Triton's semantic layer (~40% of the interpreted kernel tests' time),
    handed to device_assert, which does nothing unless the options' `debug` is on (it is off:
    nothing is asserted). So, in the interpreter with `debug` off, only the check's own
    type asserts run; with `debug` on, or outside the interpreter, the whole check as before."""
    try:
        from triton.language.semantic import TritonSemantic
        original = TritonSemantic.binary_op_sanitize_overflow_impl
    except (ImportError, AttributeError):               # another Triton: left as it is
        return
    if getattr(original, 'skips_when_the_assert_is_off', False):
        return

    def binary_op_sanitize_overflow_impl(self, lhs, rhs, binary_op):
        if not isinstance(self.builder, interpreter.InterpreterBuilder) \
                or self.builder.options.debug:
            return original(self, lhs, rhs, binary_op)
        if lhs.type.scalar.int_bitwidth >= 64 or not self.builder.options.sanitize_overflow:
            return
        assert lhs.type.scalar == rhs.type.scalar
        assert lhs.type.scalar.is_int()
    binary_op_sanitize_overflow_impl.skips_when_the_assert_is_off = True
    TritonSemantic.binary_op_sanitize_overflow_impl = binary_op_sanitize_overflow_impl
