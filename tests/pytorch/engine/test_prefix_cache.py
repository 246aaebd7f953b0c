"""The prefix cache's own guarantees (engine/prefix_cache.py, block_manager.py): block keys that
every process computes alike, a restored state that IS the state a fresh prefill computes, and
blocks that are never lost, never counted twice and never taken from a running request.
Exactness of whole outputs against transformers: test_prefix_cache_exact.py."""
import random
import subprocess
import sys

import pytest
import torch

from lmdeploy_lite.messages import GenerationConfig, PytorchEngineConfig
from lmdeploy_lite.pytorch.engine.block_manager import BlockManager
from lmdeploy_lite.pytorch.cache_engine import CacheEngine
from lmdeploy_lite.pytorch.engine.build import build_engine
from lmdeploy_lite.pytorch.engine.prefix_cache import block_keys, longest_cached
from lmdeploy_lite.pytorch.engine.sequence import SeqStatus, Sequence


def test_block_keys_chain_and_are_the_same_in_another_process():
    tokens = list(range(100, 123))
    keys = block_keys(tokens, 4, lookahead=False)
    assert len(keys) == 5                                     # 23 tokens: 5 full blocks of 4
    assert block_keys(tokens[:9], 4, False) == keys[:2]       # a prefix names its blocks alike
    assert block_keys(tokens, 4, False, known=keys[:2]) == keys
    other = tokens[:2] + [7] + tokens[3:]                      # one token of block 0 differs
    assert all(a != b for a, b in zip(block_keys(other, 4, False), keys))   # chained
    # lookahead (a draft that keeps its KV in the blocks): the next token is named too
    ahead = block_keys(tokens, 4, lookahead=True)
    assert len(ahead) == 5 and ahead != keys
    assert len(block_keys(tokens[:8], 4, True)) == 1          # block 1 lacks its next token
    assert block_keys(tokens[:8] + [0], 4, True)[0] == ahead[0]
    assert block_keys(tokens[:8] + [0], 4, True)[1] != ahead[1]
    code = ('from lmdeploy_lite.pytorch.engine.prefix_cache import block_keys;'
            f'print(block_keys({tokens}, 4, True))')
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                         check=True, env={'PYTHONHASHSEED': '123', 'PATH': ''}, timeout=60)
    assert out.stdout.strip() == str(ahead)


def test_front_end_view_of_a_ranks_snapshots():
    tokens = list(range(40))
    keys = block_keys(tokens, 8, False)
    assert longest_cached(keys, {keys[1], keys[3]}, 40, 8) == 32
    assert longest_cached(keys, {keys[1], keys[4]}, 40, 8) == 16    # one token is left to run
    assert longest_cached(keys, set(), 40, 8) == 0


def _seq(seq_id: int, tokens: list[int]) -> Sequence:
    return Sequence(seq_id, list(tokens), len(tokens), GenerationConfig(), arrival=seq_id)


def test_a_cached_block_is_shared_and_evicted_only_when_unheld():
    bm = BlockManager(num_blocks=9, block_size=4, num_state_slots=4, num_snapshots=2)
    first = _seq(0, list(range(13)))
    bm.grow(first, 13)
    first.num_computed = 12
    row = bm.snapshots.take()
    bm.register(first, 12)
    bm.snapshots.name(bm.keys(first)[2], row)
    assert bm.num_cached_blocks == 3 and bm.match(_seq(1, list(range(14)))) == (3, 3)
    bm.free(first)
    bm.check()
    assert bm.num_free_blocks == 8 and len(bm.evictable) == 3
    second = _seq(1, list(range(14)))
    assert bm.acquire(second, 3) == row
    assert not bm.evictable and [bm.ref[b] for b in second.blocks] == [1, 1, 1]
    # the other 5 blocks can be handed out; the 3 held cached ones never
    other = _seq(2, [99] * 20)
    assert bm.can_hold(other, 20) and not bm.can_hold(other, 21)
    bm.grow(other, 20)
    assert not set(other.blocks) & set(second.blocks)
    bm.check()
    bm.free(other)
    bm.free(second)
    bm.check()
    # an allocation that needs them evicts the cached blocks, last block first, with the
    # snapshot at its end
    third = _seq(3, [5] * 28)
    bm.grow(third, 4 * 6)
    assert bm.num_cached_blocks == 2 and len(bm.snapshots) == 0
    bm.grow(third, 4 * 8)
    assert bm.num_cached_blocks == 0
    bm.check()


def _state(agent_caches: CacheEngine, slot: int, index: int = 0) -> list[torch.Tensor]:
    """The linear-attention state a next step reads from `slot`: recurrent slot `index` and the
    conv window at `index` (model_inputs.py), every linear-attention layer."""
    out = []
    for layer_type, (conv, rec) in zip(agent_caches.layer_types, agent_caches.caches):
        if layer_type == 'linear_attention':
            width = conv.shape[-1] - agent_caches.cache_config.num_spec_tokens
            out += [conv[slot, :, index:index + width].clone(), rec[slot, index].clone()]
    return out


