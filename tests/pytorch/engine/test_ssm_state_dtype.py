"""PytorchEngineConfig.ssm_state_dtype: the dtype the gated-delta recurrent state is STORED in
(computed in fp32, fp64 for a float64 model, whatever it is stored in).

Checked here: the config and CLI edge; 'auto' (the checkpoint's mamba_ssm_dtype, float32 when
absent, float64 for a float64 model); bf16 caches and the bytes the cache plan charges for them
(by hand: the embedded model and the 0.8B shape); the ops (a verify of n tokens equals n one-token
decodes bit for bit with a bf16 state, because each token starts from the state as stored); the
engine: a bf16 state generates (its token match against the fp32 state is printed, and only the
first token, which comes from the prefill of a zero state, is asserted equal), and speculation
does not change the output under a bf16 state (float64 model, exactly).
"""
import dataclasses
import functools
import os
import sys

import pytest
import torch

from lmdeploy_lite.api import EMBEDDED_MODEL_DIR
from lmdeploy_lite.cli.main import build_parser
from lmdeploy_lite.messages import GenerationConfig, PytorchEngineConfig
from lmdeploy_lite.pytorch.backends import default
from lmdeploy_lite.pytorch.config import CacheConfig, ModelConfig
from lmdeploy_lite.pytorch.cache_engine import CacheEngine, state_dtype
from lmdeploy_lite.pytorch.engine.cache_plan import plan_cache
from tests.helpers import accepting
from tests.helpers.step_inputs import make_inputs, shuffled_block_tables

BENCH_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))), 'benchmarks')


@functools.cache
def embedded() -> ModelConfig:
    return ModelConfig.from_pretrained(EMBEDDED_MODEL_DIR)


def with_ssm_dtype(config: ModelConfig, name: str) -> ModelConfig:
    """`config` whose checkpoint says text_config.mamba_ssm_dtype = name."""
    hf = dict(config.hf_config)
    hf['text_config'] = dict(hf['text_config'], mamba_ssm_dtype=name)
    return dataclasses.replace(config, hf_config=hf)


# ----------------------------------------------------------------------------- the edge

@pytest.mark.parametrize('value', ['float16', 'bf16', None, torch.bfloat16])
def test_bad_value_names_field_value_and_allowed(value):
    with pytest.raises(ValueError) as e:
        PytorchEngineConfig(ssm_state_dtype=value)
    assert str(e.value) == (f"ssm_state_dtype={value!r}: must be one of "
                            f"('auto', 'float32', 'bfloat16')")


def test_cli_flag_on_every_command_with_engine_options():
    parser = build_parser()
    for argv in (['generate', '--prompt', 'x'], ['chat'], ['serve', 'api_server']):
        assert parser.parse_args(argv).ssm_state_dtype == 'auto'
        args = parser.parse_args(argv + ['--ssm-state-dtype', 'bfloat16'])
        assert args.ssm_state_dtype == 'bfloat16'
    with pytest.raises(SystemExit):
        parser.parse_args(['chat', '--ssm-state-dtype', 'float16'])


# ----------------------------------------------------------------------------- resolution

def test_auto_is_the_checkpoint_dtype_float32_when_absent_float64_for_float64():
    config = embedded()
    assert 'mamba_ssm_dtype' not in config.hf_config['text_config']
    assert state_dtype(torch.float32, 'auto', config) == torch.float32
    assert state_dtype(torch.bfloat16, 'auto', config) == torch.float32
    assert state_dtype(torch.float64, 'auto', config) == torch.float64
    assert (state_dtype(torch.float64), state_dtype(torch.float32)) == (torch.float64,
                                                                         torch.float32)
    declared = with_ssm_dtype(config, 'bfloat16')
    assert state_dtype(torch.bfloat16, 'auto', declared) == torch.bfloat16
    assert state_dtype(torch.float64, 'auto', declared) == torch.float64
    assert state_dtype(torch.bfloat16, 'float32', declared) == torch.float32
    assert state_dtype(torch.float32, 'bfloat16', config) == torch.bfloat16
    with pytest.raises(ValueError, match=r"mamba_ssm_dtype='int8'.*set ssm_state_dtype"):
        state_dtype(torch.float32, 'auto', with_ssm_dtype(config, 'int8'))


