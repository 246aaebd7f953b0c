"""The one seam between the engine and everything that drives it: `EngineClient`, whose
implementations differ only in where the ranks run: a thread (thread.py), one process per rank
(mp.py), one ray actor per rank (ray.py). Every rank runs `rank_loop` and sends one report per step;
`RankClient` does the rest: validation, request ids, DP routing, delivery, liveness, stats."""
from __future__ import annotations

import copy
import dataclasses
import logging
import os
import queue
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Callable, Protocol

from lmdeploy_lite.messages import GenerationConfig, PytorchEngineConfig, SpecDecodeStats
from lmdeploy_lite.pytorch.config import DistConfig, ModelConfig
from lmdeploy_lite.pytorch.engine.heartbeat import Heartbeats
from lmdeploy_lite.pytorch.engine.hidden_states import check_request_id
from lmdeploy_lite.pytorch.engine.prefix_cache import block_keys, longest_cached
from lmdeploy_lite.pytorch.engine.sequence import validate_request
from lmdeploy_lite.pytorch.engine.step_output import StepOutput

logger = logging.getLogger('lmdeploy_lite')

LIVENESS_CHECK_S = 0.5           # the front-end looks for dead ranks this often
STARTUP_TIMEOUT_S = float(os.environ.get('LMDEPLOY_LITE_STARTUP_TIMEOUT', '600'))
Item = StepOutput | BaseException      # a request's output, or the exception that ended it


@dataclass(eq=False)
class Channel:
    """A front-end's inbox: `post([(tag, item), ...])` once per step for its requests with news,
    in the engine's order (64 streams: one queue put, one wake-up; a callable sink gets one call
    per output). It must not block for long; raising aborts those requests."""
    post: Callable[[list[tuple[object, Item]]], None]


Sink = Callable[[Item], None] | Channel


@dataclass(eq=False)
class RequestHandle:
    """One submitted choice: its id on its DP rank, its sink, whether it has ended."""
    rid: int
    dp_rank: int
    sink: Sink
    tag: object = None
    finished: bool = False


@dataclass
class EngineStats:
    """Engine-wide figures, summed over DP ranks as their leaders last reported them."""
    num_prefill_tokens: int = 0      # fed in prefill rows (prompts, recomputes)
    num_cached_blocks: int = 0       # KV blocks held by the prefix cache
    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    spec: SpecDecodeStats = dataclasses.field(default_factory=SpecDecodeStats)

    @classmethod
    def of(cls, engine) -> 'EngineStats':
        """A rank's figures now (copies)."""
        scheduler, bm = engine.scheduler, engine.scheduler.bm
        return cls(engine.num_prefill_tokens, bm.num_cached_blocks, len(scheduler.running),
                   len(scheduler.waiting), bm.num_usable_blocks - bm.num_free_blocks,
                   bm.num_usable_blocks, copy.deepcopy(engine.spec_stats))

    @classmethod
    def total(cls, parts: list['EngineStats']) -> 'EngineStats':
        out = cls(**{f.name: sum(getattr(part, f.name) for part in parts)
                     for f in dataclasses.fields(cls) if f.name != 'spec'})
        for part in parts:
            out.spec.merge(part.spec)
        return out


class EngineClient(Protocol):
    """What every driver may use of an engine, wherever its ranks run."""
    session_len: int                 # the most tokens a sequence holds
    model_config: ModelConfig        # vocab_size, eos ids
    error: BaseException | None      # why the engine stopped for good, else None

    def validate_request(self, token_ids: list[int], gen_config: GenerationConfig): ...
    def submit_group(self, token_ids: list[int], gen_config: GenerationConfig, sink: Sink,
                     tags: list, request_ids: list[str | None] | None = None
                     ) -> list[RequestHandle]: ...
    def submit_groups(self, prompts: list[list[int]], gen_config: GenerationConfig, sink: Sink,
                      tags: list[list], request_ids: list[list[str | None]] | None = None
                      ) -> list[list[RequestHandle]]: ...
    def abort(self, handle: RequestHandle): ...
    def stats(self) -> EngineStats: ...
    def stalled(self, limit_s: float) -> str | None: ...
    def close(self, timeout_s: float = 30.0): ...


