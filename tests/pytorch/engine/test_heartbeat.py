"""Naming the stalled rank from the heartbeats (engine/heartbeat.py): the ranks left waiting
inside a collective are not the ones named; a process stopped by a signal is; silence from
before requests were pending does not count."""
import time

from lmdeploy_lite.pytorch.engine.heartbeat import Heartbeats


def test_the_rank_outside_a_collective_is_named_not_the_ones_waiting_for_it():
    beats = Heartbeats(3)
    assert beats.stalled(0.05) is None
    beats.beat(1)                          # rank 1 computes (then hangs)
    beats.beat(0, waiting=True)            # ranks 0 and 2 enter a collective and wait for it
    beats.beat(2, waiting=True)
    time.sleep(0.1)
    line = beats.stalled(0.05)
    assert line.startswith('rank 1 has made no progress for '), line
    assert line.endswith('(rank 0, rank 2 waiting, silent too)'), line
    # inside the same collective, the one behind (fewer beats) is named
    for rank in (0, 2):                    # left and entered the next one
        beats.beat(rank, waiting=False)
        beats.beat(rank, waiting=True)
    beats.beat(1, waiting=True)            # rank 1 entered the first one only
    time.sleep(0.1)
    assert beats.stalled(0.05).startswith('rank 1 ')
    # a process stopped by a signal comes first, whatever its beats say
    line = beats.stalled(0.05, describe=lambda r: f'rank {r}' + (' (stopped)' if r == 2 else ''))
    assert line.startswith('rank 2 (stopped) has made no progress'), line
    # silence before requests were pending does not count
    assert beats.stalled(0.05, since=time.monotonic()) is None
