"""Inter-token latency of running streams while a long prompt is prefilled, mixed steps vs not.

    python benchmarks/bench_itl.py --preset qwen3_5_0_8b --device cuda --dtype bfloat16
        [--streams 32 --prompt-len 128 --long-prompt-len 8192] [--mixed | --no-mixed]
        [--max-mixed-tokens 512] [--num-spec-tokens 3 --synthetic-acceptance 0.8,0.6,0.5]
    python benchmarks/bench_itl.py --streams 8 --long-prompt-len 2048      # CPU, embedded model

`--streams` sequences of `--prompt-len` random tokens are prefilled and decode `--pre-steps`
steps; then one `--long-prompt-len` prompt arrives, and the engine steps until it has its first
token and `--post-steps` steps more. A token reaches its stream when the `Engine.step()` that
reports it returns, as a server would deliver it (with async scheduling, one step after the one
that computed it; `--synchronize`: the device is synchronized after each step, which serializes
every step's host and device work and so misleads the adaptive budget, whose decode times are
then host times: the runs before 2026-11-27 evening did that). A stream's inter-token intervals are the gaps between its reports.
The JSON's `timeline`: each window step's start and end (ms from the arrival), what it scheduled,
the stream tokens it handed out, and the time spent in Engine.step's parts (`PHASES`).
`window` = the intervals that overlap the time from the long prompt's arrival to its first token
(a stream stalled by the prefill has its stall in one of them); `base` = those that end before
the arrival; `all` = every interval. ttft = arrival to first token of the
long prompt. `p99/base` = the window's p99 over the base median: the goal is <= 3.

Mixed: PytorchEngineConfig.max_mixed_token_num = `--max-mixed-tokens` (prefill chunks ride
with the decode rows; under speculation, chunk steps alternate with decode steps); no-mixed: 0
(the whole prefill first, in chunks of `--max-prefill-tokens`). Without either flag both run,
on one engine (the scheduler's budget is switched between the runs; the engine is drained).
A preset has dummy weights: give `--synthetic-acceptance` with `--num-spec-tokens`.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import os
import time
import traceback
import warnings

import torch
from common import (add_model_args, environment, output_path, print_table, release_memory,
                    resolve_model, save_json, synchronize)

from lmdeploy_lite.messages import GenerationConfig, PytorchEngineConfig, SpeculativeConfig
from lmdeploy_lite.pytorch.engine.build import build_engine
from lmdeploy_lite.pytorch.engine.engine import Engine

COLUMNS = ['mode', 'streams', 'long', 'ttft_s', 'window_steps', 'base_med_ms', 'win_med_ms',
           'win_p99_ms', 'win_max_ms', 'all_med_ms', 'all_p99_ms', 'p99/base', 'mixed_steps',
           'chunk_med']


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); nan for no values (a short warm-up run under
    async scheduling reports a stream's tokens a step late and may see no interval)."""
    if not values:
        return float('nan')
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


def random_prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (num, length), generator=generator).tolist()


# Engine.step's parts, timed in each window step of the timeline (ms; waits for the device
# included): scheduling (with the wait for a held step's results when it is not continued),
# building the inputs, the forward's launch or replay (its model part: agent._forward), applying
# (or holding) the results; gcN: the garbage collector's pauses (generation N) in the step;
# with --diagnose (CUDA): cudaMalloc, the device allocations, and syncs, the ops torch's sync
# debug mode saw wait for the device, with the package's frames
show_warning = warnings.showwarning
PHASES = ('_schedule', '_make_inputs', 'agent.step', 'agent._forward', '_update_or_hold',
          'agent._prefill_and_draft', 'agent._save_drafts')     # where the agent has them


def count_mallocs(device: torch.device) -> int:
    """The CUDA caching allocator's device allocations so far (0 elsewhere)."""
    return torch.cuda.memory_stats(device).get('num_device_alloc', 0) if device.type == 'cuda' else 0


