"""Whether the engine is making progress: each rank beats at the top of every loop turn and on
entering and leaving every collective, into memory the front-end reads. While requests are
pending, a rank silent for longer than a step can take has stalled; the others then wait for it
inside a collective, so the one named is the silent rank outside one (else the one furthest
behind). `/health` turns 503 naming it, long before a collective's timeout ends the engine."""
from __future__ import annotations

import time


class Heartbeats:
    """Per rank: the last beat (monotonic seconds), the beat count, whether inside a collective;
    in memory shared with rank processes (`ctx`'s), or plain lists (ctx None)."""

    def __init__(self, world_size: int, ctx=None):
        self.times, self.counts, self.waiting = (
            [0.0] * world_size if ctx is None else ctx.RawArray('d', world_size) for _ in range(3))
        self.times[:] = [time.monotonic()] * world_size

    def beat(self, rank: int, waiting: bool = False):
        self.times[rank] = time.monotonic()
        self.counts[rank] += 1
        self.waiting[rank] = float(waiting)

    def beater(self, rank: int):
        """One rank's `beat` (DistContext passes waiting=True inside a collective)."""
        return lambda waiting=False: self.beat(rank, waiting)

    def stalled(self, limit_s: float, since: float = 0.0, describe=None) -> str | None:
        """One line naming the stalled rank, silent for over `limit_s` since `since`, or None.
        `describe(rank)`: its name, saying 'stopped' for a stopped process (named first)."""
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
