"""Fixtures shared by the tests of the server: the tiny model and one running server on it, a
speculative server on the embedded model, whose MTP drafts get accepted, and the servers that
single tests start (and end), each started ahead of the test that takes it."""
import json
import os
import shutil
import sys
import threading

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


# the tiny model's tokenizer with a Qwen3.5-style chat template (test_reasoning_server.py): it opens
# `<think>` in the prompt when thinking and writes a closed empty block when not
THINKING_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}")


@pytest.fixture(scope='session')
def thinking_dir(model_dir, tmp_path_factory):
    """model_dir with THINKING_TEMPLATE as its chat template."""
    from tests.serve.live_server import MODEL
    path = str(tmp_path_factory.mktemp('thinking') / MODEL)
    shutil.copytree(model_dir, path)
    config_path = os.path.join(path, 'tokenizer_config.json')
    with open(config_path) as f:
        config = json.load(f)
    config.pop('chat_template', None)          # transformers reads chat_template.jinja first
    with open(config_path, 'w') as f:
        json.dump(config, f)
    with open(os.path.join(path, 'chat_template.jinja'), 'w') as f:
        f.write(THINKING_TEMPLATE)
    return path


# ---- servers started ahead ----------------------------------------------------------------------
# A server's start-up is 5-10 s of imports and loading, mostly on one core. The two session servers
# start together when the first test here starts; each server a single test takes (and ends) starts
# in the background while the tests before it run, one at a time: the next one once the one before
# it was taken, so at most one such server waits (its memory) beside the ones in use.
# name -> (model: the fixture that gives its directory, None for the embedded model; server
# arguments, where `{dir}` is the server's own directory (its log, files such as a keys file);
# environment). One-rank servers run their engine in a thread (`--no-engine-process`): the
# engine process, the default, costs each a second start-up of torch and the model on the same
# two cores (~20 s over this directory); sigint_server keeps the default, so that it is tested.
KEYS_FILE = '# the server keys\nfile-key-1\n\nfile-key-2\n'
ENV_KEYS = {'LMDEPLOY_LITE_API_KEYS': 'env-key-1, env-key-2'}


def _plans():
    from tests.serve.live_server import K, KEY, MODEL, SPEC_K
    return {
        # speculative (MTP, k=2), wants an API key: shared by the tests of tests/serve
        'server': ('model_dir', ('--no-engine-process', '--speculative-num-draft-tokens', str(K),
                                 '--api-keys', KEY, '--model-name', MODEL), None),
        # the embedded model, MTP k=3, float64 (its greedy output equals plain greedy exactly,
        # and its draft counts the single process's: tests/helpers/accepting), no API key;
        # fixed k: per-request draft counts are then comparable with the single process's
        'spec_server': (None, ('--no-engine-process', '--speculative-num-draft-tokens', str(SPEC_K),
                               '--no-speculative-dynamic', '--dtype', 'float64',
                               '--model-name', 'embedded'), None),
        # test_api_server.py: dp=2, keys from a file; a session long enough that a streamed
        # request is still running when SIGTERM lands, even on a loaded machine
        'dp2_server': ('model_dir', ('--dp', '2', '--speculative-num-draft-tokens', str(K),
                                '--session-len', '2048', '--api-keys-file', '{dir}/keys'), None),
        # test_api_server_robustness.py: a rank stopped, then killed
        'dead_rank_server': ('model_dir', ('--dp', '2', '--ep', '2', '--health-stall-timeout', '1.5'),
                             None),
        # test_api_server_robustness.py: keys from the environment, then SIGINT; a stream long
        # enough to be running when the signal arrives; the engine in its own process (default)
        'sigint_server': ('model_dir', ('--session-len', '2048'), ENV_KEYS),
        # test_api_workers.py: the shared server's flags, its requests through two front-end
        # processes (a session long enough that a stream runs while SIGTERM lands); and two more
        # front-end processes, one of which is killed
        'workers_server': ('model_dir', ('--no-engine-process', '--speculative-num-draft-tokens',
                                         str(K), '--api-keys', KEY, '--model-name', MODEL,
                                         '--session-len', '2048', '--api-workers', '2'), None),
        'workers_kill_server': ('model_dir', ('--no-engine-process', '--api-workers', '2'), None),
        # test_extract_hidden_states_server.py
        'extract_server': (None, ('--no-engine-process',
                                  '--speculative-algorithm', 'extract_hidden_states',
                                  '--speculative-aux-hidden-state-layer-ids', '0,4,8',
                                  '--hidden-states-dir', '{dir}/hidden'), None),
        # test_reasoning_server.py (for the module): no --reasoning-parser: auto, on because
        # the template writes think blocks
        'think_server': ('thinking_dir', ('--no-engine-process', '--model-name', MODEL,
                                          '--session-len', '512'), None),
    }


SESSION_SERVERS = ('server', 'spec_server')


