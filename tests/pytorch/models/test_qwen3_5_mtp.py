"""Qwen3_5MTP against a reference head built from transformers parts (a decoder layer at a
full-attention index, three Qwen3_5RMSNorm, Linear(2H -> H)) with the same mtp.* weights."""
from __future__ import annotations

import pytest
import torch

from lmdeploy_lite.pytorch.config import CacheConfig
from lmdeploy_lite.pytorch.cache_engine import CacheEngine
from lmdeploy_lite.pytorch.models.loader import build_model, load_mtp_state_dict, load_mtp_weights
from lmdeploy_lite.pytorch.models.qwen3_5_mtp import Qwen3_5MTP
from tests.helpers.step_inputs import make_inputs, shuffled_block_tables
from tests.helpers.tiny_models import make_tiny_checkpoint, make_tiny_hf_model
from tests.pytorch.models.test_qwen3_5 import assert_logits_close, unfused_layer

BLOCK_SIZE = 4


class ReferenceMTP(torch.nn.Module):
    def __init__(self, hf_target, mtp_tensors: dict[str, torch.Tensor]):
        super().__init__()
        from transformers.models.qwen3_5.modeling_qwen3_5 import (Qwen3_5DecoderLayer,
                                                                  Qwen3_5RMSNorm)
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeDecoderLayer
        config = hf_target.config
        hidden = config.hidden_size
        moe = hasattr(config, 'num_experts')
        layer_cls = Qwen3_5MoeDecoderLayer if moe else Qwen3_5DecoderLayer
        self.layers = torch.nn.ModuleList(
            [layer_cls(config, config.layer_types.index('full_attention'))])
        self.pre_fc_norm_embedding = Qwen3_5RMSNorm(hidden, config.rms_norm_eps)
        self.pre_fc_norm_hidden = Qwen3_5RMSNorm(hidden, config.rms_norm_eps)
        self.norm = Qwen3_5RMSNorm(hidden, config.rms_norm_eps)
        self.fc = torch.nn.Linear(2 * hidden, hidden, bias=False)
        state = {k[len('mtp.'):]: v for k, v in mtp_tensors.items()}
        if moe and 'layers.0.mlp.experts.gate_up_proj' not in state:   # per-expert -> fused
            num = config.num_experts
            state['layers.0.mlp.experts.gate_up_proj'] = torch.stack([torch.cat(
                [state.pop(f'layers.0.mlp.experts.{e}.gate_proj.weight'),
                 state.pop(f'layers.0.mlp.experts.{e}.up_proj.weight')]) for e in range(num)])
            state['layers.0.mlp.experts.down_proj'] = torch.stack(
                [state.pop(f'layers.0.mlp.experts.{e}.down_proj.weight') for e in range(num)])
        self.load_state_dict(state, strict=True)
        self.float().eval()
        self.embed_tokens, self.rotary_emb = hf_target.model.embed_tokens, hf_target.model.rotary_emb
        self.lm_head = hf_target.lm_head

    def forward(self, next_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """One sequence from position 0: next_ids [n], hidden [n, H] -> [n, H] (no cache)."""
        n = next_ids.shape[0]
        e = self.pre_fc_norm_embedding(self.embed_tokens(next_ids[None]))
        h = self.pre_fc_norm_hidden(hidden[None])
        u = self.fc(torch.cat([e, h], -1))
        positions = torch.arange(n)[None]
        rope = self.rotary_emb(u, positions[None].expand(3, 1, n))
        mask = torch.full((n, n), float('-inf')).triu(1)[None, None]
        u = self.layers[0](u, position_embeddings=rope, attention_mask=mask, position_ids=positions)
        return self.norm(u)[0]


@pytest.mark.parametrize('moe,layout,per_expert', [
    (False, 'plain', False), (False, 'multimodal', False),
    (True, 'plain', False), (True, 'multimodal', True)])
@torch.no_grad()
def test_mtp_matches_reference_prefill_and_steps(tmp_path, moe, layout, per_expert):
    path = make_tiny_checkpoint(str(tmp_path), moe=moe, layout=layout, per_expert=per_expert)
    target = build_model(path, torch.float32, 'cpu', progress=False)
    mtp = Qwen3_5MTP(target.config, torch.float32, 'cpu', target.embed_tokens, target.lm_head)
    load_mtp_weights(mtp, path, progress=False)
    mtp.eval()
    assert not any(n.startswith(('embed_tokens', 'lm_head')) for n, _ in mtp.named_parameters())
    hf_target = make_tiny_hf_model(moe)
    ref = ReferenceMTP(hf_target, load_mtp_state_dict(path))

    gen = torch.Generator().manual_seed(5)
    seqs = [torch.randint(2, 512, (n,), generator=gen) for n in (9, 22)]
    batch = len(seqs)
    tables = shuffled_block_tables(batch, 16)
    cache_config = CacheConfig(block_size=BLOCK_SIZE, num_blocks=batch * 16 + 1,
                               num_state_slots=batch + 1)
    target_caches = CacheEngine(target.config, cache_config, torch.float32, 'cpu')
    mtp_caches = CacheEngine(target.config, cache_config, torch.float32, 'cpu',
                             layer_types=('full_attention',))
    # target prefill; the MTP runs over all prompt positions with the next tokens shifted in
    inputs = make_inputs(seqs, [0] * batch, tables, [0, 1])
    target_hidden = target(inputs, target_caches)
    logits = target.compute_logits(target_hidden)
    ends = torch.tensor([len(s) for s in seqs]).cumsum(0) - 1
    bonus = logits[ends].argmax(-1)
    next_ids = torch.cat([torch.cat([s[1:], bonus[b:b + 1]]) for b, s in enumerate(seqs)])
    out = mtp(next_ids, target_hidden, inputs, mtp_caches)

    pairs = []                                              # per sequence: (next_ids, hidden)
    start = 0
    for b, seq in enumerate(seqs):
        sl = slice(start, start + len(seq))
        hf_hidden = hf_target.model(seq[None]).last_hidden_state[0]
        assert_logits_close(target_hidden[sl], hf_hidden, f'target hidden seq {b}')
        expected = ref(next_ids[sl], target_hidden[sl])
        assert_logits_close(out[sl], expected, f'mtp prefill seq {b}')
        pairs.append((next_ids[sl], target_hidden[sl]))
        start += len(seq)

    # recursive single-token draft steps: own output as hidden, argmax draft token, position + 1
    hidden = out[ends]
    lens = [len(s) for s in seqs]
    for step in range(4):
        draft = mtp.compute_logits(hidden).argmax(-1)
        step_inputs = make_inputs([[int(t)] for t in draft], lens, tables, [0, 1],
                                  is_decoding=True)
        new_hidden = mtp(draft, hidden, step_inputs, mtp_caches)
        for b in range(batch):
            ids = torch.cat([pairs[b][0], draft[b:b + 1]])
            hid = torch.cat([pairs[b][1], hidden[b:b + 1]])
            pairs[b] = (ids, hid)
            assert_logits_close(new_hidden[b], ref(ids, hid)[-1], f'mtp step {step} seq {b}')
        hidden = new_hidden
        lens = [n + 1 for n in lens]
    assert mtp.compute_logits(hidden).dtype == torch.float32


def test_mtp_shares_target_embedding_and_head(tmp_path):
    path = make_tiny_checkpoint(str(tmp_path), moe=False, tie=True)
    target = build_model(path, torch.float32, 'cpu', progress=False)
    mtp = Qwen3_5MTP(target.config, torch.float32, 'cpu', target.get_input_embeddings(),
                     target.lm_head)
    load_mtp_weights(mtp, path, progress=False)
    assert mtp.embed_tokens is target.embed_tokens
    assert mtp.lm_head.weight is target.embed_tokens.weight
    names = {n for n, _ in mtp.named_parameters()}
    assert 'fc.weight' in names and 'layers.0.self_attn.q_proj.weight' in names


@torch.no_grad()
def test_mtp_fused_residual_norm_is_bit_identical(tmp_path):
    """The head's decoder layer and final norm with the residual adds fused (default backend)
    give the bits of a separate add and norm."""
    path = make_tiny_checkpoint(str(tmp_path), moe=True)
    target = build_model(path, torch.float32, 'cpu', progress=False)
    mtp = Qwen3_5MTP(target.config, torch.float32, 'cpu', target.embed_tokens, target.lm_head)
    load_mtp_weights(mtp, path, progress=False)
    gen = torch.Generator().manual_seed(7)
    seqs = [torch.randint(2, 512, (n,), generator=gen) for n in (6, 13)]
    tables = shuffled_block_tables(len(seqs), 8)
    cache_config = CacheConfig(block_size=BLOCK_SIZE, num_blocks=len(seqs) * 8 + 1,
                               num_state_slots=len(seqs) + 1)
    target_hidden = target(make_inputs(seqs, [0, 0], tables, [0, 1]),
                           CacheEngine(target.config, cache_config, torch.float32, 'cpu'))
    inputs = make_inputs(seqs, [0, 0], tables, [0, 1])
    next_ids = inputs.input_ids.roll(-1)
    fused = mtp(next_ids, target_hidden, inputs,
                CacheEngine(target.config, cache_config, torch.float32, 'cpu',
                            layer_types=('full_attention',)))

    caches = CacheEngine(target.config, cache_config, torch.float32, 'cpu',
                         layer_types=('full_attention',))
    embeds = mtp.pre_fc_norm_embedding(mtp.embed_tokens(next_ids))
    hidden = mtp.fc(torch.cat([embeds, mtp.pre_fc_norm_hidden(target_hidden)], dim=-1))
    rope = mtp.rotary_emb(inputs.positions, hidden.dtype)
    hidden = unfused_layer(mtp.layers[0], hidden, rope, caches[0], inputs)
    assert torch.equal(fused, mtp.norm(hidden))


def test_more_than_one_mtp_layer_is_refused():
    """A head of n > 1 layers drafts step i with layer i % n: running layer 0 at every step (as
    before) gives other drafts than the checkpoint's, so it is a ValueError naming the field."""
    from lmdeploy_lite.pytorch.config import ModelConfig
    from tests.helpers.tiny_models import tiny_text_config
    config = ModelConfig.from_dict(tiny_text_config(False, mtp_num_hidden_layers=2).to_dict())
    with pytest.raises(ValueError, match=r'config\.json: mtp_num_hidden_layers=2 '):
        Qwen3_5MTP(config, torch.float32, 'meta', None, None)