@pytest.mark.parametrize('dtype', [torch.float32, torch.float64])
def test_engine_auto_state_is_float32_or_float64(dtype):
    from lmdeploy_lite.pytorch.engine.build import build_engine
    name = {torch.float32: 'float32', torch.float64: 'float64'}[dtype]
    engine = build_engine(accepting.model_dir(), PytorchEngineConfig(
        dtype=name, device='cpu', block_size=16, session_len=64, max_batch_size=2),
        progress=False)
    recurrent = [c[1] for c, t in zip(engine.agent.caches.caches, embedded().layer_types)
                 if t == 'linear_attention']
    assert recurrent and all(r.dtype == dtype for r in recurrent)


# ----------------------------------------------------------------------------- caches and plan

def test_bf16_caches_and_the_bytes_charged():
    """Embedded model: 6 linear-attention layers, conv_dim 2*2*64 + 4*64 = 512, K = 4, 4 value
    heads of 64 x 64; k = 3 drafts."""
    config = embedded()
    caches = CacheEngine(config, CacheConfig(block_size=16, num_blocks=4, num_state_slots=3,
                                             num_spec_tokens=3), torch.float32, 'cpu',
                         ssm_state_dtype='bfloat16')
    for layer_type, (first, second) in zip(config.layer_types, caches.caches):
        if layer_type == 'linear_attention':
            assert first.dtype == torch.float32 and second.dtype == torch.bfloat16   # conv, rec
        else:
            assert first.dtype == second.dtype == torch.float32                     # k, v
    conv = 512 * (4 - 1 + 3) * 4
    rec = (1 + 3) * 4 * 64 * 64
    for name, elem in (('float32', 4), ('bfloat16', 2), ('auto', 4)):
        assert CacheEngine.bytes_per_state_slot(config, 3, torch.float32,
                                                ssm_state_dtype=name) == 6 * (conv + rec * elem)


def test_conv_windows_are_channel_minor():
    """The conv windows (and their prefix-cache snapshots) are [slots, C, W] views of [slots, W,
    C] storage, so a decode kernel's window column is contiguous over channels; the recurrent
    states stay contiguous."""
    caches = CacheEngine(embedded(), CacheConfig(block_size=16, num_blocks=4, num_state_slots=3,
                                                 num_spec_tokens=3, num_snapshots=2),
                         torch.float32, 'cpu')
    (conv, rec), (conv_rows, _) = caches.states, caches.snapshots
    assert conv.shape[1:] == (3, 512, 6) and conv.stride()[1:] == (6 * 512, 1, 512)
    assert conv_rows.shape[1:] == (2, 512, 3) and conv_rows.stride()[2:] == (1, 512)
    assert rec.is_contiguous()
    layer = next(i for i, t in enumerate(embedded().layer_types) if t == 'linear_attention')
    assert caches[layer][0].stride() == (6 * 512, 1, 512)


def test_bf16_state_halves_the_recurrent_bytes_of_the_0_8b_shape():
    """Qwen3.5-0.8B (bf16 model): 18 linear-attention layers, 16 value heads of 128 x 128: the
    recurrent state of one sequence (no drafts) is 18 * 16 * 128 * 128 * 4 B = 18.9 MB in fp32."""
    sys.path.insert(0, BENCH_DIR)
    from presets import preset_config
    config = ModelConfig.from_dict(preset_config('qwen3_5_0_8b'))
    conv = 18 * (2 * 16 * 128 + 16 * 128) * 3 * 2
    rec = 18 * 16 * 128 * 128
    fp32 = CacheEngine.bytes_per_state_slot(config, 0, torch.bfloat16)
    bf16 = CacheEngine.bytes_per_state_slot(config, 0, torch.bfloat16, ssm_state_dtype='bfloat16')
    assert (fp32, bf16) == (conv + 4 * rec, conv + 2 * rec)
    assert 4 * rec == 18_874_368


