"""Per-rank KV block counts, against numbers computed by hand for the tiny test model.

Tiny model (tests/helpers/tiny_models): 1 full-attention layer with 2 KV heads x 16, 3
linear-attention layers with conv_dim 2*2*16 + 4*16 = 128, kernel 4, 4 value heads of 16 x 16.
float32 (4 bytes), block_size 4, k = 3 drafts, the MTP head adds one full-attention layer.
  target KV per block = 2 (k, v) * 1 layer * 4 tokens * (2 / tp) heads * 16 * 4 B = 1024 / tp
  draft  KV per block = the same again (its one layer) at the draft's tp         = 1024 / draft_tp
  state per sequence  = 3 layers * (128/tp * (4 - 1 + 3) * 4 B + (1 + 3) * 4/tp * 16*16 * 4 B)
                      = 3 * (3072 + 16384) / tp = 58368 / tp
  prefix-cache snapshot = 3 layers * (128/tp * (4 - 1) * 4 B + 4/tp * 16*16 * 4 B)
                      = 3 * (1536 + 4096) / tp = 16896 / tp; SNAPSHOT_SHARE (10%) of the budget
                        after the state rows, at most 4 x max_batch_size of them
"""
import pytest
import torch

from lmdeploy_lite.messages import PytorchEngineConfig, SpeculativeConfig
from lmdeploy_lite.pytorch.config import DistConfig, ModelConfig
from lmdeploy_lite.pytorch.engine.cache_plan import plan_cache, prefill_graph_bytes
from lmdeploy_lite.pytorch.spec_decode.build import spec_plan

MB = 1 << 20


