"""How many drafts each step verifies and makes: the k in 0..max_k with the most tokens per second,
E(k) / t(b, k), where E(k) = 1 + c_0 + ... + c_{k-1} (c_i = P(more than i drafts accepted)) and
t(b, k) is the step time at batch-size bucket b; so speculation is never slower than plain decoding
(k = 0) by more than what it costs to keep measuring. Measured on the host: c_i as the product of
conditional acceptances a_j = P(draft j accepted | drafts before it accepted), each from decayed
counts of the rows that reached and accepted position j (drafts do not depend on k: any step with
more than j drafts measures it) plus a prior centred on a_{j-1} (`prior_acceptance` for j = 0),
worth `PRIOR_ROWS` rows while the position has none and less as its own come in (PRIOR_ROWS^2 /
(PRIOR_ROWS + rows)): a position not drafted lately drifts back to the one before it rather than
keeping what a few early drafts said (the start of an output, harder to draft, once held a CPU run
at k=1 where k=3 was 12% faster), and rows that reject every draft are believed as they accumulate
(with a prior of fixed weight, one H200 at batch 1 where nothing was accepted still ran k=1 in 9 of
24 timed steps after 60). A position's rows also age as fast as the one before it is renewed without
it (rows that accepted all their drafts reached it undrafted: after a hard start, k=1 running on
easy text stops holding position 1 at what the hard rows said). t(b, k) is the lower quartile of the
cell's last `time_window` step times (the minimum while it has <= 4), recorded only when the step
before ran the same (b, k) (with async scheduling a step's wall time is its predecessor's device
time). Noise on a shared CPU is one-sided and bursty (a few steps 1.5-2x slower whatever k runs), so
the low end of a cell's times is its cost, and a cell timed in a single visit (`explore_steps`
steps) may have been timed in a burst only: every `confirm_every` steps, one such cell that could
win at the noise the running k has seen (the ratio of its slowest recent step to its estimate) is
timed once more. Unmeasured cells are estimated (`prior_acceptance` for position 0,
`prior_draft_cost` of a k = 0 step per draft; else the measured ks around them) and tried: at a new
bucket each k deeper than any measured runs `explore_steps` steps once, best estimate first (cost is
not linear in k: the first draft carries the verify width and the head's pass over it) if, with its
acceptance at the upper end of its interval, it could beat the best measured k (where drafts are
mostly rejected, as after a hard start, such a k cannot pay for its steps:
`benchmarks/sim_policy_grid.py --hard-start`), a shallower one only while it is rated at least as
the best measured k (its rate rests on measured positions and times; a one-visit time of any k is
rechecked only if the other ks' times do not explain it and it could move the choice; trying every k
at the start of an output, whose first drafts are often hard, cost the CPU main job ~2% in
`benchmarks/sim_dynamic_k.py`). Plain steps (k = 0) are timed once k = 1 is, if at half of k = 1's
step (the fastest a plain step could be) they would beat every measured k at the upper end of its
acceptance: their time cannot be drawn from the draft steps' (on the 2-core CPU at batch 32 a k = 1
step costs 2x a plain one, and plain decoding beats every k there). At the early revisits k - 1,
never timed at the bucket, is tried if even its fastest possible step could win (`_floor_rate`:
the other ks' times may put it far off, as at a large batch, where the verify's extra tokens cost
their share of the compute), and k + 1 if it could still win; now and then k + 1 and k - 1 run
again (`_revisit`). The running choice changes only for a k estimated `switch_margin` faster (a
switch up costs a step of fewer drafts; near-ties flap). Every rank proposes; the StepPlan runs the
smallest proposal of a working rank (DESIGN.md invariant 1).
"""
from __future__ import annotations

import bisect
import itertools
import math
import os
from collections import Counter, deque

PRIOR_ROWS = 2.0          # the prior's weight, in rows, of each position's acceptance


def batch_bucket(batch_size: int) -> int:
    """Power-of-two buckets: steps of nearby batch sizes share timings."""
    return 1 << max(0, batch_size - 1).bit_length()


