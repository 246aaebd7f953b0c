"""mp/ray ranks take their torch thread count from the front-end: LMDEPLOY_LITE_NUM_THREADS, else
the front-end's own thread count shared among the ranks (so two test suites on one machine, each
held to one thread by tests/conftest.py, start one-thread ranks and do not oversubscribe it)."""
import pytest
import torch

from lmdeploy_lite.pytorch.engine.executor.mp import rank_env, worker_num_threads
from lmdeploy_lite.pytorch.engine.executor.rank_worker import NUM_THREADS_ENV


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.mark.parametrize('front_end, world, expected', [(1, 2, 1), (4, 2, 2), (4, 3, 1), (3, 1, 3)])
def test_ranks_share_the_front_ends_threads(threads, front_end, world, expected):
    threads(front_end)
    assert worker_num_threads(world) == expected


def test_the_env_var_wins_and_is_validated(threads):
    threads(1)
    assert worker_num_threads(2, '3') == 3
    for bad in ('0', '-1', 'two', '1.5'):
        with pytest.raises(ValueError, match=f"{NUM_THREADS_ENV}='{bad}': must be a positive integer"):
            worker_num_threads(1, bad)


def test_the_front_end_passes_the_count_to_every_rank(threads, monkeypatch):
    """`rank_env`: what the mp and ray launchers add to every rank's environment."""
    threads(4)
    monkeypatch.delenv(NUM_THREADS_ENV, raising=False)
    assert rank_env(None, 2)[NUM_THREADS_ENV] == '2'                  # 4 threads / dp=2
    assert rank_env({NUM_THREADS_ENV: '1'}, 2)[NUM_THREADS_ENV] == '1'
    monkeypatch.setenv(NUM_THREADS_ENV, '3')
    assert rank_env(None, 2)[NUM_THREADS_ENV] == '3'
