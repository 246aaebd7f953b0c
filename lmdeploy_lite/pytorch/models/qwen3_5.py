"""Qwen3.5 text model (dense and MoE): architecture only.

Decoder layer (pre-norm): `h = x + mixer(norm1(x)); out = h + mlp(norm2(h))`, mixer = gated delta
net (`linear_attention` layers) or gated attention (`full_attention` layers); mlp = SwiGLU or sparse
MoE. Each residual add is fused into the norm after it (`norm(x, residual)`, one kernel on CUDA): a
layer takes and returns `(hidden, residual)`, the layer's output being their sum; the first layer
gets residual None and the final norm does the last add. Parameter names equal the HF text
checkpoint's (`model.layers.{i}...`, `lm_head.weight`), with MoE experts fused as transformers
keeps them.

With a `dist_ctx` every layer holds this rank's TP shard (nn/linear.py, nn/sharding.py) and
its MoE its EP experts; the embedding and LM head are vocab-parallel, and `compute_logits` returns
full-vocab logits on every TP rank. Sequence-parallel: nn/sequence_parallel.py.
"""
from __future__ import annotations

import torch
from torch import nn

from ..backends import get_backend
from ..config import ModelConfig
from ..model_inputs import ModelInputs
from ..nn.attention import GatedAttention
from ..nn.embedding import ParallelLMHead, VocabParallelEmbedding
from ..nn.gated_delta_net import GatedDeltaNet
from ..nn.mlp import SwiGLUMLP
from ..nn.moe import SparseMoeBlock
from ..nn.norm import RMSNorm
from ..nn.token_dispatcher import AllToAllDispatcher
from ..nn.rotary import RotaryEmbedding
from ..nn.sequence_parallel import is_sequence_parallel, splits_rows


def build_mlp(config: ModelConfig, dtype: torch.dtype, device, dist_ctx=None) -> nn.Module:
    """SwiGLU MLP or sparse MoE; with ep > 1 the MoE holds its rank's experts and an all-to-all
    dispatcher (nn/token_dispatcher.py: `EPTransport.attach` may swap in DeepEP's)."""
    if config.is_moe:
        dispatcher = None
        if dist_ctx is not None and dist_ctx.config.ep > 1:
            dispatcher = AllToAllDispatcher(dist_ctx, config.num_experts)
        return SparseMoeBlock(config.hidden_size, config.num_experts, config.num_experts_per_tok,
                              config.moe_intermediate_size, config.shared_expert_intermediate_size,
                              dtype, device, dist_ctx=dist_ctx, dispatcher=dispatcher)
    return SwiGLUMLP(config.hidden_size, config.intermediate_size, dtype, device, dist_ctx=dist_ctx)


