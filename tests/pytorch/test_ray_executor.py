"""The ray executor on a two-node local cluster (ray.cluster_utils.Cluster, all on 127.0.0.1).

One CPU per node, so a two-rank placement group puts one rank on each node. The speculative test
runs the embedded model, whose MTP drafts are mostly accepted (tests/helpers/accepting), and
asserts that acceptance before comparing with the single process. Each test has a hard pytest
timeout and asserts it finished in time; the collective timeout is short.
"""
import os
import time

import pytest

os.environ['RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER'] = '0'     # before ray is imported: 127.0.0.1 only
ray = pytest.importorskip('ray', reason="the ray executor tests need ray: pip install 'lmdeploy_lite[ray]'")

from lmdeploy_lite import GenerationConfig, PytorchEngineConfig, pipeline  # noqa: E402
from tests.helpers import accepting  # noqa: E402
from tests.helpers.accepting import assert_matches_reference  # noqa: E402

BASE = dict(dtype='float64', device='cpu', block_size=4, session_len=128,
            distributed_executor_backend='ray')
GEN = GenerationConfig(max_new_tokens=24, ignore_eos=True)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope='module')
def cluster():
    from ray.cluster_utils import Cluster
    node = dict(num_cpus=1, object_store_memory=80 * 1024 * 1024)
    cluster = Cluster(initialize_head=True, head_node_args=node)
    cluster.add_node(**node)
    assert cluster.address.startswith('127.0.0.1:')
    ray.init(address=cluster.address, log_to_driver=False,
             runtime_env={'env_vars': {'PYTHONPATH': REPO}})
    yield cluster
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture(autouse=True)
def strict_collectives(monkeypatch):
    monkeypatch.setenv('LMDEPLOY_LITE_CHECK_COLLECTIVES', '1')
    monkeypatch.setenv('LMDEPLOY_LITE_DIST_TIMEOUT', '20')


def leftovers() -> tuple[list, list]:
    from ray._private.state import state
    actors = [a for a in state.actor_table(None).values() if a['State'] != 'DEAD']
    groups = [g for g in ray.util.placement_group_table().values() if g['state'] != 'REMOVED']
    return actors, groups


def wait_no_leftovers(timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while leftovers() != ([], []) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert leftovers() == ([], [])


@pytest.mark.timeout(300)
def test_dp2_ep2_one_rank_per_node_gives_single_process_tokens_then_a_killed_rank_is_named(
        cluster):
    """dp=2 ep=2, MTP k=3 on the embedded model: a batch over both ranks, then one request (the
    other rank idles through the whole run, running dummy forwards), then the batch streamed to
    a consumer that lags behind the front-end's collector thread. Then rank 1's actor is killed:
    the next requests fail naming it (and its node), and nothing is left. (One pipeline for
    both: a second one would start two more actors and their queues, ~7 s on two CPUs.)"""
    k, one = 3, accepting.prompts()[1:2]
    start = time.monotonic()
    config = PytorchEngineConfig(dp=2, ep=2, distributed_executor_backend='ray', **accepting.BASE)
    with pipeline(accepting.model_dir(), config, accepting.spec(k), progress=False) as pipe:
        loop = pipe._client
        assert len(set(loop.node_ids)) == 2                       # one rank per node
        assert set(loop.node_ids) == {n['NodeID'] for n in ray.nodes() if n['Alive']}
        actors, groups = leftovers()
        assert len(actors) == 2 + 3 and len(groups) == 1      # ranks, queues (2 in + 1 out)
        batch = pipe([list(p) for p in accepting.prompts()], accepting.GREEDY)
        alone = pipe([list(p) for p in one], accepting.GREEDY)
        streamed, finals = accepting.stream_lagging(pipe, accepting.prompts(), k)
        ray.kill(loop._actors[1])
        killed = time.monotonic()
        with pytest.raises(RuntimeError, match=r'rank 1 \(ray actor on node \w+\) died'):
            for _ in range(50):
                pipe(list(one[0]), GEN)
                time.sleep(0.2)
        assert loop.error is not None
        assert time.monotonic() - killed < 30
    assert_matches_reference(batch, k)
    assert_matches_reference(alone, k, one)
    assert streamed == [r.token_ids for r in batch]
    assert [accepting.counts(c.spec_stats) for c in finals] == accepting.reference(k).counts
    wait_no_leftovers()
    assert time.monotonic() - start < 240


@pytest.mark.timeout(120)
def test_too_few_resources_fail_within_a_minute_naming_them(cluster, tiny_ckpt, monkeypatch):
    import lmdeploy_lite.pytorch.engine.executor.ray as ray_executor
    # 4 one-CPU bundles on two one-CPU nodes can never be placed: any wait ends the same way
    monkeypatch.setattr(ray_executor, 'RAY_PG_TIMEOUT_S', 1.0)
    path = tiny_ckpt(False, layout='plain')
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"cannot place 4 ranks .*'CPU': 1.*2 node\(s\)"):
        pipeline(path, PytorchEngineConfig(dp=4, **BASE), progress=False)
    assert time.monotonic() - start < 60
    wait_no_leftovers()
