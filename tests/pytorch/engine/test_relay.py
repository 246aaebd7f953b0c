"""executor/relay.py (the server's --api-workers): a RelayClient drives an engine's client through
a RelayHub over a pipe. Here both ends run in this process, over a stand-in engine client that
emits steps from a thread, so every path is exercised in milliseconds: outputs reach the worker's
sinks in order and once, checks happen before anything is sent, aborts and a worker that goes
away reach the engine, calls are answered, and an engine that stops ends the worker's requests."""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass

import pytest

from lmdeploy_lite.messages import GenerationConfig
from lmdeploy_lite.pytorch.engine.executor.client import EngineStats, RequestHandle, hand_out
from lmdeploy_lite.pytorch.engine.executor.relay import RelayClient, RelayHub
from lmdeploy_lite.pytorch.config import ModelConfig

WAIT_S = 10.0


@dataclass
class Out:
    """What a StepOutput is to the relay: an item with `finished`."""
    token: int
    finished: bool


class StandIn:
    """An engine client: each request gets `steps` outputs, one per step of a thread."""
    def __init__(self, steps: int = 3):
        self.error, self.steps, self.live, self.aborted = None, steps, {}, []
        self.lock, self.next_rid = threading.Lock(), 0

    def submit_groups(self, prompts, configs, sink, tags, request_ids):
        if self.error is not None:
            raise RuntimeError('the engine stopped after an error: boom')
        groups = []
        with self.lock:
            for choice_tags in tags:
                group = [RequestHandle(self.next_rid + i, 0, sink, tag)
                         for i, tag in enumerate(choice_tags)]
                self.next_rid += len(group)
                self.live.update((h.rid, [h, 0]) for h in group)
                groups.append(group)
        return groups

    def step(self):
        pairs = []
        with self.lock:
            for rid, entry in list(self.live.items()):
                entry[1] += 1
                done = entry[1] == self.steps
                if done:
                    del self.live[rid]
                    entry[0].finished = True
                pairs.append((entry[0], Out(entry[1], done)))
        hand_out(pairs)

    def abort(self, handle):
        with self.lock:
            self.aborted.append(handle.rid)
            self.live.pop(handle.rid, None)

    def stats(self):
        return EngineStats(num_running=len(self.live))

    def stalled(self, limit_s):
        return f'stalled past {limit_s}'

    def fail(self):
        self.error = RuntimeError('boom')
        with self.lock:
            entries, self.live = list(self.live.values()), {}
        hand_out([(h, RuntimeError('boom')) for h, _ in entries])


def relay(engine: StandIn) -> tuple[RelayHub, RelayClient]:
    hub = RelayHub(engine)
    config = ModelConfig.__new__(ModelConfig)
    object.__setattr__(config, 'vocab_size', 100)
    return hub, RelayClient(hub.attach(), config, session_len=64)


def until(condition, what: str):
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f'timed out waiting for {what}'
        time.sleep(0.005)


def test_outputs_reach_the_sinks_in_order_once_and_the_handles_finish():
    engine = StandIn(steps=3)
    hub, client = relay(engine)
    got = queue.Queue()
    groups = client.submit_groups([[1, 2], [3]], GenerationConfig(n=2), got.put,
                                  [['a', 'b'], ['c', 'd']])
    handles = [h for group in groups for h in group]
    until(lambda: len(engine.live) == 4, 'the engine to hold the four choices')
    for _ in range(3):
        engine.step()
    items = [got.get(timeout=WAIT_S) for _ in range(12)]
    assert got.empty()
    for i in range(4):                             # each choice's steps in order, the last done
        assert [(o.token, o.finished) for o in items[i::4]] == [(1, False), (2, False), (3, True)]
    until(lambda: all(h.finished for h in handles), 'the handles to finish')
    assert client.stats().num_running == 0 and client.stalled(1.5) == 'stalled past 1.5'
    client.close()
    hub.close()


def test_a_bad_request_is_refused_before_anything_is_sent():
    engine = StandIn()
    hub, client = relay(engine)
    with pytest.raises(ValueError, match='outside 0..99'):
        client.submit_groups([[1], [100]], GenerationConfig(), print, [['a'], ['b']])
    with pytest.raises(ValueError, match='n=2: 1 request tags'):
        client.submit_group([1], GenerationConfig(n=2), print, ['a'])
    with pytest.raises(ValueError, match='request_id'):
        client.submit_group([1], GenerationConfig(), print, ['a'], ['../x'])
    client.submit_group([1], GenerationConfig(), print, ['ok'])   # what is sent comes in order
    until(lambda: engine.next_rid == 1, 'the good request')
    assert len(engine.live) == 1
    client.close()
    hub.close()


def test_aborts_and_a_worker_that_goes_away_reach_the_engine():
    engine = StandIn(steps=100)
    hub, client = relay(engine)
    got = queue.Queue()
    first, second, third = (client.submit_group([1], GenerationConfig(), got.put, [i])[0]
                            for i in range(3))
    until(lambda: len(engine.live) == 3, 'three requests')
    client.abort(first)
    until(lambda: engine.aborted == [0], 'the abort')
    client.close()                                 # the worker leaves: its requests end there
    assert isinstance(got.get(timeout=WAIT_S), RuntimeError)
    until(lambda: sorted(engine.aborted) == [0, 1, 2], 'the rest aborted')
    assert not second.finished and not third.finished
    with pytest.raises(RuntimeError, match='closed'):
        client.submit_group([1], GenerationConfig(), got.put, [9])
    hub.close()


def test_an_engine_that_stops_ends_the_workers_requests_and_later_submits():
    engine = StandIn(steps=100)
    hub, client = relay(engine)
    got = queue.Queue()
    client.submit_group([1], GenerationConfig(), got.put, ['a'])
    until(lambda: len(engine.live) == 1, 'the request')
    engine.fail()
    assert isinstance(got.get(timeout=WAIT_S), RuntimeError)
    assert 'boom' in str(client.error)             # known before its requests' errors arrive
    with pytest.raises(RuntimeError, match='stopped'):
        client.submit_group([1], GenerationConfig(), got.put, ['b'])
    client.close()
    hub.close()


def test_a_submit_the_engine_refuses_after_the_check_ends_with_an_error_item():
    engine = StandIn()
    engine.error = RuntimeError('boom')            # the hub's client stopped; the worker not told
    hub, client = relay(engine)
    got = queue.Queue()
    handle = client.submit_group([1], GenerationConfig(), got.put, ['a'])[0]
    error = got.get(timeout=WAIT_S)
    assert isinstance(error, RuntimeError) and 'stopped' in str(error)
    assert not handle.finished
    client.close()
    hub.close()
