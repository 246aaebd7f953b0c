"""Async scheduling on vs off: tokens/s, TPOT and the device's idle share per decode step.

    python benchmarks/bench_async.py --device cuda --dtype bfloat16 [--preset qwen3_5_9b
        --synthetic-acceptance 0.8,0.6,0.5 | --model DIR] [--batch-sizes 1,8,32,64] [--ks 3]
        [--out bench_async.json]

One engine per k; `async_scheduling` is switched between the two runs of each batch size (the
engine is drained first). Without --preset the model is the embedded one and its prompts are
held-out text (real MTP acceptance); a preset runs on dummy weights, so give it
--synthetic-acceptance. Each row times `--decode-steps` steps after `--warmup-steps` (prefill
excluded); TPOT is the window over the tokens one sequence received in it. `device_idle` is the
share of a second, profiled window of the same length in which no kernel, copy or memset ran on
the GPU (torch.profiler's device timeline, the union of busy intervals between the first and the
last; the profiler adds some host time to each launch, in both modes). `host_syncs` counts the
synchronizing CUDA calls torch reports (`torch.cuda.set_sync_debug_mode`) in a third window: with
async scheduling on, the only wait per step should be the event of the step before.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import warnings

import torch
from bench_spec import synthetic_rejection_sampler
from common import (ROOT, add_model_args, environment, output_path, print_table,
                    release_memory, resolve_model, save_json, timed_decode)

from lmdeploy_lite.messages import GenerationConfig, PytorchEngineConfig, SpeculativeConfig
from lmdeploy_lite.pytorch.engine.build import build_engine
from lmdeploy_lite.pytorch.engine.engine import Engine

_DEVICE_CATEGORIES = ('kernel', 'gpu_memcpy', 'gpu_memset')


def busy_share(trace_path: str) -> float | None:
    """Union of the device's busy intervals over the span from its first to its last activity,
    read from a chrome trace (None when the trace holds no device activity)."""
    with open(trace_path) as f:
        events = json.load(f)['traceEvents']
    spans = sorted((e['ts'], e['ts'] + e['dur']) for e in events
                   if e.get('cat') in _DEVICE_CATEGORIES and e.get('dur') is not None)
    if not spans:
        return None
    busy, end = 0.0, spans[0][0]
    for start, stop in spans:
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    return busy / (spans[-1][1] - spans[0][0])


class DeviceTimeline:
    """Context manager: profiles the device only; `.idle` after exit."""

    def __enter__(self):
        from torch.profiler import ProfilerActivity, profile
        self.prof = profile(activities=[ProfilerActivity.CUDA])
        self.prof.__enter__()
        return self

    def __exit__(self, *exc):
        self.prof.__exit__(*exc)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, 'trace.json')
            self.prof.export_chrome_trace(path)
            share = busy_share(path)
        self.idle = None if share is None else 1 - share


class SyncCounter:
    """Context manager: counts torch's warnings about synchronizing CUDA calls."""

    def __enter__(self):
        self.catcher = warnings.catch_warnings(record=True)
        self.records = self.catcher.__enter__()
        warnings.simplefilter('always')
        torch.cuda.set_sync_debug_mode('warn')
        return self

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode('default')
        self.catcher.__exit__(*exc)
        self.messages = [str(w.message) for w in self.records
                         if 'synchroniz' in str(w.message).lower()]
        self.count = len(self.messages)


def held_out_prompts(model_dir: str, num_prompts: int, prompt_tokens: int) -> list[list[int]]:
    sys.path.insert(0, os.path.join(ROOT, 'benchmarks'))
    sys.path.insert(0, os.path.join(ROOT, 'tools'))
    from eval_embedded_acceptance import held_out_prompts as prompts

    from lmdeploy_lite.api import load_tokenizer
    return prompts(load_tokenizer(model_dir), num_prompts, prompt_tokens)


def drain(engine: Engine):
    while engine.has_work:
        engine.step()