def test_plan_charges_half_the_recurrent_bytes_so_more_blocks_fit():
    """Same budget, k = 3 with the MTP draft's KV layer: the bf16 plan's blocks are exactly the
    budget minus bf16 state rows over the block bytes (by hand), and more than fp32's."""
    config = embedded()
    available, slots = 512 << 20, 64 + 1
    conv, rec = 512 * 6 * 4, 4 * 4 * 64 * 64
    block = 2 * 2 * 16 * 2 * 64 * 4 + 2 * 1 * 16 * 2 * 64 * 4    # target's 2 layers + draft's 1
    blocks = {}
    for name, elem in (('float32', 4), ('bfloat16', 2)):
        cfg = PytorchEngineConfig(block_size=16, max_batch_size=64, cache_max_entry_count=0.5,
                                  session_len=4096, ssm_state_dtype=name,
                                  enable_prefix_caching=False)             # (no snapshots)
        plan = plan_cache(config, cfg, 4096 + 3 + 2, 3, 1, torch.float32, available)
        expected = int((available * 0.5 - slots * 6 * (conv + rec * elem)) // block)
        assert plan.num_blocks == expected, name
        blocks[name] = plan.num_blocks
    assert blocks['bfloat16'] > blocks['float32']
    assert blocks['bfloat16'] - blocks['float32'] == pytest.approx(
        slots * 6 * rec * 2 / block, abs=1)


# ----------------------------------------------------------------------------- ops

def _verify_vs_plain_decode(op, dtype, device, n=4, nk=2, nv=4, d=16):
    """Run `op` (a gated_delta_rule_decode) once over n tokens per sequence (a verify) and n
    times over one token (plain decode steps, each reading what the previous one stored), from
    the same bf16 cache; return (outputs, stored states) of both."""
    gen = torch.Generator().manual_seed(0)
    total = 2 * n
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    q, k = (torch.randn(total, nk, d, generator=gen).to(device, dtype) for _ in range(2))
    v = torch.randn(total, nv, d, generator=gen).to(device, dtype)
    g = (-torch.rand(total, nv, generator=gen) * 0.5).to(device, acc)
    beta = torch.rand(total, nv, generator=gen).to(device, dtype)
    start = (torch.randn(3, n, nv, d, d, generator=gen) * 0.3).to(device, torch.bfloat16)
    rows, tables = [1, 2], shuffled_block_tables(2, 4)
    cache = start.clone()
    inputs = make_inputs([[0] * n] * 2, [5, 7], tables, rows, [0, 0], True).to(device)
    verify_out = op(q, k, v, g, beta, cache, inputs)
    verify_states = cache[rows]                                           # [2, n, nv, d, d]
    plain = start.clone()
    outs, states = [], []
    for t in range(n):
        index = torch.tensor([t, n + t], device=device)
        inputs = make_inputs([[0]] * 2, [5 + t, 7 + t], tables, rows, [0, 0], True).to(device)
        outs.append(op(q[index], k[index], v[index], g[index], beta[index], plain, inputs))
        states.append(plain[rows, 0].clone())
    plain_out = torch.stack(outs, 1).reshape(verify_out.shape)
    return (verify_out, verify_states), (plain_out, torch.stack(states, 1))


@pytest.mark.parametrize('dtype', [torch.float32, torch.float64])
def test_default_verify_equals_plain_decode_with_bf16_state(dtype):
    (out, states), (plain_out, plain_states) = _verify_vs_plain_decode(
        default.gated_delta_rule_decode, dtype, 'cpu')
    assert states.dtype == torch.bfloat16
    assert torch.equal(out, plain_out) and torch.equal(states, plain_states)


def test_kernel_verify_equals_plain_decode_with_bf16_state(kernel_device):
    """The Triton decode kernel (interpreter on CPU), fp32 activations, bf16 state: bit for bit
    as the plain decode steps; on CUDA also close to the default op. (Triton's interpreter does
    not round fp32 -> bf16 to nearest as the GPU and torch do, so on CPU only the first check.)"""
    from lmdeploy_lite.pytorch.backends.cuda import gated_delta_rule as cuda_gdr
    (out, states), (plain_out, plain_states) = _verify_vs_plain_decode(
        cuda_gdr.gated_delta_rule_decode, torch.float32, kernel_device)
    assert torch.equal(out, plain_out) and torch.equal(states, plain_states)
    if kernel_device != 'cuda':
        return
    (ref_out, ref_states), _ = _verify_vs_plain_decode(
        default.gated_delta_rule_decode, torch.float32, 'cpu')
    # the fp32 sums differ in their last bits; where they round to different bf16 states the
    # next tokens differ by about one bf16 ulp (2**-8) of the state: compare by relative norm
    for got, want in ((out, ref_out), (states, ref_states)):
        err = (got.cpu().double() - want.double()).norm() / want.double().norm()
        assert err < 5e-3, f'relative error {err:.2e}'


@pytest.mark.gpu
def test_fla_prefill_runs_on_a_bf16_state():
    """fla's chunk kernel on a bf16 state (an fp32 copy of the rows in, fp32 final states stored
    back as bf16) against the default op: fresh sequences, then a chunked continuation."""
    pytest.importorskip('fla.ops.gated_delta_rule')
    from lmdeploy_lite.pytorch.backends.cuda import gated_delta_rule as cuda_gdr
    gen = torch.Generator().manual_seed(1)
    nk, nv, d = 16, 32, 128
    cache = (torch.randn(7, 3, nv, d, d, generator=gen) * 0.3).to('cuda', torch.bfloat16)
    for q_lens, history in (([150, 1, 64], [0, 0, 0]), ([77, 130, 3], [150, 1, 64])):
        total = sum(q_lens)
        mixed = torch.randn(total, 2 * nk * d + nv * d, generator=gen).to('cuda', torch.bfloat16)
        q, k, v = mixed.split([nk * d, nk * d, nv * d], dim=-1)
        q, k, v = q.view(-1, nk, d), k.view(-1, nk, d), v.view(-1, nv, d)
        g = (-torch.rand(total, nv, generator=gen) * 0.5).cuda()
        beta = torch.rand(total, nv, generator=gen).to('cuda', torch.bfloat16)
        inputs = make_inputs([[0] * n for n in q_lens], history, shuffled_block_tables(3, 8),
                             [4, 0, 6], [0, 0, 0], False).to('cuda')
        expected_cache = cache.clone()
        out = cuda_gdr.gated_delta_rule_prefill(q, k, v, g, beta, cache, inputs)
        expected = default.gated_delta_rule_prefill(q, k, v, g, beta, expected_cache, inputs)
        assert cache.dtype == torch.bfloat16
        for got, want in ((out, expected), (cache, expected_cache)):
            err = (got.double() - want.double()).norm() / want.double().norm()
            assert err < 2e-2, f'relative error {err:.2e}'


# ----------------------------------------------------------------------------- engine

def _generate(k: int, dtype: str, ssm_state_dtype: str, prompts, max_new_tokens: int = 32):
    gen = GenerationConfig(max_new_tokens=max_new_tokens, ignore_eos=True)
    return accepting.reference(k, prompts, gen, dtype=dtype, ssm_state_dtype=ssm_state_dtype,
                               session_len=128)


def test_bf16_state_generates_and_its_match_is_measured():
    """float32 model, greedy, 32 tokens, the accepting prompts. Measured here (CPU): 4 of 4
    sequences identical to the fp32 state's (128/128 tokens). Asserted: every sequence ran to
    32 tokens and its first token (from the prefill) agrees."""
    prompts = accepting.prompts()
    fp32 = _generate(0, 'float32', 'float32', prompts).token_ids
    bf16 = _generate(0, 'float32', 'bfloat16', prompts).token_ids
    match = sum(a == b for x, y in zip(fp32, bf16) for a, b in zip(x, y))
    firsts = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x))
              for x, y in zip(fp32, bf16)]
    print(f'\nbf16 vs fp32 state: {match}/{32 * len(prompts)} tokens match, first divergence '
          f'per sequence {firsts}')
    assert all(len(ids) == 32 for ids in bf16)
    assert [ids[0] for ids in bf16] == [ids[0] for ids in fp32]


def test_speculation_does_not_change_the_output_with_a_bf16_state():
    """float64 model with a bf16-stored state, 16 prompts x 32 tokens, MTP k=3: greedy output ==
    plain greedy, exactly, with drafts really accepted (asserted first). Fails without the
    per-token rounding of a multi-token decode (the verify then carried the unrounded state from
    token to token, plain decode the stored one): 2 of these 16 sequences diverged, at tokens 21
    and 22 (also in float32; 32 tokens cover both, as 64 did)."""
    prompts = accepting.many_prompts(16)
    plain = _generate(0, 'float64', 'bfloat16', prompts, 32)
    speculative = _generate(3, 'float64', 'bfloat16', prompts, 32)
    accepting.assert_real_acceptance(speculative.stats, 3)
    assert speculative.token_ids == plain.token_ids
