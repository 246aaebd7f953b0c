"""`lmdeploy_lite chat` as a person uses it (issue 16): Ctrl-C during a reply stops that reply and
the session goes on; a conversation that outgrows the session drops its oldest turns instead of
ending; a message too long on its own is refused and the session goes on. The real CLI in a
subprocess on the embedded model, spoken to through its stdin."""
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.timeout(240)


class Chat:
    """The chat CLI with stdout and stderr read as they come (one queue of characters)."""

    def __init__(self, *args: str):
        cmd = [sys.executable, '-m', 'lmdeploy_lite.cli.main', 'chat', '--device', 'cpu',
               '--dtype', 'float32', *args]
        # Ctrl-C as in a terminal: a test run started in the background (nohup, `&`) ignores
        # SIGINT, which its children would inherit (so the chat could not be interrupted)
        ignored = signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        if ignored:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
        try:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                         env=dict(os.environ, OMP_NUM_THREADS='1'))
        finally:
            if ignored:
                signal.signal(signal.SIGINT, signal.SIG_IGN)
        self.out: queue.Queue = queue.Queue()
        self.text = {'stdout': '', 'stderr': ''}
        self.readers = [threading.Thread(target=self._read, args=(name,), daemon=True)
                        for name in ('stdout', 'stderr')]
        for reader in self.readers:
            reader.start()

    def _read(self, name: str):
        stream = getattr(self.proc, name)
        while chunk := os.read(stream.fileno(), 4096):
            self.out.put((name, chunk.decode(errors='replace')))

    def wait_for(self, needle: str, name: str = 'stdout', after: int = 0,
                 timeout_s: float = 120) -> int:
        """Waits until `needle` shows in `name` past position `after`; returns its end."""
        deadline = time.monotonic() + timeout_s
        while (at := self.text[name].find(needle, after)) < 0:
            remaining = deadline - time.monotonic()
            assert remaining > 0 and self.proc.poll() is None, \
                f'{needle!r} never came (exit {self.proc.poll()}):\n{self.text}'
            try:
                which, chunk = self.out.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                continue
            self.text[which] += chunk
        return at + len(needle)

    def say(self, line: str):
        self.proc.stdin.write((line + '\n').encode())
        self.proc.stdin.flush()

    def finish(self, timeout_s: float = 60) -> int:
        self.proc.stdin.close()
        code = self.proc.wait(timeout_s)
        for reader in self.readers:                # both pipes at EOF: all output is queued
            reader.join(5)
        while not self.out.empty():
            which, chunk = self.out.get()
            self.text[which] += chunk
        return code

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def _start_chats() -> dict[str, Chat]:
    return {'ctrl_c': Chat('--max-new-tokens', '3000', '--session-len', '4096'),
            'long': Chat('--max-new-tokens', '16', '--session-len', '96')}


_ahead: dict[str, Chat] = {}


def start_ahead():
    """Called (tests/conftest.py) while the module before this one runs: the chats' start-ups
    then overlap its tests."""
    _ahead.update(_start_chats())


@pytest.fixture(scope='module')
def chats():
    """Each test's chat process, both started at once (by start_ahead, or now): a start-up
    (~6 s of imports and loading) runs on one core, so on two cores the second one's overlaps
    the first."""
    started = dict(_ahead) or _start_chats()
    _ahead.clear()
    try:
        yield started
    finally:
        for chat in started.values():
            chat.kill()


def test_ctrl_c_stops_the_reply_and_the_session_goes_on(chats):
    chat = chats['ctrl_c']
    try:
        chat.wait_for('user> ')
        chat.say('Write a long Python module.')
        at = chat.wait_for('assistant> ')
        for turn in range(2):
            chat.wait_for('\n', after=at + 1)            # some of the reply is out
            chat.proc.send_signal(signal.SIGINT)
            at = chat.wait_for('user> ', after=chat.wait_for('[stopped]', after=at))
            if turn == 0:
                chat.say('def add(a, b):')             # the next turn is answered
                at = chat.wait_for('assistant> ', after=at)
        chat.say('')
        assert chat.finish() == 0, chat.text
    finally:
        chat.kill()
    assert 'Traceback' not in chat.text['stderr'], chat.text['stderr']
    assert chat.text['stdout'].count('assistant> ') == 2
    assert chat.text['stdout'].count('[stopped]') == 2


def test_a_long_conversation_drops_old_turns_and_a_too_long_message_is_refused(chats):
    chat = chats['long']
    try:
        at = chat.wait_for('user> ')
        for i in range(4):                             # ~25 tokens each with the template
            chat.say(f'def function_number_{i}(argument_one, argument_two):')
            at = chat.wait_for('user> ', after=chat.wait_for('assistant> ', after=at))
        chat.say('x = 1 + ' * 60)                      # alone longer than the session
        at = chat.wait_for('user> ', after=at)
        chat.say('import os')
        chat.wait_for('user> ', after=chat.wait_for('assistant> ', after=at))
        chat.say('')
        assert chat.finish() == 0, chat.text
    finally:
        chat.kill()
    err = chat.text['stderr']
    assert 'Traceback' not in err, err
    assert 'oldest turn' in err and 'session_len=96' in err, err
    assert 'error: this message is' in err, err
    assert chat.text['stdout'].count('assistant> ') == 5
