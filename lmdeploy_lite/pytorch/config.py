"""Internal configs derived from a checkpoint and from the user's engine config.

`ModelConfig` is read from a HF `config.json` (released Qwen3.5 checkpoints nest the text model's
fields under `text_config`); `CacheConfig` is the cache layout the engine allocates."""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field

SUPPORTED_MODEL_TYPES = {
    'qwen3_5': False, 'qwen3_5_text': False,          # value: is MoE
    'qwen3_5_moe': True, 'qwen3_5_moe_text': True,
}
MOE_FIELDS = ('num_experts', 'num_experts_per_tok', 'moe_intermediate_size',
              'shared_expert_intermediate_size')
# read from config.json when there, else the dataclass default (transformers' default too)
DEFAULTED_FIELDS = ('linear_conv_kernel_dim', 'linear_key_head_dim', 'linear_value_head_dim',
                    'linear_num_key_heads', 'linear_num_value_heads', 'max_position_embeddings')
# what transformers' Qwen3_5[Moe]TextConfig takes for a field config.json leaves out (its
# RoPE base is `default_theta`, not a released checkpoint's 1e7)
HF_DEFAULTS = {'head_dim': 256, 'intermediate_size': 12288, 'rope_theta': 10000.0,
               'partial_rotary_factor': 0.25, 'num_experts': 256, 'num_experts_per_tok': 8,
               'moe_intermediate_size': 512, 'shared_expert_intermediate_size': 512}
