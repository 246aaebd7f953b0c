"""The rank side of every executor: `worker_main` joins the world, builds the rank's Engine and
runs `rank_loop` (mp.py tells how the ranks advance and fail)."""
from __future__ import annotations

import collections
import gc
import os
import queue
import signal
import traceback
from typing import Callable

from lmdeploy_lite.messages import PytorchEngineConfig, SpeculativeConfig
from lmdeploy_lite.pytorch.config import DistConfig
from lmdeploy_lite.pytorch.engine.executor.client import EngineStats
from lmdeploy_lite.pytorch.engine.executor.lifeline import Lifeline, follow_parent
from lmdeploy_lite.pytorch.engine.heartbeat import Heartbeats
from lmdeploy_lite.pytorch.engine.sequence import request_error
from lmdeploy_lite.pytorch.engine.step_output import StepOutput

IDLE_WAIT_S = 0.02
NUM_THREADS_ENV = 'LMDEPLOY_LITE_NUM_THREADS'


def uses_cuda(device: str) -> bool:
    import torch
    return device == 'cuda' or (device == 'auto' and torch.cuda.is_available())


def rank_device(device: str, local_rank: int):
    """`cuda:{local_rank}`, made current (every later 'cuda' tensor lands there); None on CPU."""
    import torch
    if not uses_cuda(device):
        return None
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise ValueError(f'device={device!r}: this rank needs cuda:{local_rank}, but the process '
                         f'sees {count} GPU(s) (CUDA_VISIBLE_DEVICES='
                         f'{os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>")})')
    torch.cuda.set_device(local_rank)
    return torch.device('cuda', local_rank)


def worker_main(rank: int, dist_config: DistConfig, model_path: str,
                engine_config: PytorchEngineConfig, spec_config: SpeculativeConfig | None,
                init_method: str, inbox, outbox, env: dict, local_rank: int,
                lifeline: Lifeline | None = None, worker_hook: Callable | None = None,
                heartbeats: Heartbeats | None = None, whole_environ: bool = False):
    """One rank; `local_rank`: its GPU among those this process sees; `lifeline`: None where the
    launcher ties its life (ray); `env`: added to the environment, or with `whole_environ` all
    of it (a fork server's child has the server's, from when it started)."""
    if lifeline is not None:
        follow_parent(lifeline)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if whole_environ:
        os.environ.clear()
    os.environ.update(env)
    import torch

    from lmdeploy_lite.pytorch.distributed import DistContext
    from lmdeploy_lite.pytorch.engine.build import build_engine
    torch.set_num_threads(int(env[NUM_THREADS_ENV]))      # the front-end's worker_num_threads
    dist_ctx = None
    try:
        device = rank_device(engine_config.device, local_rank)
        dist_ctx = DistContext.init(dist_config, rank, init_method, device)
        if heartbeats is not None:
            dist_ctx.heartbeat = heartbeats.beater(rank)
        from lmdeploy_lite.tokenizer import load_tokenizer     # stop words need it
        tokenizer = load_tokenizer(model_path)
        engine = build_engine(model_path, engine_config, spec_config, tokenizer=tokenizer,
                              progress=False, dist_ctx=dist_ctx)
        if worker_hook is not None:
            worker_hook(engine)
        # what building left (the modules, the model's Python objects: ~170k for the embedded
        # model) out of the collector's full passes, which scan it all holding the GIL between
        # two steps (~60 ms a pass on the 2-core CPU; serve() does the same in its process)
        gc.collect()
        gc.freeze()
        bm = engine.scheduler.bm          # how the front-end names this rank's cached prefixes
        outbox.put(('ready', rank, (bm.block_size, bm.lookahead, bm.caching)))
        rank_loop(rank, engine, inbox, outbox.put, dist_ctx.heartbeat)
    except BaseException as e:
        outbox.put(('error', rank, (summarize(rank, e), traceback.format_exc())))
    finally:
        if dist_ctx is not None:
            dist_ctx.destroy()


def summarize(rank: int, error: BaseException) -> str:
    """One line for users: the exception's first line, with the rank named."""
    lines = str(error).strip().splitlines()
    line = lines[0][:500] if lines else ''
    if line.startswith(f'rank {rank},'):            # distributed.py's errors name it already
        return f'{type(error).__name__}: {line}'
    return f'rank {rank} failed: {type(error).__name__}' + (f': {line}' if line else '')


