"""transformers as the reference implementation in tests."""
import contextlib
import functools

import torch


@functools.lru_cache(maxsize=None)
def hf_generate(moe: bool, prompt: tuple[int, ...], max_new_tokens: int) -> list[int]:
    """Greedy tokens of transformers' `generate` in float64 for the tiny model of that kind
    (tests/helpers/tiny_models, seed 0), EOS disabled."""
    from tests.helpers.tiny_models import make_tiny_hf_model
    model = make_tiny_hf_model(moe).to(torch.float64).eval()
    if moe:
        model.set_experts_implementation('eager')          # grouped_mm has no float64 kernel
    model.generation_config.eos_token_id = None
    out = model.generate(torch.tensor([list(prompt)]), max_new_tokens=max_new_tokens,
                         do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


class _Float64Torch:
    """`torch` as a transformers modeling module sees it inside `float64_transformers`: its
    float32 is float64 (the module's own casts to float32 then keep float64)."""
    float32 = float = torch.float64

    def __getattr__(self, name):
        return getattr(torch, name)


@functools.lru_cache(maxsize=None)
def _float64_model(moe: bool):
    """The tiny reference model of that kind in float64, its rotary frequencies too."""
    from tests.helpers.tiny_models import make_tiny_hf_model
    model = make_tiny_hf_model(moe).to(torch.float64).eval()
    if moe:
        model.set_experts_implementation('eager')          # grouped_mm has no float64 kernel
    rotary = model.model.rotary_emb
    base = rotary.config.rope_parameters['rope_theta']
    dim = rotary.inv_freq.numel() * 2
    rotary.inv_freq = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    return model


def hf_hidden_states(moe: bool, token_ids: list[int], layer_ids: tuple[int, ...]) -> torch.Tensor:
    """transformers' `output_hidden_states` at `layer_ids` of the tiny model of that kind
    (tests/helpers/tiny_models, seed 0) for one sequence: [T, len(layer_ids), H], computed in
    float64 throughout. transformers computes some parts in float32 whatever the model's dtype
    (rotary angles, norms, the gated delta rule, softmax): here its modules see a `torch`
    whose float32 is float64, and `Tensor.float()` keeps float64."""
    with _float64_transformers(moe) as model:
        states = model(torch.tensor([list(token_ids)]), output_hidden_states=True).hidden_states
    return torch.stack([states[i][0] for i in layer_ids], dim=1)


def hf_log_softmax(moe: bool, token_ids: list[int]) -> torch.Tensor:
    """torch.log_softmax of transformers' logits [T, V] of the tiny model of that kind for one
    sequence, computed in float64 throughout (as `hf_hidden_states`)."""
    with _float64_transformers(moe) as model:
        logits = model(torch.tensor([list(token_ids)])).logits[0]
    assert logits.dtype == torch.float64
    return torch.log_softmax(logits, -1)


@contextlib.contextmanager
def _float64_transformers(moe: bool):
    """`_float64_model(moe)`, its modeling module seeing a `torch` whose float32 is float64
    (`_Float64Torch`) and `Tensor.float()` keeping float64; no grad."""
    from unittest import mock

    from transformers.models.qwen3_5 import modeling_qwen3_5
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe
    module = modeling_qwen3_5_moe if moe else modeling_qwen3_5
    with mock.patch.object(module, 'torch', _Float64Torch()), \
            mock.patch.object(torch.Tensor, 'float', lambda self, *a, **k: self.double()), \
            torch.no_grad():
        yield _float64_model(moe)
