"""Qwen3.5 MTP draft head (qwen3_5.md section 3): architecture only.

    e = pre_fc_norm_embedding(embed_tokens(x_{t+1}))      # shared with the target
    h = pre_fc_norm_hidden(h_t)                           # target's post-final-norm hidden
    u = fc(cat([e, h], -1))                               # [H, 2H], embedding first
    u = layers[0](u, position t)                          # full attention; MLP/MoE as target
    h'_t = norm(u)                                        # lm_head(h'_t) predicts x_{t+2}
The layer has its own paged KV cache (`CacheEngine(..., layer_types=('full_attention',))`, same
block table and block size as the target). Parameter names equal the checkpoint's minus `mtp.`.
Sizes per rank come from this head's `dist_ctx`, the draft's own tp / ep (SpeculativeConfig;
`DistContext.draft_context`): the decoder layer and its KV cache are sharded over them; fc and
the norms are replicated; the shared embedding and LM head keep the target's TP.
Sequence-parallel (a draft tp > 1 with the target's flag): the inputs are cut to this rank's
share of the plan's padded rows before the norms and fc, and the output is gathered whole.
"""
from __future__ import annotations

import torch
from torch import nn

from ..backends import get_backend
from ..config import ModelConfig
from ..model_inputs import ModelInputs
from ..nn.linear import ReplicatedLinear
from ..nn.norm import RMSNorm
from ..nn.rotary import RotaryEmbedding
from ..nn.sequence_parallel import is_sequence_parallel, shard, splits_rows
from .qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5ForCausalLM


class Qwen3_5MTP(nn.Module):

    def __init__(self, model_config: ModelConfig, dtype: torch.dtype, device: torch.device | str,
                 embed_tokens: nn.Module, lm_head: nn.Module, dist_ctx=None):
        super().__init__()
        hidden, eps = model_config.hidden_size, model_config.rms_norm_eps
        if model_config.mtp_num_hidden_layers > 1:     # draft step i would run layer i % n
            raise ValueError(
                f'config.json: mtp_num_hidden_layers={model_config.mtp_num_hidden_layers} is '
                'not supported: the MTP draft runs one layer (every released Qwen3.5 checkpoint '
                'has 1); use another speculative method, or none')
        self.config, self.dtype = model_config, dtype
        backend = get_backend(device)
        self.pre_fc_norm_embedding = RMSNorm(hidden, eps, dtype, device)
        self.pre_fc_norm_hidden = RMSNorm(hidden, eps, dtype, device)
        self.fc = ReplicatedLinear(2 * hidden, hidden, dtype, device)
        self.layers = nn.ModuleList([
            Qwen3_5DecoderLayer(model_config, 'full_attention', backend, dtype, device, dist_ctx)])
        self.norm = RMSNorm(hidden, eps, dtype, device)
        self.rotary_emb = RotaryEmbedding(model_config.rotary_dim, model_config.rope_theta, device)
        self.dist_ctx, self.sequence_parallel = dist_ctx, is_sequence_parallel(dist_ctx)
        # shared with the target, deliberately not registered (not this module's weights)
        self.__dict__.update(embed_tokens=embed_tokens, lm_head=lm_head)

    def forward(self, input_ids: torch.Tensor, target_hidden: torch.Tensor, inputs: ModelInputs,
                caches) -> torch.Tensor:
        """input_ids [T]: the token after each position; target_hidden [T, H]: the target's
        post-norm hidden (or this head's previous output when drafting recursively);
        `caches[0]`: layer 0's (k, v) cache. Returns the post-`norm` hidden [T, H]."""
        split = self.sequence_parallel and splits_rows(inputs)
        num_rows = inputs.sizes.tokens if split else None
        hidden = self._layer_input(input_ids, target_hidden, num_rows)
        rope = self.rotary_emb(inputs.positions, hidden.dtype)
        hidden, residual = self.layers[0](hidden, None, rope, caches[0], inputs)
        out = self.norm(hidden, residual)[0]
        if split:                       # whole rows for the LM head and the next draft step
            out = self.dist_ctx.tp.gather_rows(out)[:inputs.num_tokens]
        return out

    def _layer_input(self, input_ids: torch.Tensor, target_hidden: torch.Tensor,
                     num_rows: int | None = None) -> torch.Tensor:
        """fc's output [T, H] (sequence-parallel, `num_rows` = Tp: this rank's [Tp / tp, H])."""
        embeds = self.embed_tokens(input_ids)
        if num_rows is not None:
            embeds = shard(embeds, num_rows, self.dist_ctx)
            target_hidden = shard(target_hidden, num_rows, self.dist_ctx)
        embeds = self.pre_fc_norm_embedding(embeds)
        hidden = self.pre_fc_norm_hidden(target_hidden.to(embeds.dtype))
        return self.fc(torch.cat([embeds, hidden], dim=-1))

    def write_kv(self, input_ids: torch.Tensor, target_hidden: torch.Tensor, inputs: ModelInputs,
                 caches) -> None:
        """Only what `forward` (layer 0) writes to this head's KV cache: a step that drafts
        nothing keeps the cache complete at the cost of fc and the K/V projections."""
        hidden = self._layer_input(input_ids, target_hidden)
        rope = self.rotary_emb(inputs.positions, hidden.dtype)
        layer = self.layers[0]
        layer.self_attn.store_kv(layer.input_layernorm(hidden), rope, caches[0], inputs)

    def write_kv_steps(self, steps: list[tuple[ModelInputs, torch.Tensor, torch.Tensor]],
                       caches) -> None:
        """`write_kv` of several steps' (inputs, input_ids, target_hidden), in order, with fc and
        the projections run once over all their rows."""
        hidden = self._layer_input(torch.cat([ids for _, ids, _ in steps]),
                                   torch.cat([h for _, _, h in steps]))
        rope = self.rotary_emb(torch.cat([inputs.positions for inputs, _, _ in steps]),
                               hidden.dtype)
        layer = self.layers[0]
        layer.self_attn.store_kv(layer.input_layernorm(hidden), rope, caches[0],
                                 *(inputs for inputs, _, _ in steps))

    compute_logits = Qwen3_5ForCausalLM.compute_logits      # the same, on the shared LM head