class DraftCountPolicy:
    """`dynamic=False`: always max_k. `cycle`: a fixed sequence of k repeated step by step (a
    test hook, LMDEPLOY_LITE_SPEC_K_CYCLE='3,0,1,2': every switch exercised, deterministically)."""

    def __init__(self, max_k: int, dynamic: bool = True, cycle: tuple[int, ...] | None = None,
                 prior_acceptance: float = 0.7, prior_draft_cost: float = 0.25,
                 decay: float = 0.98, explore_steps: int = 2,
                 revisit_every: int = 200, switch_margin: float = 0.03,
                 time_window: int = 24, confirm_every: int = 12):
        self.max_k, self.dynamic = max_k, dynamic and max_k > 0
        self.cycle = itertools.cycle([min(max(k, 0), max_k) for k in cycle]) if cycle else None
        self.prior_acceptance, self.prior_draft_cost = prior_acceptance, prior_draft_cost
        self.decay, self.explore_steps = decay, explore_steps
        self.revisit_every, self.switch_margin = revisit_every, switch_margin
        self.time_window, self.confirm_every = time_window, confirm_every
        # decayed counts per draft position: rows that reached it, rows that accepted it
        self.reached = [0.0] * max_k
        self.accepted = [0.0] * max_k
        self.times: dict[int, dict[int, float]] = {}      # bucket -> k -> seconds per step
        self.samples: dict[tuple[int, int], int] = {}
        self._recent: dict[tuple[int, int], deque] = {}   # (bucket, k) -> last step times
        self._visits: dict[tuple[int, int], int] = {}     # timed runs of like steps per cell
        self._run = 0                                     # like steps in a row before this one
        self._since_confirm = 0
        self._hold: tuple[int, int] = (0, 0)              # (k, steps left) of an exploration
        self._steps: dict[int, int] = {}                  # steps proposed per bucket
        self._choice: dict[int, int] = {}                 # the running choice per bucket
        self._last: tuple[int, int] | None = None         # (bucket, k) of the last recorded step

    @classmethod
    def from_config(cls, max_k: int, dynamic: bool) -> 'DraftCountPolicy':
        cycle = os.environ.get('LMDEPLOY_LITE_SPEC_K_CYCLE')
        if cycle and dynamic:
            return cls(max_k, cycle=tuple(int(k) for k in cycle.split(',')))
        return cls(max_k, dynamic)

    def acceptance(self, optimistic: bool = False) -> list[float]:
        """c_i for i < max_k: the estimated P(more than i drafts accepted); `optimistic`: each
        a_i at the upper end of its ~95% interval (Wilson's, over the rows behind it, the
        prior's weight included)."""
        out, prior, c = [], self.prior_acceptance, 1.0
        for reached, accepted in zip(self.reached, self.accepted):
            weight = PRIOR_ROWS * PRIOR_ROWS / (PRIOR_ROWS + reached)
            rows = reached + weight
            prior = a = (accepted + weight * prior) / rows                   # a_i
            if optimistic:
                z2 = 4.0                                                         # z = 2
                a = (a + z2 / (2 * rows) + math.sqrt(z2 * a * (1 - a) / rows
                                                     + z2 * z2 / (4 * rows * rows))
                     ) / (1 + z2 / rows)
            c *= a
            out.append(c)
        return out

    def observe_acceptance(self, num_drafts: list[int], num_accepted: list[int]):
        """One verify step's rows: real drafts each verified and how many it accepted."""
        if not self.dynamic:
            return
        # a row reaches position i with more than i drafts and i accepted, accepts it with more
        reached = Counter(min(d - 1, a) for d, a in zip(num_drafts, num_accepted) if d > 0)
        accepted_hist, decay, more_reached, more_accepted = Counter(num_accepted), self.decay, 0, 0
        for i in range(self.max_k - 1, -1, -1):          # suffix sums of the counts
            more_reached += reached[i]
            more_accepted += accepted_hist[i + 1]
            self.reached[i] = self.reached[i] * decay + more_reached
            self.accepted[i] = self.accepted[i] * decay + more_accepted
        # rows that accepted all their i drafts reached position i undrafted: its rows age as
        # that much of position i - 1's are renewed without it
        missed = Counter(d for d, a in zip(num_drafts, num_accepted) if d == a)
        for i in range(1, self.max_k):
            if missed[i] and self.reached[i - 1] > 0:
                keep = 1 - missed[i] / self.reached[i - 1]
                self.reached[i] *= keep
                self.accepted[i] *= keep

    def observe_time(self, batch_size: int, k: int, seconds: float):
        """A decode step's wall time, recorded only after a step of the same bucket and k."""
        cell = (batch_bucket(batch_size), k)
        last, self._last = self._last, cell
        self._run = self._run + 1 if last == cell else 0
        if not self.dynamic or last != cell or seconds <= 0:
            return
        if self._run == 1:
            self._visits[cell] = self._visits.get(cell, 0) + 1
        recent = self._recent.setdefault(cell, deque(maxlen=self.time_window))
        recent.append(seconds)
        self.samples[cell] = self.samples.get(cell, 0) + 1
        self.times.setdefault(cell[0], {})[k] = sorted(recent)[(len(recent) - 1) // 4]

    def noise(self, bucket: int, k: int) -> float:
        """The slowest of (bucket, k)'s recent step times over its estimate (>= 1)."""
        recent = self._recent.get((bucket, k))
        return max(recent) / self.times[bucket][k] if recent else 1.0

    def break_sequence(self):
        """A non-decode step ran: the next decode step's wall time is not its own."""
        self._last = None

    def step_time(self, bucket: int, k: int, known: dict[int, float] | None = None) -> float:
        """Measured, or estimated from the prior or the measured ks around it (relative units);
        `known`: the measured times to use (default: the bucket's)."""
        known = self.times.get(bucket, {}) if known is None else known
        if k in known:
            return known[k]
        if not known:
            return 1.0 + self.prior_draft_cost * k           # relative units: only ratios matter
        ks = sorted(known)
        if len(ks) >= 2:            # the measured ks around k, or the two nearest at one end
            i = min(max(bisect.bisect(ks, k), 1), len(ks) - 1)
            lo, hi = ks[i - 1], ks[i]
            slope = (known[hi] - known[lo]) / (hi - lo)
            return max(known[lo] + slope * (k - lo), 1e-9)
        j, cost = ks[0], self.prior_draft_cost       # scaled by the k = 0 time that j's implies
        return known[j] / (1.0 + cost * j) * (1.0 + cost * k)

    def rates(self, bucket: int, optimistic: bool = False) -> list[float]:
        """Estimated tokens per second per sequence for each k in 0..max_k."""
        tokens = itertools.accumulate(self.acceptance(optimistic), initial=1.0)   # E(k)
        return [t / self.step_time(bucket, k) for k, t in enumerate(tokens)]

    def best(self, batch_size: int) -> int:
        rates = self.rates(batch_bucket(batch_size))
        return max(range(len(rates)), key=lambda k: (rates[k], -k))

    def propose(self, batch_size: int) -> int:
        """This rank's k for a step of `batch_size` sequences (prefill or decode)."""
        if self.cycle is not None:
            return next(self.cycle)
        if not self.dynamic:
            return self.max_k
        k, left = self._hold
        if left > 0:
            self._hold = (k, left - 1)
            return k
        bucket = batch_bucket(batch_size)
        steps = self._steps[bucket] = self._steps.get(bucket, 0) + 1
        rates = self.rates(bucket)
        best = max(range(len(rates)), key=lambda j: (rates[j], -j))
        unexplored = self._unexplored(bucket, rates)
        if unexplored is not None:
            return self._explore(unexplored)
        revisit = self._revisit(steps)
        if revisit == 'early' and best > 0 and not self.samples.get((bucket, best - 1), 0) and (
                self._floor_rate(bucket, best - 1, best) > rates[best]):
            return self._explore(best - 1)
        if revisit == 'up' or revisit == 'early' and best < self.max_k and (
                self.rates(bucket, optimistic=True)[best + 1] > rates[best]):
            return self._explore(min(best + 1, self.max_k))
        if revisit == 'down' and best > 0:
            return self._explore(best - 1)
        current = self._choice.get(bucket)
        unconfirmed = self._unconfirmed(bucket, current, rates)
        if unconfirmed is not None:
            return self._explore(unconfirmed)
        if current is not None and rates[best] < rates[current] * (1 + self.switch_margin):
            return current
        self._choice[bucket] = best
        return best

    def _revisit(self, steps: int) -> str | None:
        """'up' (k + 1) or 'down' (k - 1) at this bucket's step `steps`, every revisit_every
        steps; 'early' at 1/8, 1/4 and 1/2 of it: k + 1 again if it could still win, its c_k
        at the optimistic end (a bucket's first drafts are few and the start of an output is
        harder to draft, and only k + 1 measures c_k; running at a k measures every position
        below it, so a k too high corrects itself)."""
        every = self.revisit_every
        if steps in (every // 8, every // 4, every // 2):
            return 'early'
        if steps % every == 0:
            return 'up'
        return 'down' if steps % every == every // 2 and steps > every else None

    def _unexplored(self, bucket: int, rates: list[float]) -> int | None:
        """A k not timed yet at this bucket worth a visit, the best estimate first. A k below a
        measured one only while it could be the best (rated at least as the best measured k):
        its rate rests on positions already measured and on a step time between or near
        measured ones, where a deeper k's rests on positions no step has drafted (so it is
        tried while its optimistic rate could win). k = 0, once k = 1 is timed, is rated at
        the fastest its step could be beside k = 1's (`_floor_rate`: half of it) and tried if
        that beats every measured k at the upper end of its acceptance: plain time cannot be
        drawn from the draft steps' (no verify width, no draft pass; a CPU at batch 32: 27 ms
        against k=1's 55), and deeper ks bound it too loosely to act on (a CPU at batch 1: a
        third of k=2's step, 6 ms against 10)."""
        measured = [j for j in range(len(rates)) if self.samples.get((bucket, j), 0)]
        top = max((rates[j] for j in measured), default=0.0)
        reach = self.rates(bucket, optimistic=True)    # a deeper k: could it win at all?
        top_reach = max((reach[j] for j in measured if j), default=0.0)
        floor = self._floor_rate(bucket, 0, 1) if 1 in self.times.get(bucket, {}) else 0.0
        for j in sorted(range(len(rates)), key=lambda j: -max(rates[j], floor if j == 0 else 0)):
            if j not in measured and (j > max(measured, default=-1) and reach[j] >= top
                                      or rates[j] >= top or j == 0 and floor >= top_reach):
                return j
        return None

    def _floor_rate(self, bucket: int, k: int, measured: int) -> float:
        """k's rate were its step as fast as it can be beside the deeper `measured` k's: its
        time in proportion to the tokens a row runs through the target (k + 1), as when a step
        is all compute and the draft passes cost nothing. The time the other ks imply may be
        far off: the prior's draft cost fits a step that reads weights, not one at a batch where
        the verify's extra tokens cost their share of the compute."""
        expected = sum(self.acceptance()[:k]) + 1.0
        return expected / (self.step_time(bucket, measured) * (k + 1) / (measured + 1))

    def _unconfirmed(self, bucket: int, current: int | None, rates: list[float]) -> int | None:
        """Every `confirm_every` steps: the best-rated k timed in one visit only whose rate,
        were its time inflated by a burst as slow as the running k's slowest, could beat the
        running k's by `switch_margin` (else the choice would not move); inflated only by what
        its time exceeds what the other ks' times put it at (a time they explain is not
        suspect), for a k deeper than all of them the deepest one's time (a step drafting more
        is not faster). Where nothing is accepted, re-timing k=1..3 cost ~1% of the run."""
        self._since_confirm += 1
        if current is None or self._since_confirm < self.confirm_every:
            return None
        self._since_confirm = 0
        noise, known = self.noise(bucket, current), self.times.get(bucket, {})
        for k in sorted(range(len(rates)), key=lambda j: -rates[j]):
            if k == current or self._visits.get((bucket, k), 0) != 1:
                continue
            others = {j: t for j, t in known.items() if j != k}
            inflated = noise
            if others:             # only what its time exceeds the others' account of it
                deepest = max(others)
                implied = others[deepest] if k > deepest else self.step_time(bucket, k, others)
                inflated = min(noise, max(known[k] / implied, 1.0))
            if rates[k] * inflated > rates[current] * (1 + self.switch_margin):
                return k
        return None

    def _explore(self, k: int) -> int:
        # explore_steps + 1: the first step after a switch is not timed (nor fully drafted)
        self._hold = (k, self.explore_steps)
        return k