def time_phases(engine, diagnose: bool = False) -> dict[str, float]:
    """Wrap `PHASES` on `engine` (instance attributes; `run_scenario` deletes them): each call's
    milliseconds are added to the returned dict, which the caller clears per step."""
    spent: dict[str, float] = {}

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] = spent.get(name, 0.0) + 1000 * (time.perf_counter() - start)
        return wrapper
    for name in PHASES:
        owner, attr = (engine.agent, name.split('.')[1]) if '.' in name else (engine, name)
        if hasattr(owner, attr):
            setattr(owner, attr, timed(name, getattr(owner, attr)))
    gc_began = []

    def collected(phase, info):     # Python's garbage collector pauses, within those parts
        if phase == 'start':
            gc_began.append(time.perf_counter())
        elif gc_began:
            key = f'gc{info["generation"]}'
            spent[key] = spent.get(key, 0.0) + 1000 * (time.perf_counter() - gc_began.pop())
    gc.callbacks.append(collected)
    if diagnose and engine.device.type == 'cuda':   # ops that wait for the device, and where
        warnings.showwarning = lambda message, *_: spent.setdefault('syncs', []).append(
            f'{message}'[:60] + ' at ' + ' < '.join(
                f'{os.path.basename(f.filename)}:{f.lineno}' for f in traceback.extract_stack()
                if 'lmdeploy_lite' in f.filename)[-3:])
        torch.cuda.set_sync_debug_mode('warn')
        warnings.filters.insert(0, ('always', None, Warning, None, 0))  # run_scenario removes it
    return spent


