"""How many KV blocks one rank gets (DESIGN.md invariant 6: the draft's KV is sized per rank).
  * the budget: the memory left after the target's weights (CUDA: free device memory; CPU, where
    the ranks share the machine: MemAvailable / world size), less the draft's own weights (loaded
    after this plan, at the draft's tp / ep) and the prefill graphs' activations (captured after
    it: `prefill_graph_bytes`), times `cache_max_entry_count`, less what each of the
    max_batch_size + 1 state slots holds: linear-attention rows (at the target's tp; recurrent
    part at `ssm_state_dtype`) and the speculative agent's tables (`spec_bytes_per_slot`);
  * one block: the target's full-attention layers at the target's TP share of the KV heads, plus
    the draft's KV layers at the draft's (`draft_tp`: a draft tp=1 holds all its heads per rank);
  * the cap: max_batch_size sequences of `max_positions`, plus the reserved block 0.
Prefix caching keeps state snapshots beside the blocks: SNAPSHOT_SHARE of the budget (after the
state slots), at most SNAPSHOTS_PER_SEQ x max_batch_size; the blocks get the rest, unless
num_gpu_blocks fixes them. All ranks then take the minimum (engine/build.py)."""
from __future__ import annotations

import torch

from lmdeploy_lite.messages import PytorchEngineConfig
from lmdeploy_lite.pytorch.config import CacheConfig, ModelConfig
from lmdeploy_lite.pytorch.engine.block_manager import blocks_needed
from lmdeploy_lite.pytorch.cache_engine import CacheEngine


SNAPSHOT_SHARE = 0.1
SNAPSHOTS_PER_SEQ = 4


def available_memory(device: torch.device, world_size: int = 1) -> int:
    """Bytes this rank may use now: the free device memory, or its share of MemAvailable."""
    if device.type == 'cuda':
        free, _ = torch.cuda.mem_get_info(device)
        return free
    with open('/proc/meminfo') as f:
        info = dict(line.split(':', 1) for line in f)
    return int(info['MemAvailable'].split()[0]) * 1024 // world_size


def prefill_graph_bytes(model_config: ModelConfig, num_tokens: int, dtype: torch.dtype,
                        tp: int = 1) -> int:
    """What the CUDA graphs of prefill steps of up to `num_tokens` tokens add to the reserved
    memory (graph_runner.PrefillGraphRunner; 0: none): three live rows of a layer's widest
    activations (its input projection, or the MLP's gate/up, at this rank's TP share, beside four
    hidden-size rows) per token, plus 64 MiB of allocator rounding. Measured on an H100 at 512
    tokens: 58 MiB for the 0.8B shape (this gives 100), 96 MiB for the 9B (184)."""
    if not num_tokens:
        return 0
    c = model_config
    mlp = (c.num_experts_per_tok * c.moe_intermediate_size + c.shared_expert_intermediate_size
           if c.num_experts else c.intermediate_size)
    widest = max(2 * mlp, c.linear_conv_dim + c.linear_num_value_heads * (
        c.linear_value_head_dim + 2), (2 * c.num_attention_heads + 2 * c.num_key_value_heads)
        * c.head_dim) // tp
    row_bytes = (widest + 4 * c.hidden_size) * torch.finfo(dtype).bits // 8
    return 3 * num_tokens * row_bytes + (64 << 20)


def plan_cache(model_config: ModelConfig, engine_config: PytorchEngineConfig, max_positions: int,
               num_spec_tokens: int, num_draft_layers: int, dtype: torch.dtype,
               available_bytes: int, tp: int = 1, draft_tp: int | None = None,
               draft_weight_bytes: int = 0, spec_bytes_per_slot: int = 0,
               graph_bytes: int = 0) -> CacheConfig:
    """(module docstring) `available_bytes`: this rank's memory after the target's weights;
    `draft_tp`: default the target's; `graph_bytes`: what the prefill graphs will take."""
    draft_tp = tp if draft_tp is None else draft_tp
    block_size = engine_config.block_size
    num_slots = engine_config.max_batch_size + 1                 # slot 0 is reserved
    per_seq = blocks_needed(max_positions, block_size)
    state_bytes = num_slots * (spec_bytes_per_slot + CacheEngine.bytes_per_state_slot(
        model_config, num_spec_tokens, dtype, tp=tp,
        ssm_state_dtype=engine_config.ssm_state_dtype))
    budget = ((available_bytes - draft_weight_bytes - graph_bytes)
              * engine_config.cache_max_entry_count - state_bytes)
    num_snapshots, snapshot_bytes = 0, 0
    if engine_config.enable_prefix_caching:
        per_snapshot = CacheEngine.bytes_per_state_slot(        # a slot without spec copies
            model_config, 0, dtype, tp=tp, ssm_state_dtype=engine_config.ssm_state_dtype)
        num_snapshots = SNAPSHOTS_PER_SEQ * engine_config.max_batch_size
        if per_snapshot:
            num_snapshots = min(num_snapshots, max(int(budget * SNAPSHOT_SHARE // per_snapshot), 0))
        snapshot_bytes = num_snapshots * per_snapshot
    if engine_config.num_gpu_blocks:
        num_blocks = engine_config.num_gpu_blocks
    else:
        budget -= snapshot_bytes
        per_block = CacheEngine.bytes_per_block(model_config, block_size, dtype, tp=tp)
        per_block += num_draft_layers * CacheEngine.bytes_per_block(
            model_config, block_size, dtype, layer_types=('full_attention',), tp=draft_tp)
        num_blocks = min(int(budget // per_block), engine_config.max_batch_size * per_seq + 1)
        total = budget + state_bytes
        if budget < per_seq * per_block and state_bytes >= total / 2:
            # the state rows, not one session's KV, leave no room: the fix is a smaller batch
            raise ValueError(
                f'max_batch_size={engine_config.max_batch_size}: the linear-attention state (and '
                f'the draft\'s distributions kept for sampling) of {num_slots} sequence slots '
                f'takes {state_bytes / 2**30:.1f} GiB of the {total / 2**30:.1f} GiB cache budget '
                f'and leaves too little for the KV cache; lower max_batch_size, use '
                f'ssm_state_dtype=\'bfloat16\' (half the recurrent state), fewer speculative '
                f'tokens (each keeps its own state copy) or raise cache_max_entry_count')
    if num_blocks - 1 < per_seq:
        session_len = engine_config.session_len or model_config.max_position_embeddings
        raise ValueError(
            f'KV cache: {num_blocks} blocks of {block_size} tokens cannot hold one sequence of '
            f'session_len={session_len} ({per_seq} blocks + 1 reserved); lower session_len or '
            f'raise num_gpu_blocks / cache_max_entry_count')
    return CacheConfig(block_size=block_size, num_blocks=num_blocks, num_state_slots=num_slots,
                       num_spec_tokens=num_spec_tokens, num_snapshots=num_snapshots)