@pytest.mark.parametrize('moe', [False, True])
def test_a_restored_state_is_the_state_of_a_fresh_prefill(moe, tiny_ckpt):
    """float64: the recurrent and conv state restored from a snapshot equal, exactly, the state a
    fresh prefill of the same prefix leaves (one chunk of exactly those tokens, no cache)."""
    path = tiny_ckpt(moe, layout='plain')
    base = dict(dtype='float64', device='cpu', block_size=4, session_len=96)
    rng = random.Random(moe)
    prefix = [rng.randrange(3, 200) for _ in range(22)]        # prompt end point: 20
    gen = GenerationConfig(max_new_tokens=2, ignore_eos=True)
    cached = build_engine(path, PytorchEngineConfig(**base), progress=False)
    cached.generate([prefix], gen)
    restored = []
    caches = cached.agent.caches
    original = caches.restore

    def recording(rows, slots):
        original(rows, slots)
        restored.append(_state(caches, int(slots[0])))
    caches.restore = recording
    seq = cached.add_request(prefix[:21] + [7, 8, 9], gen)
    cached.step()
    assert len(restored) == 1 and seq.num_cached_tokens == 20

    fresh = build_engine(path, PytorchEngineConfig(**base, max_prefill_token_num=20,
                                             enable_prefix_caching=False), progress=False)
    fresh_seq = fresh.add_request(prefix[:21] + [7, 8, 9], gen)
    fresh.step()                                                # exactly the first 20 tokens
    assert fresh_seq.num_computed == 20
    want = _state(fresh.agent.caches, fresh_seq.state_slot)
    assert len(want) == len(restored[0]) > 0
    for got, expected in zip(restored[0], want):
        assert torch.equal(got, expected)


def test_hundreds_of_mixed_requests_leak_nothing_and_steal_nothing(tiny_ckpt):
    """Shared prefixes, aborts and preemption (a tiny block budget) over 450 requests: after
    every step each block is free, held, or cached and unheld (BlockManager.check), the blocks
    of running sequences are held (never free, never evictable), two running sequences share
    only cached blocks, and at the end every block is free or cached with nobody holding it.
    The schedule is a function of the seeded mix alone (ignore_eos, no stop tokens): 450
    requests run ~575 steps with ~170 preemptions, ~70 aborts (of running and of waiting
    requests) and ~120 prefix-cache hits, every path the checks below watch."""
    torch.manual_seed(0)
    n_requests = 450
    cfg = PytorchEngineConfig(dtype='float32', device='cpu', block_size=4, session_len=48,
                              max_batch_size=12, num_gpu_blocks=24, max_prefill_token_num=24)
    engine = build_engine(tiny_ckpt(False, layout='plain'), cfg, progress=False)
    bm, sched = engine.scheduler.bm, engine.scheduler
    rng = random.Random(0)
    stems = [[rng.randrange(3, 500) for _ in range(rng.randrange(6, 24))] for _ in range(6)]
    hits, live, submitted = [0], [], 0
    while submitted < n_requests or engine.has_work:
        while submitted < n_requests and len(live) < 24:
            stem = stems[rng.randrange(len(stems))]
            prompt = stem[:rng.randrange(1, len(stem) + 1)] + [
                rng.randrange(3, 500) for _ in range(rng.randrange(0, 6))]
            gen = GenerationConfig(max_new_tokens=rng.randrange(1, 16), ignore_eos=True)
            live.append(engine.add_request(prompt, gen))
            submitted += 1
        if live and rng.random() < 0.1:
            engine.abort(live[rng.randrange(len(live))])
        engine.step()
        hits[0] += sum(s.num_cached_tokens > 0 for s in live if s.is_finished)
        live = [s for s in live if not s.is_finished]
        bm.check()
        held = [b for s in sched.running for b in s.blocks]
        assert all(bm.ref[b] > 0 and b not in bm.evictable for b in held)
        shared = {b for b in held if held.count(b) > 1}
        assert shared <= set(bm.key_of), 'two running sequences share an uncached block'
        for s in sched.running:
            assert s.status == SeqStatus.RUNNING
            assert sum(bm.ref[b] for b in s.blocks) >= len(s.blocks)
    assert sched.num_preemptions > 0 and hits[0] > 100
    bm.check()
    assert all(r == 0 for r in bm.ref)
    assert bm.num_free_blocks == bm.num_usable_blocks
    assert len(bm.free_blocks) + len(bm.evictable) == cfg.num_gpu_blocks - 1
    assert sorted(bm.evictable) == sorted(bm.key_of)
    assert len(bm.snapshots) + len(bm.snapshots.free) == bm.snapshots.size