def profile_step():
    """torch's profiler over host ops and CUDA runtime calls (cudaStreamSynchronize,
    cudaHostAlloc, ... show there where torch's sync debug mode sees nothing)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(activities=activities)


def top_host_ops(profiler, n: int = 8) -> list[tuple[str, float]]:
    """The `n` ops or runtime calls with the most self host time (ms)."""
    events = sorted(profiler.key_averages(), key=lambda e: -e.self_cpu_time_total)[:n]
    return [(e.key[:50], round(e.self_cpu_time_total / 1000, 2)) for e in events]


def run_scenario(engine: Engine, streams: int, prompt_len: int, long_len: int, pre_steps: int,
                 post_steps: int, seed: int = 0, synchronize_steps: bool = False,
                 diagnose: bool = False) -> dict:
    """One measured run (see the module docstring); aborts and drains everything afterwards.
    `diagnose`: count device allocations and list the ops that wait for the device in each
    step (CUDA; they cost host time in every step, so the intervals are not the plain ones)."""
    vocab = engine.model_config.vocab_size
    gen = GenerationConfig(max_new_tokens=engine.session_len - prompt_len - 1, ignore_eos=True)
    seqs = [engine.add_request(p, gen) for p in random_prompts(streams, prompt_len, vocab, seed)]
    while not all(s.prefilled for s in seqs):
        engine.step()
    step_kinds, schedule = [], engine.scheduler.schedule
    continue_mixed = engine.scheduler.continue_mixed

    def record(batch):
        if batch is not None:
            step_kinds.append((batch.num_decode_rows, len(batch.seqs),
                               sum(n for seq, n in zip(batch.seqs, batch.q_lens)
                                   if not seq.prefilled)))
        return batch
    # the steps the scheduler schedules, and the mixed steps async scheduling continues
    engine.scheduler.schedule = lambda: record(schedule())
    engine.scheduler.continue_mixed = lambda held: record(continue_mixed(held))
    phases = time_phases(engine, diagnose)
    device_mallocs = count_mallocs if diagnose else (lambda device: 0)
    stream_ids = {s.seq_id for s in seqs}
    reports = {i: [] for i in stream_ids}          # seq_id -> times its tokens were reported
    long_seq, arrival, first_token, steps_left, step = None, None, None, None, 0
    timeline = []
    steps_at_arrival = steps_at_first = 0
    try:
        while steps_left is None or steps_left > 0:
            if step == pre_steps:
                (prompt,) = random_prompts(1, long_len, vocab, seed + 1)
                long_seq = engine.add_request(prompt, GenerationConfig(max_new_tokens=1))
                arrival, steps_at_arrival = time.perf_counter(), len(step_kinds)
            mallocs = device_mallocs(engine.device)        # read outside the timed interval
            began, kinds_before = time.perf_counter(), len(step_kinds)
            profiled = diagnose and pre_steps <= step <= pre_steps + 1
            with profile_step() if profiled else contextlib.nullcontext() as profiler:
                outputs = engine.step()
                if synchronize_steps:
                    synchronize(engine.device)
            now = time.perf_counter()
            if profiled:       # the arrival's step and the next: where their host time went
                phases['profile'] = top_host_ops(profiler)
            mallocs = device_mallocs(engine.device) - mallocs
            if mallocs:                                   # cudaMalloc may wait for the device
                phases['cudaMalloc'] = mallocs
            step += 1
            if arrival is not None and (first_token is None or steps_left > post_steps - 3):
                # the window's steps, for finding its long intervals: when each ran (ms from the
                # arrival), what it scheduled (decode rows, rows, chunk tokens; none: it only
                # handed out a held step's tokens) and how many stream tokens it handed out
                timeline.append((1000 * (began - arrival), 1000 * (now - arrival),
                                 step_kinds[kinds_before:] or None,
                                 sum(bool(o.new_token_ids) and o.seq.seq_id in stream_ids
                                     for o in outputs), dict(phases)))
            phases.clear()
            for out in outputs:
                if not out.new_token_ids:
                    continue
                if out.seq.seq_id in stream_ids:
                    reports[out.seq.seq_id].append(now)
                elif out.seq is long_seq and first_token is None:
                    first_token, steps_at_first = now, len(step_kinds)
                    steps_left = post_steps
            if steps_left is not None and first_token != now:
                steps_left -= 1
    finally:
        del engine.scheduler.schedule, engine.scheduler.continue_mixed
        for name in PHASES:
            owner, attr = (engine.agent, name.split('.')[1]) if '.' in name else (engine, name)
            if attr in vars(owner):
                delattr(owner, attr)
        gc.callbacks.clear()
        if diagnose and engine.device.type == 'cuda':
            torch.cuda.set_sync_debug_mode('default')
            warnings.showwarning = show_warning
            warnings.filters.remove(('always', None, Warning, None, 0))
        for seq in seqs:
            engine.abort(seq)
        while engine.has_work:
            engine.step()
    intervals = [(a, b) for times in reports.values() for a, b in zip(times, times[1:])]
    base = [b - a for a, b in intervals if b <= arrival]
    window = [b - a for a, b in intervals if a < first_token and b > arrival]
    every = [b - a for a, b in intervals]
    in_window = step_kinds[steps_at_arrival:steps_at_first]
    ms = 1000.0
    return {'streams': streams, 'long': long_len, 'ttft_s': first_token - arrival,
            'window_steps': len(in_window),
            'mixed_steps': sum(0 < d < n for d, n, _ in in_window),
            # the prompt tokens the window's steps carried (the mixed budget's chunks)
            'chunk_med': percentile([c for _, _, c in in_window if c], 50),
            'base_med_ms': ms * percentile(base, 50), 'win_med_ms': ms * percentile(window, 50),
            'win_p99_ms': ms * percentile(window, 99), 'win_max_ms': ms * percentile(window, 100),
            'all_med_ms': ms * percentile(every, 50), 'all_p99_ms': ms * percentile(every, 99),
            'p99/base': percentile(window, 99) / percentile(base, 50),
            'num_intervals': {'base': len(base), 'window': len(window), 'all': len(every)},
            'timeline': timeline}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser)
    parser.add_argument('--streams', type=int, default=32)
    parser.add_argument('--prompt-len', type=int, default=128)
    parser.add_argument('--long-prompt-len', type=int, default=8192)
    parser.add_argument('--pre-steps', type=int, default=16,
                        help='decode steps before the long prompt arrives')
    parser.add_argument('--post-steps', type=int, default=16,
                        help='steps after the long prompt has its first token')
    parser.add_argument('--mixed', action=argparse.BooleanOptionalAction, default=None,
                        help='only the mixed run (--mixed) or only prefill-first (--no-mixed); '
                        'default both')
    parser.add_argument('--max-mixed-tokens', type=int, default=512,
                        help='PytorchEngineConfig.max_mixed_token_num of the mixed run')
    parser.add_argument('--max-mixed-step-cost', type=float, default=0.0,
                        help='PytorchEngineConfig.max_mixed_step_cost (> 1: the mixed budget '
                             'follows step times, within --max-mixed-tokens; implies --mixed)')
    parser.add_argument('--max-prefill-tokens', type=int, default=4096,
                        help='PytorchEngineConfig.max_prefill_token_num')
    parser.add_argument('--num-spec-tokens', type=int, default=0, help='MTP k (0: plain)')
    parser.add_argument('--synthetic-acceptance', default=None,
                        help='per-position accept rates for dummy weights, e.g. 0.8,0.6,0.5')
    parser.add_argument('--diagnose', action='store_true',
                        help='the timeline also counts device allocations and lists the ops '
                        'that wait for the device (CUDA; costs host time every step)')
    parser.add_argument('--synchronize', action='store_true',
                        help='synchronize the device after each step (the old timing)')
    parser.add_argument('--out', default=None)
    args = parser.parse_args()
    model_dir, load_format = resolve_model(args)
    k = args.num_spec_tokens
    # the streams decode through the whole window: at most 2 steps per chunk (alternating)
    chunk = max(min(args.max_mixed_tokens, args.max_prefill_tokens) - args.streams * (1 + k), 1)
    if args.max_mixed_step_cost:          # the adaptive budget may settle on its smallest chunk
        args.mixed, chunk = True, min(chunk, 16)
    window_steps = 2 * -(-args.long_prompt_len // chunk) + 16
    session_len = max(args.long_prompt_len + 2, args.prompt_len + (1 + k) * (
        args.pre_steps + args.post_steps + window_steps))
    modes = {True: ['mixed'], False: ['no-mixed'], None: ['no-mixed', 'mixed']}[args.mixed]
    engine = build_engine(model_dir, PytorchEngineConfig(
        dtype=args.dtype, device=args.device, max_batch_size=args.streams + 1,
        session_len=session_len, max_prefill_token_num=args.max_prefill_tokens,
        max_mixed_token_num=args.max_mixed_tokens if 'mixed' in modes else 0,
        max_mixed_step_cost=args.max_mixed_step_cost,
        load_format=load_format, seed=args.seed, async_scheduling=args.async_scheduling),
        SpeculativeConfig(num_speculative_tokens=k) if k else None, progress=False)
    if args.synthetic_acceptance:
        from bench_spec import synthetic_rejection_sampler
        engine.agent.rejection_sampler = synthetic_rejection_sampler(
            [float(r) for r in args.synthetic_acceptance.split(',')])
    rows = []
    for mode in modes:
        engine.scheduler.max_mixed_token_num = args.max_mixed_tokens if mode == 'mixed' else 0
        # warm-up: every kind of step this mode runs, on small shapes first
        warm_len = min(args.long_prompt_len, args.max_prefill_tokens + args.max_mixed_tokens)
        run_scenario(engine, min(args.streams, 2), 16, warm_len, 2, 2, seed=99)
        row = run_scenario(engine, args.streams, args.prompt_len, args.long_prompt_len,
                           args.pre_steps, args.post_steps, synchronize_steps=args.synchronize,
                           diagnose=args.diagnose)
        rows.append({'mode': mode, **row})
    device_name = environment()['device']
    dtype = engine.dtype
    del engine
    release_memory()
    save_json(output_path(args.out, f'bench_itl_{args.preset or "model"}_'
                          f'{torch.device(args.device).type}.json'),
              {'env': environment(), 'model': args.preset or model_dir, 'load_format': load_format,
               'dtype': str(dtype), 'num_spec_tokens': k,
               'synthetic_acceptance': args.synthetic_acceptance,
               'max_mixed_token_num': args.max_mixed_tokens,
               'max_mixed_step_cost': args.max_mixed_step_cost,
               'max_prefill_token_num': args.max_prefill_tokens, 'rows': rows})
    print(f'model: {args.preset or model_dir} ({load_format} weights), {dtype} on {device_name}; '
          f'k={k}; {args.streams} streams of {args.prompt_len} tokens, then a '
          f'{args.long_prompt_len}-token prompt; mixed budget {args.max_mixed_tokens} (step cost '
          f'{args.max_mixed_step_cost or "fixed"}), prefill '
          f'budget {args.max_prefill_tokens}')
    print_table(rows, COLUMNS)


if __name__ == '__main__':
    main()