def rank_loop(rank: int, engine, inbox, send: Callable[[tuple], None],
              beat: Callable[..., None] | None = None):
    """Every rank's loop, in its own process or a front-end thread: read the inbox, step, `send`
    one report per step. Each TP rank reads the same events in the same order from its own
    inbox; with TP peers it admits, before a step, as many as the fewest of them had received at
    the plan of the step before (`Engine.num_events_agreed`), so their schedulers decide alike
    without a collective of their own. Only TP rank 0 reports."""
    request_of: dict[int, int] = {}          # seq_id -> front-end request id
    seq_of: dict[int, object] = {}           # request id -> Sequence
    leader = engine.dist.tp_rank == 0
    alone = engine.dist.config.tp == 1       # no TP peer to agree with: admit on arrival
    route_by_prefix = engine.dist.config.dp > 1      # the front-end routes by cached prefixes
    last_seen = None                                 # what the figures last reported showed
    received: collections.deque = collections.deque()    # events read, not yet admitted
    while not engine.stopped:
        if beat is not None:
            beat()
        # an idle rank of a busy plan group must reach the next plan gather at once, and so
        # must a rank holding events its peers have not agreed on yet
        busy = engine.has_work or engine.plan_busy or received
        new = _drain(inbox, None if busy else IDLE_WAIT_S)
        received += new
        engine.num_events_seen += len(new)
        # alone: all of them; else those every peer had at the last plan (admitted in order:
        # seen - len(received) have been admitted)
        count = (len(received) if alone else
                 engine.num_events_agreed - (engine.num_events_seen - len(received)))
        reports = []                         # one message to the front-end per step
        for _ in range(count):
            kind, payload = received.popleft()
            reports += _admit(engine, kind, payload, request_of, seq_of)
        for out in engine.step():
            rid = request_of[out.seq.seq_id]
            reports.append((rid, out))       # pickled without its Sequence
            if out.finished:
                del request_of[out.seq.seq_id], seq_of[rid]
        # the prefix cache's news and the rank's figures, noted by the front-end before it
        # hands out the results (a request submitted on a result sees this step's prefix)
        events = engine.scheduler.bm.snapshots.take_events()
        if not leader:
            continue
        scheduler, bm = engine.scheduler, engine.scheduler.bm
        seen = (engine.num_prefill_tokens, bm.num_cached_blocks, len(scheduler.running),
                len(scheduler.waiting), bm.num_free_blocks, engine.spec_stats.num_drafts)
        news = None          # the figures are copied only in steps that changed them
        if (events and route_by_prefix) or seen != last_seen:
            news, last_seen = (events if route_by_prefix else [], EngineStats.of(engine)), seen
        if reports or news:
            send(('out', rank, (reports, news)))


def _admit(engine, kind: str, payload, request_of: dict, seq_of: dict) -> list:
    """One inbox event, on every TP rank alike; the reports it makes at once."""
    if kind == 'add':                # one prompt's choices (rids: one per choice)
        rids, token_ids, gen_config, request_ids = payload
        try:                 # the same on every TP rank: all of them refuse it alike
            seqs = engine.add_group(token_ids, gen_config, request_ids)
        except Exception as e:               # this request alone ends, with the reason
            return [(rid, StepOutput.refused(request_error(e))) for rid in rids]
        for rid, seq in zip(rids, seqs):
            request_of[seq.seq_id], seq_of[rid] = rid, seq
    elif kind == 'abort' and payload in seq_of:
        seq = seq_of[payload]
        if not seq.is_finished:
            engine.abort(seq)
            return [(payload, StepOutput(seq, []))]
    elif kind == 'stop':
        engine.stop_requested = True
    return []


def _drain(inbox, wait: float | None) -> list:
    """The inbox's events, a batch's (`('batch', events)`: one message) in its order."""
    items = []
    try:
        item = inbox.get(timeout=wait) if wait else inbox.get_nowait()
        while True:
            items += item[1] if item[0] == 'batch' else [item]
            item = inbox.get_nowait()
    except queue.Empty:
        pass
    return items