@pytest.mark.parametrize('tp', [1, 2, 4])
@pytest.mark.parametrize('dp', [1, 2])
@pytest.mark.parametrize('with_draft, draft_tp', [(False, None), (True, 'target'), (True, 1)])
@pytest.mark.parametrize('prefix_caching', [False, True])
def test_blocks_per_rank_by_hand(tp, dp, with_draft, draft_tp, prefix_caching, tiny_ckpt):
    model = ModelConfig.from_pretrained(tiny_ckpt(True, layout='plain', linear_num_key_heads=4,
                                                  num_key_value_heads=4))
    cfg = PytorchEngineConfig(block_size=4, max_batch_size=128, cache_max_entry_count=0.5,
                              session_len=100000, enable_prefix_caching=prefix_caching)
    machine = 1024 * MB
    per_rank = machine // dp                           # CPU: the ranks share the machine
    kv_heads, key_heads, value_heads = 4, 4, 4
    target_block = 2 * 1 * 4 * (kv_heads // tp) * 16 * 4
    draft_tp = tp if draft_tp == 'target' else draft_tp
    draft_block = 2 * 1 * 4 * (kv_heads // draft_tp) * 16 * 4 if with_draft else 0
    conv_dim = (2 * key_heads * 16 + value_heads * 16) // tp
    state = 3 * (conv_dim * (4 - 1 + 3) * 4 + (1 + 3) * (value_heads // tp) * 16 * 16 * 4)
    budget = per_rank * 0.5 - 129 * state
    snapshot = 3 * (conv_dim * (4 - 1) * 4 + (value_heads // tp) * 16 * 16 * 4)
    snapshots = min(4 * 128, int(budget * 0.1 // snapshot)) if prefix_caching else 0
    expected = int((budget - snapshots * snapshot) // (target_block + draft_block))
    plan = plan_cache(model, cfg, max_positions=100000 + 3 + 2, num_spec_tokens=3,
                      num_draft_layers=int(with_draft), dtype=torch.float32,
                      available_bytes=per_rank, tp=tp, draft_tp=draft_tp)
    assert plan.num_blocks == expected
    assert plan.num_snapshots == snapshots
    assert plan.num_state_slots == 129 and plan.num_spec_tokens == 3


@pytest.mark.parametrize('tp', [1, 2])
def test_prefill_graphs_are_charged_before_the_blocks(tp, tiny_ckpt):
    """The prefill graphs' activations come off the memory before the cache's share of it (a
    dense model: the MLP's width is intermediate_size)."""
    model = ModelConfig.from_pretrained(tiny_ckpt(False, layout='plain'))
    assert not model.num_experts
    c = model
    widest = max(2 * c.intermediate_size, c.linear_conv_dim + c.linear_num_value_heads * (
        c.linear_value_head_dim + 2), (2 * c.num_attention_heads + 2 * c.num_key_value_heads)
        * c.head_dim) // tp
    graphs = prefill_graph_bytes(model, 256, torch.bfloat16, tp)
    assert graphs == 3 * 256 * (widest + 4 * c.hidden_size) * 2 + 64 * MB
    assert prefill_graph_bytes(model, 0, torch.bfloat16, tp) == 0
    cfg = PytorchEngineConfig(block_size=4, max_batch_size=8, session_len=64)
    charged = plan_cache(model, cfg, 69, 3, 1, torch.float32, 512 * MB, tp=tp, graph_bytes=graphs)
    assert charged == plan_cache(model, cfg, 69, 3, 1, torch.float32, 512 * MB - graphs, tp=tp)


def test_blocks_are_capped_by_what_max_batch_size_sessions_need(tiny_ckpt):
    model = ModelConfig.from_pretrained(tiny_ckpt(False, layout='plain'))
    cfg = PytorchEngineConfig(block_size=4, max_batch_size=8, session_len=64)
    plan = plan_cache(model, cfg, 64 + 3 + 2, 3, 1, torch.float32, 1 << 34)
    assert plan.num_blocks == 8 * 18 + 1                   # ceil(69 / 4) = 18 per sequence


def test_too_little_memory_names_the_fix(tiny_ckpt):
    model = ModelConfig.from_pretrained(tiny_ckpt(False, layout='plain'))
    cfg = PytorchEngineConfig(block_size=4, max_batch_size=8, session_len=4096)
    with pytest.raises(ValueError, match='session_len=4096'):
        plan_cache(model, cfg, 4096, 0, 0, torch.float32, 1 << 20)


def test_state_rows_that_crowd_out_the_kv_name_max_batch_size(tiny_ckpt):
    """A batch whose linear-attention state alone fills the budget is a max_batch_size problem
    (9B, batch 256, k=3 on one H100: 51 GB of state), not a session_len one."""
    from lmdeploy_lite.pytorch.cache_engine import CacheEngine
    model = ModelConfig.from_pretrained(tiny_ckpt(False, layout='plain'))
    cfg = PytorchEngineConfig(block_size=4, max_batch_size=256, session_len=64)
    slot = CacheEngine.bytes_per_state_slot(model, 3, torch.float32)
    with pytest.raises(ValueError, match=r'max_batch_size=256: .*lower max_batch_size'):
        plan_cache(model, cfg, 69, 3, 1, torch.float32, int(slot * 257 / 0.8 * 0.99))


def test_sampled_drafts_distribution_is_charged_per_state_slot(tiny_ckpt):
    """The MTP draft keeps q [k, vocab] per state slot for sampled requests (SpecAgent
    .draft_probs, allocated at start-up): k x vocab x 4 bytes in float32, taken from the budget
    for each of the max_batch_size + 1 slots before blocks are counted; a host proposer (ngram)
    keeps none."""
    model = ModelConfig.from_pretrained(tiny_ckpt(False, layout='plain'))
    mtp = spec_plan(SpeculativeConfig(num_speculative_tokens=3), model, torch.float32,
                    DistConfig())
    assert mtp.draft_probs_bytes_per_slot == 3 * model.vocab_size * 4
    ngram = spec_plan(SpeculativeConfig(method='ngram', num_speculative_tokens=3), model,
                      torch.float32, DistConfig())
    assert ngram.draft_probs_bytes_per_slot == 0
    cfg = PytorchEngineConfig(block_size=4, max_batch_size=128, cache_max_entry_count=0.5,
                              session_len=100000, enable_prefix_caching=False)   # (no snapshots)
    plan = plan_cache(model, cfg, 100000 + 3 + 2, 3, 1, torch.float32, 512 * MB,
                      spec_bytes_per_slot=mtp.draft_probs_bytes_per_slot)
    per_block = 1024 + 1024                     # target + draft KV, tp = 1 (module docstring)
    per_slot = 58368 + 3 * model.vocab_size * 4
    assert plan.num_blocks == int((512 * MB * 0.5 - 129 * per_slot) // per_block)


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16, torch.float64])
def test_cpu_caches_are_zeros_of_their_own(dtype):
    """fresh_zeros on the CPU (fresh pages, not a memset): zeros of the dtype and shape, writable,
    two calls never share memory, and the pages outlive the call that mapped them."""
    from lmdeploy_lite.pytorch.cache_engine import fresh_zeros
    a, b = fresh_zeros((3, 64, 2, 8), dtype, 'cpu'), fresh_zeros((3, 64, 2, 8), dtype, 'cpu')
    assert a.dtype == dtype and a.shape == (3, 64, 2, 8) and a.is_contiguous()
    assert torch.equal(a, torch.zeros_like(a))
    a[1].fill_(2.0)
    assert a.sum().item() == 2.0 * 64 * 2 * 8 and b.abs().sum().item() == 0
    assert fresh_zeros((0, 4), dtype, 'cpu').shape == (0, 4)