def checked_groups(client, prompts: list[list[int]], gen_config, tags: list[list],
                   request_ids: list[list[str | None]] | None
                   ) -> tuple[list[GenerationConfig], list[list[str]]]:
    """`submit_groups`' checks, all before anything is submitted: `client` neither stopped
    (RuntimeError) nor closing, one tag and request id per choice, each prompt and its config
    validated (`client.validate_request`), request ids checked (None: a random one). Returns
    each prompt's config and its choices' request ids."""
    if client.error is not None:
        raise RuntimeError(f'the engine stopped after an error: {client.error}')
    if client._closing:
        raise RuntimeError('the engine is closed')
    configs = gen_config if isinstance(gen_config, list) else [gen_config] * len(prompts)
    request_ids = [[None] * len(t) for t in tags] if request_ids is None else request_ids
    for token_ids, config, choice_tags, ids in zip(prompts, configs, tags, request_ids,
                                                   strict=True):
        n = getattr(config, 'n', 1)
        if len(choice_tags) != n or len(ids) != n:
            raise ValueError(f'n={n}: {len(choice_tags)} request tags and {len(ids)} request '
                             f'ids given, one of each per choice needed')
        client.validate_request(token_ids, config)
    return configs, [[uuid.uuid4().hex if r is None else check_request_id(r) for r in ids]
                     for ids in request_ids]


def hand_out(pairs: list[tuple[RequestHandle, Item]]) -> list[RequestHandle]:
    """Each item to its request's sink (one `post` per Channel); returns the handles whose sink
    raised (logged; the caller aborts them)."""
    failed, posts = [], {}                   # a Channel hashes by identity (eq=False)
    for handle, item in pairs:
        if isinstance(handle.sink, Channel):
            posts.setdefault(handle.sink, []).append((handle, item))
            continue
        try:
            handle.sink(item)
        except Exception:
            logger.exception('a request sink failed; aborting that request only')
            failed.append(handle)
    for channel, entries in posts.items():
        try:
            channel.post([(h.tag, item) for h, item in entries])
        except Exception:
            logger.exception('a front-end channel failed; aborting its requests of this step')
            failed += [h for h, _ in entries]
    return failed


