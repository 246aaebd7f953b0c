"""Whether the engine is making progress: each rank (or the in-thread loop) beats at the top of
every loop turn and on entering and leaving every collective, into memory the front-end reads
(shared memory across the ranks' processes). While requests are pending, a rank silent for
longer than a step can take has stalled (stopped, stuck in a kernel, a loop or a collective).
The others then wait for it inside a collective, so the one named is the silent rank that is
not inside one (or, if all are, the one furthest behind). `/health` turns 503 naming it, long
before a collective's timeout ends the engine."""
from __future__ import annotations

import time


class Heartbeats:
    """Per rank: the last beat (monotonic seconds, one clock for every process of the host),
    the number of beats, and whether it is inside a collective. `ctx`: a multiprocessing
    context for memory shared with rank processes (passed to them at creation), None for one
    in-process loop."""

    def __init__(self, world_size: int, ctx=None):
        now = time.monotonic()
        if ctx is None:
            self.times, self.counts, self.waiting = ([now] * world_size, [0.0] * world_size,
                                                     [0.0] * world_size)
        else:
            self.times, self.counts, self.waiting = (ctx.RawArray('d', world_size)
                                                     for _ in range(3))
            for rank in range(world_size):
                self.times[rank] = now

    def beat(self, rank: int, waiting: bool = False):
        self.times[rank] = time.monotonic()
        self.counts[rank] += 1
        self.waiting[rank] = float(waiting)

    def beater(self, rank: int):
        """`beat` of one rank: `beat(waiting=False)` (DistContext calls it with True on entering
        a collective and False on leaving it)."""
        return lambda waiting=False: self.beat(rank, waiting)

    def stalled(self, limit_s: float, since: float = 0.0, describe=None) -> str | None:
        """None, or one line naming the stalled rank when any has been silent for over
        `limit_s` since `since` (monotonic: when requests became pending; the caller asks only
        while they are). `describe(rank)`: how to call a rank (default 'rank R'); its text
        should say whether the rank's process is stopped, and those are named first."""
        now = time.monotonic()
        ages = [now - max(t, since) for t in self.times]
        stale = [r for r, age in enumerate(ages) if age > limit_s]
        if not stale:
            return None
        describe = describe or (lambda r: f'rank {r}')
        names = {r: describe(r) for r in stale}
        stale.sort(key=lambda r: ('stopped' not in names[r], self.waiting[r], self.counts[r],
                                  self.times[r]))
        first = stale[0]
        line = (f'{names[first]} has made no progress for {ages[first]:.1f} s with requests '
                f'pending')
        if len(stale) > 1:
            line += f" ({', '.join(names[r] for r in stale[1:])} waiting, silent too)"
        return line
