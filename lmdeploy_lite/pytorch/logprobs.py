"""Log-probabilities of the emitted tokens, for requests that ask (GenerationConfig.logprobs).

They are the target's own: the log-softmax of its raw logits at the position that emitted each
token (before penalties, temperature, top-k and top-p: vLLM's default "raw" logprobs). Under
speculation that is the verify pass's logits at each accepted draft and at the correction or
bonus token, so a token's logprob does not depend on whether it was drafted."""
from __future__ import annotations

import torch
from torch import Tensor

from lmdeploy_lite.pytorch.sampling import probs_dtype


def token_logprobs(logits: Tensor, tokens: Tensor, num_top: int) -> tuple[Tensor, Tensor, Tensor]:
    """logits [B, n, V], tokens [B, n] long (-1 padding gives some value there) ->
    (logprobs [B, n] of the tokens, top_ids [B, n, num_top] long, top_logprobs
    [B, n, num_top], most likely first). float64 logits give float64 logprobs, others float32;
    one log-softmax and one top-k over the whole batch."""
    logprobs = torch.log_softmax(logits.to(probs_dtype(logits.dtype)), -1)
    chosen = logprobs.gather(-1, tokens.clamp(min=0)[..., None])[..., 0]
    top_logprobs, top_ids = logprobs.topk(num_top, -1)
    return chosen, top_ids, top_logprobs