# transformers' `remap_legacy_layer_types`
LEGACY_LAYER_TYPES = {'mamba': 'linear_attention', 'attention': 'full_attention'}
LAYER_TYPES = ('linear_attention', 'full_attention')
# rope types whose text-only angles are plain 1-D RoPE (transformers' 'default'; Qwen2-VL's
# configs named mRoPE 'mrope')
ROPE_TYPES = ('default', 'mrope')


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    is_moe: bool
    vocab_size: int
    hidden_size: int
    num_layers: int
    layer_types: tuple[str, ...]          # 'linear_attention' | 'full_attention' per layer
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    # dense MLP
    intermediate_size: int
    # MoE
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    # gated delta net
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    # MTP head
    mtp_num_hidden_layers: int = 0
    eos_token_ids: tuple[int, ...] = ()
    max_position_embeddings: int = 32768
    hf_config: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def full_attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == 'full_attention']

    @property
    def linear_attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == 'linear_attention']

    @property
    def linear_conv_dim(self) -> int:
        """Channels of the depthwise conv: [q | k | v] of the gated delta net."""
        return (2 * self.linear_num_key_heads * self.linear_key_head_dim
                + self.linear_num_value_heads * self.linear_value_head_dim)

    @classmethod
    def from_dict(cls, cfg: dict) -> 'ModelConfig':
        top_type = cfg.get('model_type')
        text = cfg.get('text_config') or cfg
        model_type = text.get('model_type', top_type)
        if model_type not in SUPPORTED_MODEL_TYPES and top_type not in SUPPORTED_MODEL_TYPES:
            archs = cfg.get('architectures')
            raise ValueError(
                f'config.json: model_type={top_type!r} (architectures={archs}) is not supported; '
                f'lmdeploy_lite runs {sorted(SUPPORTED_MODEL_TYPES)}')
        is_moe = SUPPORTED_MODEL_TYPES.get(model_type, SUPPORTED_MODEL_TYPES.get(top_type))
        num_layers = text['num_hidden_layers']
        layer_types = text.get('layer_types')
        if layer_types is None:
            interval = text.get('full_attention_interval', 4)
            layer_types = ['full_attention' if (i + 1) % interval == 0 else 'linear_attention'
                           for i in range(num_layers)]
        layer_types = tuple(LEGACY_LAYER_TYPES.get(t, t) for t in layer_types)
        rope = text.get('rope_parameters') or text.get('rope_scaling') or {}
        head_dim = (text.get('head_dim', HF_DEFAULTS['head_dim'])
                    or text['hidden_size'] // text['num_attention_heads'])
        partial, theta = (rope.get(name, text.get(name, HF_DEFAULTS[name]))
                          for name in ('partial_rotary_factor', 'rope_theta'))
        eos = text.get('eos_token_id', cfg.get('eos_token_id'))
        eos = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
        tie = cfg.get('tie_word_embeddings', text.get('tie_word_embeddings', False))
        moe = {name: text.get(name, HF_DEFAULTS[name]) for name in MOE_FIELDS} if is_moe else {}
        dense_ffn = 0 if is_moe else HF_DEFAULTS['intermediate_size']
        config = cls(
            model_type=model_type, is_moe=is_moe,
            vocab_size=text['vocab_size'], hidden_size=text['hidden_size'],
            num_layers=num_layers, layer_types=layer_types,
            num_attention_heads=text['num_attention_heads'],
            num_key_value_heads=text['num_key_value_heads'],
            head_dim=head_dim, rotary_dim=int(head_dim * partial), rope_theta=float(theta),
            rms_norm_eps=text.get('rms_norm_eps', 1e-6), tie_word_embeddings=bool(tie),
            intermediate_size=text.get('intermediate_size', dense_ffn) or 0,
            mtp_num_hidden_layers=text.get('mtp_num_hidden_layers', 0) or 0, eos_token_ids=eos,
            hf_config=cfg, **moe, **{name: text[name] for name in DEFAULTED_FIELDS if name in text})
        check_supported(config, text, rope)
        return config

    @classmethod
    def from_pretrained(cls, model_dir: str) -> 'ModelConfig':
        if not os.path.isdir(model_dir):
            raise ValueError(f'model_path={model_dir!r}: no such directory')
        path = os.path.join(model_dir, 'config.json')
        if not os.path.isfile(path):
            raise ValueError(f'model_path={model_dir!r}: no config.json in the directory')
        with open(path) as f:
            config = cls.from_dict(json.load(f))
        eos = read_generation_config(model_dir).get('eos_token_id')     # stop ids too (vLLM)
        eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
        return dataclasses.replace(config, eos_token_ids=tuple(dict.fromkeys(
            config.eos_token_ids + eos)))


def check_supported(config: ModelConfig, text: dict, rope: dict) -> None:
    """ValueErrors naming the config.json field for a text config that transformers would run
    differently from this engine (or not at all), instead of producing other numbers:
    `text` is the text model's fields, `rope` its rope_parameters (or legacy rope_scaling)."""
    def fail(field_name: str, value, allowed: str):
        raise ValueError(f'config.json: {field_name}={value!r} is not supported: {allowed}')

    rope_type = rope.get('rope_type', rope.get('type', 'default'))
    if rope_type not in ROPE_TYPES:
        fail('rope_parameters.rope_type', rope_type, "lmdeploy_lite implements 'default' RoPE "
             '(no position scaling: linear, dynamic, yarn, longrope, llama3)')
    for field_name, value, allowed in (('hidden_act', text.get('hidden_act', 'silu'), 'silu'),
                                       ('attention_bias', text.get('attention_bias', False),
                                        False)):
        if value != allowed:
            fail(field_name, value, f'Qwen3.5 uses {allowed!r} (lmdeploy_lite implements only '
                 'that)')
    if len(config.layer_types) != config.num_layers:
        fail('layer_types', list(config.layer_types), f'must list num_hidden_layers='
             f'{config.num_layers} entries')
    for layer_type in config.layer_types:
        if layer_type not in LAYER_TYPES:
            fail('layer_types', layer_type, f'each entry must be one of {LAYER_TYPES}')
    for many, few in (('num_attention_heads', 'num_key_value_heads'),
                      ('linear_num_value_heads', 'linear_num_key_heads')):
        if getattr(config, many) % getattr(config, few):
            fail(many, getattr(config, many), f'must be a multiple of {few}='
                 f'{getattr(config, few)} (each of those heads serves a group of them)')
    if config.rotary_dim % 2 or not 2 <= config.rotary_dim <= config.head_dim:
        partial = rope.get('partial_rotary_factor', text.get('partial_rotary_factor',
                                                             HF_DEFAULTS['partial_rotary_factor']))
        fail('rope_parameters.partial_rotary_factor', partial,
             f'head_dim={config.head_dim} x factor = {config.rotary_dim} rotated channels must '
             f'be even and in 2..head_dim')
    if config.is_moe and not 1 <= config.num_experts_per_tok <= config.num_experts:
        fail('num_experts_per_tok', config.num_experts_per_tok,
             f'must be in 1..num_experts={config.num_experts}')


SAMPLING_FIELDS = ('temperature', 'top_p', 'top_k', 'min_p', 'repetition_penalty')


def read_generation_config(model_dir: str) -> dict:
    """The model's generation_config.json ({} without one): its eos ids, its sampling
    defaults (`SAMPLING_FIELDS`, what the server applies to fields a request omits)."""
    path = os.path.join(model_dir, 'generation_config.json')
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def sampling_defaults(model_dir: str) -> dict:
    found = read_generation_config(model_dir)
    return {k: found[k] for k in SAMPLING_FIELDS if k in found}


@dataclass(frozen=True)
class CacheConfig:
    """Cache layout for one rank: `num_blocks` KV blocks of `block_size` tokens (full
    attention), `num_state_slots` per-sequence state rows (linear attention; model_inputs.py)."""
    block_size: int
    num_blocks: int
    num_state_slots: int
    num_spec_tokens: int = 0
    num_snapshots: int = 0        # prefix cache: linear-attention state snapshots (0: no cache)


def head_replicas(what: str, num_heads: int, tp: int) -> int:
    """How many TP ranks hold each of `num_heads` heads: 1 where tp divides them; tp / num_heads
    where tp is a multiple of them (KV heads under a tp above their count: each rank keeps the
    one its query heads read, as lmdeploy and vLLM replicate them); else ValueError."""
    if num_heads % tp == 0:
        return 1
    if tp % num_heads == 0:
        return tp // num_heads
    raise ValueError(f'tp={tp}: must divide {what}={num_heads} or be a multiple of it')


@dataclass(frozen=True)
class DistConfig:
    """lmdeploy's layout: world = dp x tp; attention is TP inside a DP group; with ep > 1 the
    experts are sharded over the whole world (ep == world). `sequence_parallel`:
    nn/sequence_parallel.py."""
    tp: int = 1
    dp: int = 1
    ep: int = 1
    sequence_parallel: bool = False

    @property
    def world_size(self) -> int:
        return self.dp * self.tp

    def validate(self, model: ModelConfig, num_devices: int | None = None):
        """ValueErrors that name the numbers; called before any process starts (the ints
        themselves are PytorchEngineConfig's and SpeculativeConfig's to check)."""
        tp = self.tp
        if self.sequence_parallel and tp == 1:
            raise ValueError(f'sequence_parallel=True: needs tp > 1 (tp={tp}); sequence '
                             'parallelism splits tokens over the TP ranks')
        for what, count in (('num_attention_heads', model.num_attention_heads),
                            ('linear_num_key_heads', model.linear_num_key_heads),
                            ('linear_num_value_heads', model.linear_num_value_heads)):
            if count % tp:
                raise ValueError(f'tp={tp}: must divide {what}={count}')
        head_replicas('num_key_value_heads', model.num_key_value_heads, tp)
        if self.ep > 1:
            if not model.is_moe:
                raise ValueError(f'ep={self.ep}: expert parallelism needs a MoE model, but '
                                 f'{model.model_type} is dense')
            if self.ep != self.world_size:
                raise ValueError(f'ep={self.ep}: experts are sharded over the whole world, so ep '
                                 f'must equal dp x tp = {self.dp} x {tp} = {self.world_size}')
            if model.num_experts % self.ep:
                raise ValueError(f'ep={self.ep}: must divide num_experts={model.num_experts}')
        if num_devices is not None and self.world_size > num_devices:
            raise ValueError(f'dp x tp = {self.dp} x {tp} = {self.world_size} ranks, but only '
                             f'{num_devices} devices are available')
