"""The `ray` executor: one Ray actor per rank running `worker_main` (ranks advance and fail as mp.py
says) over `ray.util.queue.Queue`s with the mp queue's interface. A placement group of {'GPU': 1}
(CUDA) or {'CPU': 1} bundles, STRICT_SPREAD when the cluster has one node per rank, else SPREAD;
rank r takes bundle r; torch.distributed meets at rank 0's node. The cluster is `ray.init()`'s
(RAY_ADDRESS) unless connected. Unplaceable within RAY_PG_TIMEOUT_S: an error naming what is
missing. Every call into ray is bounded (RAY_CALL_TIMEOUT_S). No lifeline: ray kills a
(non-detached) actor, queues too, when its owner, this driver, ends, SIGKILL included."""
from __future__ import annotations

import asyncio
import os
import queue
import time

from lmdeploy_lite.messages import PytorchEngineConfig, SpeculativeConfig
from lmdeploy_lite.pytorch.engine.executor.client import RankClient
from lmdeploy_lite.pytorch.engine.executor.mp import free_port, rank_env
from lmdeploy_lite.pytorch.engine.executor.rank_worker import worker_main

RAY_PG_TIMEOUT_S = float(os.environ.get('LMDEPLOY_LITE_RAY_PG_TIMEOUT', '30'))
PLACE_ACTORS_TIMEOUT_S = 120
RAY_CALL_TIMEOUT_S = 60          # one small actor call (a queue put, a port lookup)


class _RankQueue:
    """A ray Queue whose every call is bounded in time; a rank's view: errors propagate."""

    def __init__(self, q):
        self.q = q

    def put(self, item):                   # the queues are unbounded: put never waits for room
        import ray
        ray.get(self.q.actor.put.remote(item, None), timeout=RAY_CALL_TIMEOUT_S)

    def get(self, timeout: float):
        import ray
        return ray.get(self.q.actor.get.remote(timeout), timeout=timeout + RAY_CALL_TIMEOUT_S)

    def get_nowait(self):
        import ray
        try:
            return ray.get(self.q.actor.get_nowait.remote(), timeout=RAY_CALL_TIMEOUT_S)
        except asyncio.QueueEmpty:         # (the actor's error, re-raised as an instance of it)
            raise queue.Empty from None


class _FrontEndQueue(_RankQueue):
    """The front-end's view: once the queue's actor is gone, puts are dropped and gets report
    Empty, as an mp queue with no reader would."""

    def put(self, item):
        import ray
        try:
            super().put(item)
        except ray.exceptions.RayError:
            pass

    def get(self, timeout: float):
        import ray
        try:
            return super().get(timeout)
        except queue.Empty:                # (ray raises the actor's Empty as a RayError too)
            raise queue.Empty from None
        except ray.exceptions.RayError:
            time.sleep(timeout)
            raise queue.Empty from None


class RankActor:
    """Wrapped by ray.remote at start-up (so importing this module does not need ray)."""

    def node(self) -> tuple[str, str]:
        import ray
        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()

    def free_port(self) -> int:
        return free_port()

    def run(self, *args):
        worker_main(*args)


class RayEngineLoop(RankClient):
    """One Ray actor per rank; `node_ids[r]` is the node rank r runs on."""
    _actors: list = []
    _runs: list = []
    _queues: list = []
    _pg = None

    def _start(self, model_path: str, cfg: PytorchEngineConfig,
               spec_config: SpeculativeConfig | None, env: dict):
        import ray
        from ray.util.queue import Queue
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        if not ray.is_initialized():
            ray.init(address=os.environ.get('RAY_ADDRESS'), log_to_driver=False)
        world = self.dist_config.world_size
        use_gpu = cfg.device == 'cuda' or (cfg.device == 'auto'
                                           and ray.cluster_resources().get('GPU', 0) > 0)
        bundle = {'GPU': 1} if use_gpu else {'CPU': 1}
        nodes = [n for n in ray.nodes() if n['Alive']]
        strategy = 'STRICT_SPREAD' if len(nodes) == world else 'SPREAD'
        self._pg = ray.util.placement_group([dict(bundle) for _ in range(world)], strategy)
        try:
            ray.get(self._pg.ready(), timeout=RAY_PG_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(
                f'the ray cluster cannot place {world} ranks ({world} x {bundle}, {strategy}) '
                f'within {RAY_PG_TIMEOUT_S:.0f} s: it has {_describe(nodes)}; add nodes or '
                f'{next(iter(bundle))}s, or use fewer ranks (tp * dp = {world})') from None
        # the queues' actors sit outside the placement group
        self._queues = [Queue(actor_options={'num_cpus': 0}) for _ in range(world + 1)]
        self._inboxes = [_FrontEndQueue(q) for q in self._queues[:world]]
        self._outbox = _FrontEndQueue(self._queues[world])
        actor_cls = ray.remote(RankActor)
        self._actors = [actor_cls.options(
            num_cpus=bundle.get('CPU', 0), num_gpus=bundle.get('GPU', 0), name=None, max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self._pg, placement_group_bundle_index=r)).remote()
            for r in range(world)]
        where = ray.get([a.node.remote() for a in self._actors], timeout=PLACE_ACTORS_TIMEOUT_S)
        self.node_ids = [node_id for node_id, _ in where]
        port = ray.get(self._actors[0].free_port.remote(), timeout=RAY_CALL_TIMEOUT_S)
        init_method = f'tcp://{where[0][1]}:{port}'
        # local rank 0: ray shows each GPU actor only its own GPU (CUDA_VISIBLE_DEVICES)
        self._runs = [a.run.remote(r, self.dist_config, model_path, cfg, spec_config,
                                   init_method, _RankQueue(self._queues[r]),
                                   _RankQueue(self._queues[world]), rank_env(env, world), 0,
                                   None, self._worker_hook)
                      for r, a in enumerate(self._actors)]

    def _dead_ranks(self) -> dict[int, str]:
        import ray
        done, _ = ray.wait(self._runs, num_returns=len(self._runs), timeout=0)
        dead = {}
        for r in [r for r, ref in enumerate(self._runs) if ref in done]:
            dead[r] = f'rank {r} (ray actor on node {self.node_ids[r]}) '
            try:
                ray.get(self._runs[r], timeout=RAY_CALL_TIMEOUT_S)      # done: returns at once
                dead[r] += 'exited'
            except Exception as e:
                dead[r] += f'died: {type(e).__name__}: {str(e).splitlines()[0]}'
        return dead

    def _join(self, timeout_s: float):
        import ray
        ray.wait(self._runs, num_returns=len(self._runs), timeout=timeout_s)

    def _kill(self):
        if not self._actors and self._pg is None:
            return
        import ray
        for actor in self._actors + [q.actor for q in self._queues]:
            ray.kill(actor, no_restart=True)
        if self._pg is not None:
            ray.util.remove_placement_group(self._pg)
        self._actors, self._queues, self._runs, self._pg = [], [], [], None


def _describe(nodes: list[dict]) -> str:
    alive = ', '.join(f"{n['NodeManagerAddress']}: "
                      f"{ {k: v for k, v in n['Resources'].items() if k in ('CPU', 'GPU')} }"
                      for n in nodes)
    return f'{len(nodes)} node(s) [{alive}]'
