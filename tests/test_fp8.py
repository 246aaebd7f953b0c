"""FP8 weights on CPU (lmdeploy_lite/pytorch/models/fp8.py): a tiny Qwen3.5-MoE checkpoint
written here in the released FP8 layout (block scales with partial edge blocks, per-expert or
fused experts, modules_to_not_convert) gives transformers' greedy output on the dequantized
weights (float64); online `model_format='fp8'` loads exactly what the pre-quantized checkpoint
holds; MTP k=3 on the quantized embedded model accepts drafts and changes no token; tp=2 and
dp=2 ep=2 give the single process's tokens; a bad quantization is a ValueError naming the file
and the tensor or field."""
import json
import os
import re
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from helpers.accepting import assert_real_acceptance, prompts
from lmdeploy_lite import GenerationConfig, PytorchEngineConfig, SpeculativeConfig, pipeline
from lmdeploy_lite.api import EMBEDDED_MODEL_DIR
from lmdeploy_lite.pytorch.models.fp8 import (BLOCK, FP8, FP8_MAX, SCALE_SUFFIX, dequantize,
                                              quantizable, quantize, reference_fp8_linear)
from lmdeploy_lite.pytorch.nn.linear import ColumnParallelLinear, FusedColumnLinear
from lmdeploy_lite.pytorch.models.fp8 import to_fp8
from lmdeploy_lite.pytorch.models.loader import build_model, checkpoint_files, fp8_linears

QUANT = {'quant_method': 'fp8', 'fmt': 'e4m3', 'activation_scheme': 'dynamic',
         'weight_block_size': [BLOCK, BLOCK]}
KEEP = ('mlp.shared_expert.down_proj',)          # modules_to_not_convert of the test checkpoint
GREEDY = GenerationConfig(max_new_tokens=12, ignore_eos=True)
PROMPTS = [[5, 17, 42, 8, 99, 3], [7, 7, 300, 12]]


def tensors_of(model_dir: str) -> dict[str, torch.Tensor]:
    out = {}
    for path, names in checkpoint_files(model_dir).items():
        with safe_open(path, 'pt') as f:
            out.update({n: f.get_tensor(n) for n in names})
    return out


def write_fp8(src: str, dst: str, config: dict | None = None, keep: tuple = KEEP
              ) -> dict[str, torch.Tensor]:
    """`src` in the released FP8 layout at `dst` (one file; quantization_config, or `config`),
    the modules in `keep` unquantized; returns the tensors a reader must end up with (the
    dequantized ones, the rest as stored)."""
    os.makedirs(dst)
    for name in os.listdir(src):
        if not name.endswith(('.safetensors', '.index.json')):
            shutil.copy(os.path.join(src, name), dst)
    with open(os.path.join(dst, 'config.json')) as f:
        cfg = json.load(f)
    cfg['quantization_config'] = config or {**QUANT, 'modules_to_not_convert': list(keep)}
    with open(os.path.join(dst, 'config.json'), 'w') as f:
        json.dump(cfg, f)
    stored, expected = {}, {}
    for name, tensor in tensors_of(src).items():
        if quantizable(name, tensor) and not any(k in name for k in keep):
            q, scale = quantize(tensor)
            stored[name], stored[name + SCALE_SUFFIX] = q, scale
            expected[name] = dequantize(q, scale)
        else:
            stored[name] = expected[name] = tensor
    save_file(stored, os.path.join(dst, 'model.safetensors'))
    return expected