class ServersAhead:
    """Starts the planned servers in the background (in the order the tests take them) and
    hands each to its test: take(name) waits until it is healthy."""

    def __init__(self, names: list[str], tmp_path_factory):
        """The models' directories come later (set_model_dirs): a server of the embedded model
        starts meanwhile."""
        self._plans, self._names, self._model_dirs = _plans(), list(names), None
        self._tmp = tmp_path_factory
        self._workdirs = {name: tmp_path_factory.mktemp(name) for name in names}
        self._started: dict = {}             # name -> Server, or the exception its start raised
        self._taken: set = set()
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, daemon=True, name='servers-ahead')
        self._thread.start()

    def start(self, name: str, workdir):
        """The server `name` as planned, started now (its health not awaited)."""
        from tests.serve.live_server import Server
        model, args, env = self._plans[name]
        if name == 'dp2_server':
            (workdir / 'keys').write_text(KEYS_FILE)
        srv = Server(self._model_dirs[model] if model else None, str(workdir / f'{name}.log'),
                     *(a.replace('{dir}', str(workdir)) for a in args), env=env, wait=False)
        srv.workdir = workdir
        return srv

    def set_model_dirs(self, model_dirs: dict):
        """`model_dirs`: fixture name -> its value, for the models of the planned servers."""
        with self._cond:
            self._model_dirs = model_dirs
            self._cond.notify_all()

    def _may_start(self, name: str) -> bool:
        """A session server at once (once its model is there); another once the tests have
        begun taking servers (the session servers' starts are over) and every one started
        before it was taken."""
        if self._closed:
            return True
        if self._plans[name][0] and self._model_dirs is None:
            return False
        others = {n for n in self._started if n not in SESSION_SERVERS}
        return name in SESSION_SERVERS or bool(self._taken) and others <= self._taken

    def _run(self):
        for name in self._names:
            with self._cond:
                self._cond.wait_for(lambda: self._may_start(name))
                if self._closed:
                    return
            try:
                srv = self.start(name, self._workdirs[name])
            except BaseException as e:        # raised again by take()
                srv = e
            with self._cond:
                self._started[name] = srv
                self._cond.notify_all()

    def take(self, name: str):
        """The server `name`, healthy; started now unless it was planned."""
        with self._cond:
            self._taken.add(name)
            self._cond.notify_all()
            if name in self._names:
                self._cond.wait_for(lambda: name in self._started or not self._thread.is_alive())
            srv = self._started.get(name)
        if srv is None:                       # not planned (or the plans were closed)
            srv = self.start(name, self._tmp.mktemp(name))
        if isinstance(srv, BaseException):
            raise srv
        srv.wait_healthy()
        return srv

    def close(self):
        """Starts no more; stops those no test took."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(30)
        for name, srv in self._started.items():
            if name not in self._taken and not isinstance(srv, BaseException):
                srv.stop()

    def stop_all(self):
        """Starts no more; stops every server started (a test's own stop of it then does
        nothing)."""
        self.close()
        for srv in self._started.values():
            if not isinstance(srv, BaseException):
                srv.stop()


_AHEAD: list = []               # (the session's ServersAhead, the last test that may take one)


def pytest_runtest_teardown(item, nextitem):
    """After the last test that may take a server its servers stop (an idle server still takes
    a few per cent of a core, and its memory), not at the end of the session."""
    if _AHEAD and item is _AHEAD[0][1]:
        _AHEAD[0][0].stop_all()


@pytest.fixture(scope='session')
def servers_ahead(request, tmp_path_factory):
    """ServersAhead for the servers the selected tests take, in the order they take them."""
    plans = _plans()
    order = []
    for item in request.session.items:
        for name in getattr(item, 'fixturenames', ()):
            if name in plans and name not in order:
                order.append(name)
    # the session servers first, the embedded model's before the tiny one's (whose directory
    # is made meanwhile); the others in test order (a stable sort)
    order.sort(key=lambda n: (n not in SESSION_SERVERS,
                              n in SESSION_SERVERS and plans[n][0] is not None))
    ahead = ServersAhead(order, tmp_path_factory)
    models = {plans[n][0] for n in order} - {None}
    try:
        ahead.set_model_dirs({m: request.getfixturevalue(m) for m in sorted(models)})
    except BaseException:
        ahead.close()
        raise
    users = [item for item in request.session.items
             if 'servers_ahead' in getattr(item, 'fixturenames', ())]
    _AHEAD.append((ahead, users[-1] if users else None))
    yield ahead
    _AHEAD.clear()
    ahead.close()


@pytest.fixture(autouse=True, scope='session')
def _start_servers_ahead(servers_ahead):
    """The first test of tests/serve starts the background starts."""


@pytest.fixture(scope='session')
def server(servers_ahead):
    """Speculative (MTP, k=2) server that wants an API key, shared by the tests of tests/serve."""
    srv = servers_ahead.take('server')
    yield srv
    srv.stop()


@pytest.fixture(scope='session')
def client(server):
    openai = pytest.importorskip('openai')
    from tests.serve.live_server import KEY
    return openai.OpenAI(base_url=server.url + '/v1', api_key=KEY, timeout=60, max_retries=0)


@pytest.fixture(scope='session')
def spec_server(servers_ahead):
    """The embedded model (no model argument), MTP k=3, float64, fixed k, no API key."""
    srv = servers_ahead.take('spec_server')
    yield srv
    srv.stop()


@pytest.fixture(scope='session')
def spec_client(spec_server):
    openai = pytest.importorskip('openai')
    return openai.OpenAI(base_url=spec_server.url + '/v1', api_key='unused', timeout=60,
                         max_retries=0)


def _taken(name: str, scope: str = 'function'):
    @pytest.fixture(scope=scope)
    def fixture(servers_ahead):
        srv = servers_ahead.take(name)
        try:
            yield srv
        finally:
            srv.stop()
    fixture.__doc__ = f"The {name.replace('_', ' ')} (see _plans), healthy; stopped after."
    return fixture


dp2_server = _taken('dp2_server')
dead_rank_server = _taken('dead_rank_server')
sigint_server = _taken('sigint_server')
extract_server = _taken('extract_server')
workers_server = _taken('workers_server')
workers_kill_server = _taken('workers_kill_server')
think_server = _taken('think_server', scope='module')