def measure(engine: Engine, prompts, k: int, args) -> dict:
    batch = len(prompts)
    cfg = GenerationConfig(max_new_tokens=(args.warmup_steps + args.decode_steps + 2) * (k + 1),
                           ignore_eos=True)
    window = dict(warmup_steps=args.warmup_steps, decode_steps=args.decode_steps)
    drain(engine)
    elapsed, generated = timed_decode(engine, prompts, cfg, **window)
    row = {'k': k, 'batch': batch, 'async': engine.async_scheduling,
           'step_ms': 1000 * elapsed / args.decode_steps, 'tok_s': generated / elapsed,
           'tpot_ms': 1000 * elapsed * batch / max(generated, 1),
           'mean_accepted_len': engine.spec_stats.mean_accepted_length if k else 1.0}
    if engine.device.type == 'cuda':
        drain(engine)
        timeline = DeviceTimeline()
        timed_decode(engine, prompts, cfg, around=timeline, **window)
        row['device_idle'] = timeline.idle
        drain(engine)
        syncs = SyncCounter()
        timed_decode(engine, prompts, cfg, around=syncs, **window)
        row['host_syncs_per_step'] = syncs.count / args.decode_steps
        row['sync_examples'] = sorted(set(syncs.messages))[:3]
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser)
    parser.add_argument('--batch-sizes', default='1,8,32,64')
    parser.add_argument('--ks', default='3')
    parser.add_argument('--prompt-len', type=int, default=64)
    parser.add_argument('--decode-steps', type=int, default=32)
    parser.add_argument('--warmup-steps', type=int, default=4)
    parser.add_argument('--synthetic-acceptance', default=None,
                        help='comma-separated conditional acceptance rates per draft position')
    parser.add_argument('--out', default=None)
    args = parser.parse_args()
    batch_sizes = [int(b) for b in args.batch_sizes.split(',')]
    model_dir, load_format = resolve_model(args)
    rates = ([float(r) for r in args.synthetic_acceptance.split(',')]
             if args.synthetic_acceptance else None)
    if args.preset:
        generator = torch.Generator().manual_seed(0)
        all_prompts = torch.randint(2, 1000, (max(batch_sizes), args.prompt_len),
                                    generator=generator).tolist()      # any ids: dummy weights
    else:
        all_prompts = held_out_prompts(model_dir, max(batch_sizes), args.prompt_len)
    steps = args.warmup_steps + args.decode_steps + 4
    rows = []
    for k in [int(x) for x in args.ks.split(',')]:
        spec = SpeculativeConfig(method='qwen3_5_mtp', num_speculative_tokens=k) if k else None
        engine = build_engine(model_dir, PytorchEngineConfig(
            dtype=args.dtype, device=args.device, max_batch_size=max(batch_sizes),
            session_len=args.prompt_len + steps * (k + 1) + 16, load_format=load_format,
            seed=args.seed), spec, progress=False)
        if k and rates:
            engine.agent.rejection_sampler = synthetic_rejection_sampler(rates)
        measure(engine, all_prompts[:2], k, argparse.Namespace(warmup_steps=2, decode_steps=2))
        for batch in batch_sizes:
            for async_scheduling in (False, True):
                engine.async_scheduling = async_scheduling
                rows.append(measure(engine, all_prompts[:batch], k, args))
        del engine
        release_memory()
    for off, on in zip(rows[::2], rows[1::2]):
        on['speedup'] = on['tok_s'] / off['tok_s']
    name = args.preset or model_dir
    save_json(output_path(args.out, f'bench_async_{args.preset or "model"}_{args.device}.json'),
              {'env': environment(), 'model': name, 'load_format': load_format,
               'dtype': args.dtype, 'synthetic_acceptance': rates, 'rows': rows})
    print(f'model: {name} ({load_format} weights), {args.dtype} on {environment()["device"]}; '
          f'synthetic acceptance: {rates}')
    print_table(rows, ['batch', 'k', 'async', 'step_ms', 'tok_s', 'tpot_ms', 'speedup',
                       'mean_accepted_len', 'device_idle', 'host_syncs_per_step'])


if __name__ == '__main__':
    main()