def fused(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert tensors fused back into transformers' experts.gate_up_proj / down_proj."""
    out, experts = {}, {}
    for name, tensor in tensors.items():
        m = re.match(r'^(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$', name)
        if m:
            experts.setdefault(m.group(1), {})[(int(m.group(2)), m.group(3))] = tensor
        else:
            out[name] = tensor
    for base, parts in experts.items():
        n = max(e for e, _ in parts) + 1
        out[f'{base}.gate_up_proj'] = torch.stack(
            [torch.cat([parts[(e, 'gate')], parts[(e, 'up')]]) for e in range(n)])
        out[f'{base}.down_proj'] = torch.stack([parts[(e, 'down')] for e in range(n)])
    return out


def transformers_greedy(state: dict[str, torch.Tensor], prompt: list[int]) -> list[int]:
    from tests.helpers.tiny_models import make_tiny_hf_model
    model = make_tiny_hf_model(True)
    model.load_state_dict({k: v for k, v in state.items() if not k.startswith('mtp.')})
    model = model.to(torch.float64).eval()
    model.set_experts_implementation('eager')
    model.generation_config.eos_token_id = None
    out = model.generate(torch.tensor([prompt]), max_new_tokens=GREEDY.max_new_tokens,
                         do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def greedy(model_dir: str, **cfg) -> list[list[int]]:
    cfg = {'device': 'cpu', 'dtype': 'float64', 'session_len': 128, **cfg}
    with pipeline(model_dir, PytorchEngineConfig(**cfg), progress=False) as pipe:
        return [r.token_ids for r in pipe(PROMPTS, GREEDY)]


def test_block_scales_partial_edge_blocks_and_bad_scales():
    """Each 128 x 128 block (edge blocks partial, leading dims per expert) is scaled to FP8's
    largest value; dequantizing multiplies every element by its own block's scale."""
    torch.manual_seed(0)
    for shape in ((300, 200), (3, 130, 257), (64, 96)):
        weight = torch.randn(shape) * torch.rand(shape[:-2] + (1, 1)) * 5
        q, scale = quantize(weight)
        assert q.dtype == FP8 and q.shape == weight.shape
        assert scale.shape == (*shape[:-2], -(-shape[-2] // BLOCK), -(-shape[-1] // BLOCK))
        back = dequantize(q, scale)
        for i in range(scale.shape[-2]):
            for j in range(scale.shape[-1]):
                block = (..., slice(i * BLOCK, (i + 1) * BLOCK), slice(j * BLOCK, (j + 1) * BLOCK))
                assert torch.equal(scale[..., i, j], weight[block].abs().amax((-2, -1)) / FP8_MAX)
                assert torch.equal(back[block], q[block].float() * scale[..., i, j, None, None])
                # rounding: at most half FP8's step at its top (16 of 448) times the scale
                error = (back[block] - weight[block]).abs().amax((-2, -1))
                assert (error <= scale[..., i, j] * 16).all()
    with pytest.raises(ValueError, match=r"w.safetensors: tensor 'a': scales of shape \[2, 2\] "
                                         r"for a weight of shape \[64, 96\]; .* need \[1, 1\]"):
        dequantize(q, torch.ones(2, 2), "w.safetensors: tensor 'a'")


@pytest.mark.parametrize('per_expert', [False, True], ids=['fused', 'per_expert'])
def test_fp8_checkpoint_gives_transformers_greedy_on_the_dequantized_weights(
        tiny_ckpt, tmp_path, per_expert):
    src = tiny_ckpt(True, per_expert=per_expert)
    expected = write_fp8(src, str(tmp_path / 'fp8'))
    stored = tensors_of(str(tmp_path / 'fp8'))
    assert stored['model.layers.0.mlp.shared_expert.down_proj.weight'].dtype != FP8   # kept
    assert stored['model.layers.0.mlp.shared_expert.up_proj.weight'].dtype == FP8
    assert stored['lm_head.weight'].dtype != FP8 and stored['mtp.fc.weight'].dtype != FP8
    # on a device with an FP8 GEMM, exactly the linears the checkpoint stores in FP8 become so
    which = fp8_linears(str(tmp_path / 'fp8'), None)
    model = build_model(str(tmp_path / 'fp8'), torch.float64, progress=False, fuse=False)
    to_fp8(model, 'cpu', which, fp8_matmul=reference_fp8_linear, experts=True)
    fp8 = {n[:-len('_scale')] for n, _ in model.named_parameters() if n.endswith('weight_scale')}
    assert fp8 == {n for n in stored if n.startswith('model.') and stored[n].dtype == FP8
                   and 'experts.' not in n}
    assert 'model.layers.0.mlp.shared_expert.down_proj.weight' not in fp8
    experts = {n for n, p in model.named_parameters() if p.dtype == FP8 and 'experts' in n}
    assert experts == {f'model.layers.{i}.mlp.experts.{w}' for i in range(4)
                       for w in ('gate_up_proj', 'down_proj')}          # fused or per expert
    got = greedy(str(tmp_path / 'fp8'))
    want = [transformers_greedy(fused(expected), p) for p in PROMPTS]
    assert got == want


def test_online_fp8_loads_what_the_prequantized_checkpoint_holds(tiny_ckpt, tmp_path):
    """model_format='fp8' on the bf16/float32 checkpoint: every parameter equals the one loaded
    from the same weights quantized ahead (target and MTP head); and it differs from the
    unquantized model."""
    from lmdeploy_lite.pytorch.models.loader import load_mtp_state_dict
    src = tiny_ckpt(True)
    write_fp8(src, str(tmp_path / 'fp8'), keep=())
    online = build_model(src, torch.float64, model_format='fp8').state_dict()
    ahead = build_model(str(tmp_path / 'fp8'), torch.float64).state_dict()
    plain = build_model(src, torch.float64).state_dict()
    assert online.keys() == ahead.keys()
    assert all(torch.equal(online[k], ahead[k]) for k in online)
    assert not torch.equal(online['model.layers.0.mlp.experts.gate_up_proj'],
                           plain['model.layers.0.mlp.experts.gate_up_proj'])
    assert torch.equal(online['lm_head.weight'], plain['lm_head.weight'])
    from lmdeploy_lite.pytorch.models.fp8 import Fp8Weights
    assert Fp8Weights.of(str(tmp_path / 'fp8'), checkpoint_files(str(tmp_path / 'fp8')))
    # the MTP head: read through the same path as the target's weights
    mtp = {k: v for k, v in tensors_of(str(tmp_path / 'fp8')).items() if k.startswith('mtp.')}
    assert any(v.dtype == FP8 for v in mtp.values()) and mtp['mtp.fc.weight'].dtype != FP8
    assert not any(k.endswith(SCALE_SUFFIX) for k in load_mtp_state_dict(str(tmp_path / 'fp8')))


def test_mtp_k3_on_the_quantized_embedded_model_accepts_drafts_and_changes_no_token():
    cfg = PytorchEngineConfig(device='cpu', dtype='float64', model_format='fp8', session_len=256)
    gen = GenerationConfig(max_new_tokens=16, ignore_eos=True)
    batch = [list(p) for p in prompts()]
    with pipeline(EMBEDDED_MODEL_DIR, cfg, progress=False) as pipe:
        plain = [r.token_ids for r in pipe(batch, gen)]
    with pipeline(EMBEDDED_MODEL_DIR, cfg, SpeculativeConfig(num_speculative_tokens=3,
                                                             dynamic=False),
                  progress=False) as pipe:
        out = pipe(batch, gen)
    assert [r.token_ids for r in out] == plain
    assert_real_acceptance([r.spec_stats for r in out], 3)


@pytest.mark.timeout(240)
def test_tp2_and_dp2_ep2_give_the_single_process_tokens(tiny_ckpt, tmp_path):
    path = str(tmp_path / 'fp8')
    write_fp8(tiny_ckpt(True, per_expert=True), path)
    want = greedy(path)
    assert greedy(path, tp=2) == want
    assert greedy(path, dp=2, ep=2) == want


def test_a_bad_quantization_names_the_file_and_the_field_or_tensor(tiny_ckpt, tmp_path):
    src = tiny_ckpt(True)
    cases = [({**QUANT, 'quant_method': 'awq'}, r"config.json: quantization_config.quant_method="
              r"'awq': only \"fp8\""),
             ({**QUANT, 'weight_block_size': [64, 64]}, r"config.json: quantization_config."
              r"weight_block_size=\[64, 64\]: only \[128, 128\]")]
    for i, (config, message) in enumerate(cases):
        write_fp8(src, str(tmp_path / str(i)), config)
        with pytest.raises(ValueError, match=message):
            build_model(str(tmp_path / str(i)), torch.float64)
    path = str(tmp_path / 'no_scale')
    write_fp8(src, path, {**QUANT})
    stored = tensors_of(path)
    name = 'model.layers.3.self_attn.q_proj.weight'
    del stored[name + SCALE_SUFFIX]
    save_file(stored, os.path.join(path, 'model.safetensors'))
    with pytest.raises(ValueError, match=rf"model.safetensors: tensor '{re.escape(name)}' is "
                                         rf"float8_e4m3fn but the checkpoint has no "):
        build_model(path, torch.float64)


def test_a_default_block_size_and_weights_that_disagree_with_their_scales(tmp_path):
    """transformers' FineGrainedFP8Config defaults weight_block_size to [128, 128]: a config
    without it reads so. A weight with a scale but not stored in FP8 (transformers multiplies it
    by the scales, whether it holds FP8 values or dequantized ones), an FP8 tensor that is not a
    matrix and scales missing from the shard the index names are ValueErrors naming the file and
    the tensor."""
    from lmdeploy_lite.pytorch.models.loader import iter_tensors
    config = {k: v for k, v in QUANT.items() if k != 'weight_block_size'}
    (tmp_path / 'config.json').write_text(json.dumps({'quantization_config': config}))
    q, scale = quantize(torch.randn(130, 200))
    save_file({'a.weight': q, 'a.weight' + SCALE_SUFFIX: scale,
               'b.weight': torch.randn(4, 4, dtype=torch.bfloat16),
               'b.weight' + SCALE_SUFFIX: torch.ones(1, 1),
               'norm.weight': torch.ones(3).to(FP8), 'norm.weight' + SCALE_SUFFIX: torch.ones(1)},
              str(tmp_path / 'model.safetensors'))
    got = {}
    for _, name, _, load in iter_tensors(str(tmp_path), lambda n: True, progress=False):
        try:
            got[name] = load()
        except ValueError as e:
            got[name] = str(e)
    assert torch.equal(got['a.weight'], dequantize(q, scale))
    assert re.fullmatch(r".*model.safetensors: tensor 'b.weight' is torch.bfloat16 but the "
                        r"checkpoint has 'b.weight_scale_inv': .* stored as float8_e4m3fn",
                        got['b.weight'])
    assert re.fullmatch(r".*model.safetensors: tensor 'norm.weight': float8 of shape \[3\]; "
                        r"block scales need a matrix.*", got['norm.weight'])
    # sharded: the index puts a weight's scales in a shard that lacks them
    (tmp_path / 'model.safetensors').rename(tmp_path / 'a.safetensors')
    save_file({'c': torch.ones(1)}, str(tmp_path / 'b.safetensors'))
    (tmp_path / 'model.safetensors.index.json').write_text(json.dumps({'weight_map': {
        'a.weight': 'a.safetensors', 'a.weight' + SCALE_SUFFIX: 'b.safetensors'}}))
    with pytest.raises(ValueError, match=r"b.safetensors: tensor 'a.weight_scale_inv' \(the "
                                         r"scales of 'a.weight'\) cannot be read"):
        for _, name, _, load in iter_tensors(str(tmp_path), lambda n: True, progress=False):
            load()


def test_requantizing_the_dequantized_weights_gives_back_the_checkpoints_blocks():
    """What `to_fp8` relies on for a released checkpoint (read dequantized, in bf16)."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(300, 260, generator=gen) * torch.rand(300, 1, generator=gen)
    q, scale = quantize(w)
    for dtype in (torch.bfloat16, torch.float32):
        q2, scale2 = quantize(dequantize(q, scale).to(dtype))
        assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8))
        torch.testing.assert_close(scale2, scale, rtol=2 ** -8, atol=0)


def test_fused_fp8_projections_equal_their_parts():
    """FP8 parts, one whose rows are not whole blocks, and an unquantized tail: each returned
    piece is its part's own product."""
    gen = torch.Generator().manual_seed(0)
    parts = [ColumnParallelLinear(200, rows, torch.float32, 'cpu') for rows in (256, 130, 128, 3)]
    for part in parts:
        part.weight.data = torch.randn(part.weight.shape, generator=gen)
    for part in parts[:3]:
        part.to_fp8(quantize, reference_fp8_linear)
    x = torch.randn(5, 200, generator=gen)
    expected = [part(x) for part in parts]
    fused = FusedColumnLinear(parts, outputs=[1, 2, 1])
    assert len(fused.segments) == 3          # [256 | 130], [128], [3]: a break after 130 rows
    got = fused(x)
    torch.testing.assert_close(got[0], expected[0])
    torch.testing.assert_close(got[1], torch.cat(expected[1:3], -1))
    torch.testing.assert_close(got[2], expected[3])
    torch.testing.assert_close(fused.matmul(x), torch.cat(expected, -1))
    kept = FusedColumnLinear(parts, keep_parts=True, outputs=[1, 2, 1])
    assert not list(kept.parameters()) and all(p.weight_scale is not None for p in parts[:3])
    torch.testing.assert_close(kept(x)[1], got[1], rtol=0, atol=0)


def test_fp8_gemm_path_with_mtp_k3_accepts_drafts_and_changes_no_token(monkeypatch):
    """The device path on CPU: a backend with an `fp8_linear` (here the float32 reference of the
    GPU's) and FP8 experts (the reference MoE, dequantizing) gets the target's and the draft's
    linears as FP8 blocks, fused in segments, and their routed experts as FP8 (filled layer by
    layer); MTP k=3 gives the plain tokens with drafts accepted, and nearly those of the
    dequantized weights."""
    from lmdeploy_lite.pytorch.backends.default import DefaultBackend
    from lmdeploy_lite.pytorch.backends.default import moe
    cfg = PytorchEngineConfig(device='cpu', dtype='float64', model_format='fp8', session_len=256)
    gen = GenerationConfig(max_new_tokens=16, ignore_eos=True)
    batch = [list(p) for p in prompts()][:4]
    with pipeline(EMBEDDED_MODEL_DIR, cfg, progress=False) as pipe:
        dequantized = [r.token_ids for r in pipe(batch, gen)]
    weights = set()

    def fp8_linear(x, weight, scale):
        assert weight.dtype == FP8
        weights.add(weight.data_ptr())
        return reference_fp8_linear(x, weight, scale)

    def fused_moe(x, gate_up_proj, down_proj, weights, ids, gate_up_scale, down_scale):
        """The reference's FP8 path, each layer's experts dequantized once (not every call)."""
        assert gate_up_proj.dtype == down_proj.dtype == FP8
        if gate_up_proj.data_ptr() not in experts:
            experts[gate_up_proj.data_ptr()] = (
                moe.dequantize_blocks(gate_up_proj, gate_up_scale, x.dtype, sections=2),
                moe.dequantize_blocks(down_proj, down_scale, x.dtype))
        return moe.fused_moe(x, *experts[gate_up_proj.data_ptr()], weights, ids)

    experts = {}                                # gate_up_proj's address -> dequantized experts
    monkeypatch.setattr(DefaultBackend, 'fp8_linear', staticmethod(fp8_linear), raising=False)
    monkeypatch.setattr(DefaultBackend, 'fp8_experts', True, raising=False)
    monkeypatch.setattr(DefaultBackend, 'fused_moe', staticmethod(fused_moe))
    with pipeline(EMBEDDED_MODEL_DIR, cfg, progress=False) as pipe:
        plain = [r.token_ids for r in pipe(batch, gen)]
    # per layer: the mixer's fused in-projection (a gated delta net's b/a stay unquantized) and
    # out-projection, the shared expert's gate/up and down; and the routed experts
    num_layers = 8
    assert len(weights) == 4 * num_layers and len(experts) == num_layers
    with pipeline(EMBEDDED_MODEL_DIR, cfg, SpeculativeConfig(num_speculative_tokens=3,
                                                             dynamic=False),
                  progress=False) as pipe:
        weights.clear()
        experts.clear()
        out = pipe(batch, gen)
    assert len(weights) == 4 * (num_layers + 1)                # and the draft's layer
    assert len(experts) == num_layers + 1
    assert [r.token_ids for r in out] == plain
    assert_real_acceptance([r.spec_stats for r in out], 3)
    same = sum(a == b for p, d in zip(plain, dequantized) for a, b in zip(p, d))
    assert same >= 0.5 * len(batch) * gen.max_new_tokens, (plain, dequantized)


def test_the_kv_plan_charges_an_fp8_draft_at_its_size():
    """The draft's bytes in the plan: its quantizable linears and routed experts at one byte a
    weight plus a float32 scale per 128 x 128 block (gate and up apart), the rest (norms, the
    MTP fc, the router) as built."""
    from lmdeploy_lite.pytorch.config import DistConfig, ModelConfig
    from lmdeploy_lite.pytorch.distributed import DistContext
    from lmdeploy_lite.pytorch.models.qwen3_5_mtp import Qwen3_5MTP
    from lmdeploy_lite.pytorch.nn.linear import Linear
    from lmdeploy_lite.pytorch.spec_decode.build import spec_plan
    model, spec = ModelConfig.from_pretrained(EMBEDDED_MODEL_DIR), SpeculativeConfig(
        num_speculative_tokens=3)
    bf16 = spec_plan(spec, model, torch.bfloat16, DistConfig()).draft.weight_bytes
    fp8 = spec_plan(spec, model, torch.bfloat16, DistConfig(), fp8=quantizable).draft.weight_bytes
    mtp = Qwen3_5MTP(model, torch.bfloat16, 'meta', None, None, DistContext(DistConfig(), 0))
    saved = [(n * k * 2) - (n * k + -(-n // BLOCK) * -(-k // BLOCK) * 4)
             for name, sub in mtp.named_modules() if isinstance(sub, Linear)
             and quantizable(f'mtp.{name}.weight')
             for n, k in [sub.weight.shape]]
    assert len(saved) == 7             # q, k, v, o; shared gate, up, down
    experts, inter, hidden = (model.num_experts, model.moe_intermediate_size,
                              model.hidden_size)
    blocks = -(-inter // BLOCK) * -(-hidden // BLOCK)               # gate, up and down alike
    saved.append(experts * (3 * inter * hidden * (2 - 1) - 3 * blocks * 4))
    assert fp8 == bf16 - sum(saved)


@pytest.mark.parametrize('load_format', ['auto', 'dummy'])
def test_experts_filled_layer_by_layer_equal_converting_the_whole_model(
        tiny_ckpt, monkeypatch, load_format):
    """Where the backend computes FP8 experts, build_model fills and converts them one layer at
    a time (never the whole model's experts in the compute dtype): the same parameters as
    building it all and converting after. The tiny model's I = 32 is not a multiple of 128: gate
    and up are quantized apart, each its own partial block."""
    from lmdeploy_lite.pytorch.backends.default import DefaultBackend
    src = tiny_ckpt(True, per_expert=True)
    whole = build_model(src, torch.float32, progress=False, load_format=load_format,
                        model_format='fp8', fuse=False)
    assert to_fp8(whole, 'cpu', quantizable, experts=True) == 4
    monkeypatch.setattr(DefaultBackend, 'fp8_experts', True, raising=False)
    layered = build_model(src, torch.float32, progress=False, load_format=load_format,
                          model_format='fp8', fuse=False)
    want, got = whole.state_dict(), layered.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
    experts = layered.model.layers[0].mlp.experts
    assert experts.gate_up_proj.dtype == FP8 and experts.gate_up_scale.shape == (4, 2, 1)
    gate = experts.gate_up_proj.float()[:, :32] * experts.gate_up_scale[:, :1]
    assert torch.equal(gate, dequantize(*quantize(gate)))      # the gate's own blocks
