"""transformers as the reference implementation in tests."""
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
