"""Summarize the step traces that trace_hook/sitecustomize.py wrote: decode and chunk (prefill or
mixed) steps, the intervals between consecutive step ends (what a decoding stream sees on the
engine's side), and the longest intervals with the steps that made them.

    python benchmarks/step_trace.py DIR [--top 12]
"""
from __future__ import annotations

import argparse
import glob
import os
import statistics


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float('nan')


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('dir')
    parser.add_argument('--top', type=int, default=12)
    args = parser.parse_args()
    for path in sorted(glob.glob(os.path.join(args.dir, 'steps_*.tsv'))):
        rows = [line.split('\t') for line in open(path) if line.strip()]
        steps = [(float(t), float(s), float(c), d == '1', int(n), int(q))
                 for t, s, c, d, n, q in rows]
        if len(steps) < 2:
            continue
        ms = lambda xs: ' / '.join(f'{1000 * f(xs):.2f}' for f in (
            statistics.median, lambda v: pct(v, 0.99), max))
        decode = [s for _, s, _, d, _, _ in steps if d]
        chunk = [s for _, s, _, d, _, _ in steps if not d]
        gaps = [(b[0] - a[0], b) for a, b in zip(steps, steps[1:])]
        print(f'{os.path.basename(path)}: {len(steps)} steps, {len(decode)} decode '
              f'(ms median / p99 / max: {ms(decode)}), {len(chunk)} with prompt tokens '
              f'({ms(chunk) if chunk else "-"}); intervals between step ends '
              f'{ms([g for g, _ in gaps])}')
        for gap, (_, s, c, d, n, q) in sorted(gaps, reverse=True)[:args.top]:
            print(f'  {1000 * gap:7.2f} ms: {"decode" if d else "chunk "} step {1000 * s:6.2f} ms '
                  f'(to tokens {1000 * c:6.2f}), {n} rows, {q} tokens')


if __name__ == '__main__':
    main()