class RankClient:
    """`EngineClient` over ranks that each run `rank_loop`. Subclasses define `_start` (sets
    `_inboxes`, one per rank, and `_outbox`), `_dead_ranks` (rank -> how it ended, in rank
    order), `_join(timeout_s)`, `_kill` and `_release`. Reports arrive through `_outbox` (read
    by a collector thread that also checks liveness) or straight through `_on_report`."""
    _heartbeats: Heartbeats | None = None      # the ranks' (_start sets it)
    _outbox = None

    def __init__(self, model_path: str, engine_config: PytorchEngineConfig,
                 speculative_config=None, env: dict | None = None,
                 worker_hook: Callable | None = None):
        cfg = engine_config
        self.dist_config = DistConfig(cfg.tp, cfg.dp, cfg.ep, cfg.sequence_parallel)
        self._configure(model_path, cfg, speculative_config)
        self.error: BaseException | None = None
        dp = self.dist_config.dp
        self._live: dict[int, RequestHandle] = {}
        self._busy_since = 0.0                   # when _live last became non-empty
        self._load = [0] * dp
        # prefix-cache routing (dp > 1): each DP rank's snapshot keys, and how keys are made
        self._snapshot_keys: list[set[int]] = [set() for _ in range(dp)]
        self._stats = [EngineStats() for _ in range(dp)]
        self._prefix_naming = (0, False, False)
        self._max_batch_size = cfg.max_batch_size
        self._next_rid = 0
        self._lock = threading.Lock()
        self._post_lock = threading.Lock()      # an event reaches a DP rank's TP ranks in turn
        self._closing = False
        self._worker_hook = worker_hook
        try:
            self._start(model_path, cfg, speculative_config, env)
            self._wait_ready()
        except BaseException:
            self._kill()
            self._release()
            raise
        self._collector = None
        if self._outbox is not None:
            self._collector = threading.Thread(target=self._collect, daemon=True,
                                               name='lmdeploy_lite-collector')
            self._collector.start()

    def _configure(self, model_path: str, cfg: PytorchEngineConfig, spec_config):
        """The model's config and session_len; layout and speculation checked."""
        self.model_config = ModelConfig.from_pretrained(model_path)
        self.dist_config.validate(self.model_config, num_devices=None)
        if spec_config is not None:
            from lmdeploy_lite.pytorch.spec_decode.runtime import check_speculative_config
            check_speculative_config(spec_config, model_path, self.dist_config, cfg.load_format)
        self.session_len = cfg.session_len or self.model_config.max_position_embeddings

    def _release(self):
        pass

    def _wait_ready(self):
        world = self.dist_config.world_size
        ready, deadline = set(), time.monotonic() + STARTUP_TIMEOUT_S
        while len(ready) < world:
            try:
                kind, rank, payload = self._outbox.get(timeout=0.5)
            except queue.Empty:
                self._check_alive()
                if time.monotonic() > deadline:
                    raise TimeoutError(f'ranks {sorted(set(range(world)) - ready)} '
                                       f'did not start within {STARTUP_TIMEOUT_S:.0f} s')
                continue
            if kind == 'error':
                summary, trace = payload
                logger.error('rank %d failed to start:\n%s', rank, trace)
                raise RuntimeError(f'failed to start: {summary}')
            ready.add(rank)
            self._prefix_naming = payload

    def _check_alive(self):
        for description in self._dead_ranks().values():
            raise RuntimeError(description)

    # ---- requests -------------------------------------------------------------------------
    def validate_request(self, token_ids: list[int], gen_config: GenerationConfig):
        """Raise ValueError naming the field when the engine would refuse this request."""
        validate_request(token_ids, gen_config, self.model_config.vocab_size, self.session_len)

    def submit(self, token_ids: list[int], gen_config: GenerationConfig, sink: Sink,
               tag: object = None, request_id: str | None = None) -> RequestHandle:
        """One request (gen_config.n == 1): `submit_group` of one choice."""
        return self.submit_group(token_ids, gen_config, sink, [tag], [request_id])[0]

    def submit_group(self, token_ids: list[int], gen_config: GenerationConfig, sink: Sink,
                     tags: list, request_ids: list[str | None] | None = None
                     ) -> list[RequestHandle]:
        """The gen_config.n choices of one prompt, to one DP rank (they share its prefill):
        choice i tagged `tags[i]`, its hidden-states file `request_ids[i]` (None: random). A bad
        request raises ValueError and touches nothing; RuntimeError once stopped or closing."""
        return self.submit_groups([token_ids], gen_config, sink, [tags],
                                  None if request_ids is None else [request_ids])[0]

    def submit_groups(self, prompts: list[list[int]], gen_config: GenerationConfig, sink: Sink,
                      tags: list[list], request_ids: list[list[str | None]] | None = None
                      ) -> list[list[RequestHandle]]:
        """`submit_group` for each prompt (`tags[p]`, `request_ids[p]` its choices'; `gen_config`
        one for all, or a list: prompt p's is `gen_config[p]`), all validated before any is
        submitted, and each rank told in one inbox message: a batch that arrives together is
        admitted by one step."""
        configs, request_ids = checked_groups(self, prompts, gen_config, tags, request_ids)
        groups, events = [], {}
        for token_ids, config, choice_tags, ids in zip(prompts, configs, tags, request_ids):
            n = len(choice_tags)
            cached = self._cached_tokens(token_ids)
            with self._lock:
                # the rank that holds the longest cached prefix, unless it is a whole batch
                # busier than the least loaded; ties: the least loaded
                least = min(self._load)
                dp_rank = min(range(len(self._load)), key=lambda r: (
                    -cached[r] if self._load[r] - least < self._max_batch_size else 0,
                    self._load[r]))
                self._load[dp_rank] += n
                rids = list(range(self._next_rid, self._next_rid + n))
                self._next_rid += n
                handles = [RequestHandle(rid, dp_rank, sink, tag)
                           for rid, tag in zip(rids, choice_tags)]
                if not self._live:
                    self._busy_since = time.monotonic()
                self._live.update(zip(rids, handles))
            groups.append(handles)
            events.setdefault(dp_rank, []).append(('add', (rids, list(token_ids), config, ids)))
        for dp_rank, items in events.items():
            self._post(dp_rank, items[0] if len(items) == 1 else ('batch', items))
        return groups

    def abort(self, handle: RequestHandle):
        self._post(handle.dp_rank, ('abort', handle.rid))

    def _post(self, dp_rank: int | None, event: tuple):
        """`event` to every TP rank of DP rank `dp_rank` (None: every rank), in one order on all
        of them (rank_worker.rank_loop admits what each peer has)."""
        tp = self.dist_config.tp
        inboxes = self._inboxes if dp_rank is None else self._inboxes[dp_rank * tp:][:tp]
        with self._post_lock:
            for inbox in inboxes:
                inbox.put(event)

    def stalled(self, limit_s: float) -> str | None:
        """One line naming a rank stalled for over `limit_s` with requests pending, else None."""
        if not self._live or self._heartbeats is None:
            return None
        return self._heartbeats.stalled(limit_s, since=self._busy_since,
                                        describe=self._describe_rank)

    def _describe_rank(self, rank: int) -> str:
        return f'rank {rank}'

    def stats(self) -> EngineStats:
        return EngineStats.total(self._stats)

    def _cached_tokens(self, token_ids: list[int]) -> list[int]:
        """Per DP rank, the prompt tokens its prefix cache holds, as its reports say."""
        block_size, lookahead, caching = self._prefix_naming
        dp = self.dist_config.dp
        if dp == 1 or not caching:
            return [0] * dp
        keys = block_keys(list(token_ids), block_size, lookahead)
        with self._lock:
            return [longest_cached(keys, held, len(token_ids), block_size)
                    for held in self._snapshot_keys]

    # ---- results --------------------------------------------------------------------------
    def _collect(self):
        """Hand the reports on; check every LIVENESS_CHECK_S, busy or not, that all ranks live."""
        next_check = time.monotonic() + LIVENESS_CHECK_S
        while True:
            try:
                report = self._outbox.get(timeout=max(0.01, next_check - time.monotonic()))
            except queue.Empty:
                if self._closing:
                    return
                report = None
            if report is not None and not self._on_report(*report):
                return
            if time.monotonic() >= next_check and not self._closing:
                next_check = time.monotonic() + LIVENESS_CHECK_S
                try:
                    self._check_alive()
                except RuntimeError as e:
                    self._fail(e)
                    return

    def _on_report(self, kind: str, rank: int, payload) -> bool:
        """('out', rank, (outputs, news)) or ('error', rank, (summary, trace)); False: failed."""
        if kind == 'error':
            self._fail(RuntimeError(self._describe_failure(rank, *payload)))
            return False
        reports, news = payload
        if news is not None:                # (snapshot (key, kept) events, EngineStats)
            events, stats = news
            dp_rank = rank // self.dist_config.tp
            self._stats[dp_rank] = stats
            held = self._snapshot_keys[dp_rank]
            with self._lock:
                for key, kept in events:
                    (held.add if kept else held.discard)(key)
        if reports:
            self._deliver(reports)
        return True

    def _deliver(self, reports: list[tuple[int, StepOutput]]):
        """One step's (request id, StepOutput) of one rank to their sinks."""
        pairs = []
        with self._lock:
            for rid, out in reports:
                handle = self._live.get(rid)
                if handle is None:
                    continue
                if out.finished:
                    del self._live[rid]
                    self._load[handle.dp_rank] -= 1
                    handle.finished = True
                pairs.append((handle, out))
        for handle in hand_out(pairs):
            if not handle.finished:
                self.abort(handle)

    def _describe_failure(self, rank: int, summary: str, trace: str) -> str:
        """A rank's collective fails when a peer dies: then the dead peer is the news, not the
        survivor's error (logged with its traceback). A rank that reported an error of its own
        and then ended (its report is in the outbox before its exit is seen) is no such peer."""
        logger.error('rank %d failed:\n%s', rank, trace)
        reported = {rank}
        deadline = time.monotonic() + 1.0
        while True:
            dead = self._dead_ranks()              # before the drain: their reports are in it
            while True:
                try:
                    kind, other, payload = self._outbox.get(timeout=0)
                except queue.Empty:
                    break
                if kind == 'error' and other not in reported:
                    reported.add(other)
                    logger.error('rank %d failed:\n%s', other, payload[1])
            unexplained = [d for r, d in dead.items() if r not in reported]
            if unexplained:
                return '; '.join(unexplained)
            if time.monotonic() > deadline:
                return summary
            time.sleep(0.05)

    def _fail(self, error: BaseException):
        logger.error('engine stopped: %s', error)
        self.error = error
        self._end_live(error)
        self._kill()

    def _end_live(self, error: BaseException):
        with self._lock:
            handles, self._live = list(self._live.values()), {}
        hand_out([(handle, error) for handle in handles])

    # ---- lifetime -------------------------------------------------------------------------
    def close(self, timeout_s: float = 30.0):
        """Ends the ranks; running requests get RuntimeError. Idempotent."""
        self._closing = True
        self._post(None, ('stop', None))
        self._join(timeout_s)
        if self._collector is not None and threading.current_thread() is not self._collector:
            self._collector.join(5)         # a failing collector may be in _kill: one at a time
        self._kill()
        self._end_live(RuntimeError('the engine was closed'))
        self._release()