class Qwen3_5DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_type: str, backend, dtype: torch.dtype, device,
                 dist_ctx=None):
        super().__init__()
        self.layer_type = layer_type
        if layer_type == 'linear_attention':
            self.linear_attn = GatedDeltaNet(
                config.hidden_size, config.linear_num_key_heads, config.linear_num_value_heads,
                config.linear_key_head_dim, config.linear_value_head_dim,
                config.linear_conv_kernel_dim, config.rms_norm_eps, backend, dtype, device,
                dist_ctx=dist_ctx)
        elif layer_type == 'full_attention':
            self.self_attn = GatedAttention(
                config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                config.head_dim, config.rms_norm_eps, backend, dtype, device, dist_ctx=dist_ctx)
        else:
            raise ValueError(f'layer_type={layer_type!r}: must be linear_attention or full_attention')
        self.mlp = build_mlp(config, dtype, device, dist_ctx)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype,
                                                device)
        self.dist_ctx = dist_ctx
        self.sequence_parallel = is_sequence_parallel(dist_ctx)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                rope: tuple[torch.Tensor, torch.Tensor], cache, inputs: ModelInputs
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden, residual [T, H] (module docstring; sequence-parallel: this rank's rows
        [Tp / tp, H], gathered to [Tp, H] after each norm) -> (mlp output, residual). cache:
        (k_cache, v_cache) or (conv_state, recurrent_state). `residual` is consumed (a fused
        norm may overwrite it)."""
        split = self.sequence_parallel and splits_rows(inputs)
        if residual is None:
            residual, normed = hidden, self.input_layernorm(hidden)
        else:
            normed, residual = self.input_layernorm(hidden, residual)
        if split:                       # whole rows for the column-parallel projections
            normed = self.dist_ctx.tp.gather_rows(normed)
        if self.layer_type == 'linear_attention':
            mixed = self.linear_attn(normed, cache, inputs)
        else:
            mixed = self.self_attn(normed, rope, cache, inputs)
        normed, residual = self.post_attention_layernorm(mixed, residual)
        if split:
            normed = self.dist_ctx.tp.gather_rows(normed)
        return self.mlp(normed, inputs.sizes), residual


class Qwen3_5Model(nn.Module):
    def __init__(self, config: ModelConfig, backend, dtype: torch.dtype, device, dist_ctx=None):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype,
                                                   device, dist_ctx)
        self.layers = nn.ModuleList(
            Qwen3_5DecoderLayer(config, t, backend, dtype, device, dist_ctx)
            for t in config.layer_types)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.rotary_emb = RotaryEmbedding(config.rotary_dim, config.rope_theta, device)
        self.dist_ctx = dist_ctx
        self.sequence_parallel = is_sequence_parallel(dist_ctx)

    def forward(self, inputs: ModelInputs, caches, aux_layer_ids: tuple[int, ...] = ()
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """[T, H] post-final-norm hidden states; with `aux_layer_ids`, also [T, len(ids), H]:
        transformers' `output_hidden_states[i]` for each id i (0: the embedding output; i < L:
        the residual stream entering layer i, the sum of the (hidden, residual) pair there; L:
        the final-normed output). Sequence-parallel: the layers run on this rank's share of the
        plan's padded rows (`inputs.sizes.tokens`); the output is gathered whole."""
        split = self.sequence_parallel and splits_rows(inputs)
        if split and aux_layer_ids:
            raise ValueError('extract_hidden_states with sequence_parallel=True: not '
                             'supported (the captured rows must be whole)')
        hidden = self.embed_tokens(inputs.input_ids, inputs.sizes.tokens if split else None)
        rope = self.rotary_emb(inputs.positions, hidden.dtype)
        residual = None
        captured = {}
        for idx, layer in enumerate(self.layers):
            if idx in aux_layer_ids:        # a copy: a fused norm may overwrite its inputs
                captured[idx] = hidden.clone() if residual is None else hidden + residual
            hidden, residual = layer(hidden, residual, rope, caches[idx], inputs)
        out = self.norm(hidden, residual)[0]
        if split:                       # whole rows for the LM head and the draft
            out = self.dist_ctx.tp.gather_rows(out)[:inputs.num_tokens]
        if not aux_layer_ids:
            return out
        captured[len(self.layers)] = out
        return out, torch.stack([captured[i] for i in aux_layer_ids], dim=1)


class Qwen3_5ForCausalLM(nn.Module):
    """Target model. `forward(inputs, caches) -> [T, H]` post-final-norm hidden states (what the
    LM head scores and what the MTP draft consumes); `compute_logits(hidden [N, H]) -> [N, V]`."""

    def __init__(self, model_config: ModelConfig, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str = 'cpu', dist_ctx=None):
        super().__init__()
        self.config, self.dtype = model_config, dtype
        self.model = Qwen3_5Model(model_config, get_backend(device), dtype, device, dist_ctx)
        self.lm_head = ParallelLMHead(model_config.vocab_size, model_config.hidden_size, dtype,
                                      device, dist_ctx)
        if model_config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def embed_tokens(self) -> VocabParallelEmbedding:
        return self.model.embed_tokens

    def get_input_embeddings(self) -> VocabParallelEmbedding:
        return self.model.embed_tokens

    def forward(self, inputs: ModelInputs, caches) -> torch.Tensor:
        """caches: `caches[layer_idx]` -> that layer's cache tuple (see pytorch/cache_engine.py)."""
        return self.model(inputs, caches)

    def forward_with_hidden_states(self, inputs: ModelInputs, caches,
                                   layer_ids: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` plus the hidden states at `layer_ids` (`Qwen3_5Model.forward`)."""
        return self.model(inputs, caches, layer_ids)

    def compute_logits(self, hidden: torch.Tensor, cast: bool = True) -> torch.Tensor:
        """hidden [N, H] -> logits [N, V] in float32 (float64 for a float64 model) on every rank;
        `cast=False`: in the LM head's dtype (enough for an argmax: the same maximum)."""
        logits = self.lm_head(hidden)
        if not cast:
            return logits
        return logits.to(torch.float64 if self.dtype == torch.float64 else torch.float32)
