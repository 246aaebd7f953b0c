"""Structured output in the engine: a grammar matcher per constrained sequence (xgrammar) and the
token masks a step applies to the target's logits (after the penalties, before anything samples).

Exact under speculation. Position j of a verify (0-based) is masked with the grammar advanced by
the row's drafts before it, then the matcher rolls back: a draft the grammar rejects has
probability 0 under the masked target, so greedy and rejection sampling both end the accepted run
there (the positions after it keep every token: they are never reached). The matcher advances only
by the tokens a step emits (`advance`), so greedy constrained output with MTP equals greedy
constrained output without it, and sampled output keeps the masked target distribution.

Masks are filled on the host. A plain or prefill step fills them once its forward is launched
(the device is still busy); a device-drafted verify must first read its drafts, so it waits for
the forward. A constrained row never runs ahead of the host (async scheduling holds its batch:
Engine._can_continue), since its next mask needs the tokens it just emitted. Drafts are proposed
unconstrained; the target's mask decides.
"""
from __future__ import annotations

import json

import torch
from torch import Tensor

from lmdeploy_lite.reasoning import reply_in_thought
from lmdeploy_lite.structured import _xgrammar, structural_tag

class Grammars:
    """Compiles a request's response format for the model's vocabulary (xgrammar caches the
    compiled ones) and makes each of its sequences' matchers. Needs the tokenizer; xgrammar is
    imported at the first constrained request."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids):
        self.tokenizer, self.vocab_size, self.eos_ids = tokenizer, vocab_size, sorted(eos_ids)
        self._compiler = None

    def compile(self, response_format: dict, prompt_ids: list[int]):
        """The grammar of one request (its prompt says whether the reply starts in a thought);
        ValueError if it cannot be had."""
        if self.tokenizer is None:
            raise ValueError('response_format: this engine has no tokenizer to compile it with')
        xgr = _xgrammar()
        if self._compiler is None:
            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.eos_ids)
            self._compiler = xgr.GrammarCompiler(info)
        tag = structural_tag(response_format, reply_in_thought(self.tokenizer.decode, prompt_ids))
        return self._compiler.compile_structural_tag(json.dumps(tag))

    def matcher(self, compiled, stop_ids):
        """A fresh matcher for one sequence; `stop_ids`: the tokens that may end its output."""
        return _xgrammar().GrammarMatcher(compiled,
                                          override_stop_tokens=sorted(stop_ids) or self.eos_ids)


def advance(matcher, tokens: list[int]):
    """The grammar after a step's emitted tokens (none past its end: with ignore_eos the output
    goes on unconstrained)."""
    for token in tokens:
        if matcher.is_terminated() or not matcher.accept_token(token):
            return


class TokenMasks:
    """One step's masks: `matchers[b]` is row b's (None: unconstrained, or it samples nothing)."""

    def __init__(self, matchers: list):
        self.matchers = matchers

    def apply(self, logits: Tensor, drafts: Tensor | None = None) -> Tensor:
        """logits [B, V], or [B, P, V] over a verify's positions with drafts [B, P - 1] (-1: no
        draft) -> a new tensor, -inf where the grammar forbids the token."""
        xgr = _xgrammar()
        squeeze = logits.dim() == 2
        num_positions = 1 if squeeze else logits.size(1)
        bitmask = xgr.allocate_token_bitmask(logits.size(0) * num_positions, logits.size(-1))
        draft_rows = drafts.tolist() if drafts is not None else [[]] * logits.size(0)
        for b, (matcher, row) in enumerate(zip(self.matchers, draft_rows)):
            if matcher is None or matcher.is_terminated():
                continue
            advanced = 0
            for j in range(num_positions):
                if matcher.is_terminated():         # a drafted stop ended the output: free
                    break
                matcher.fill_next_token_bitmask(bitmask, b * num_positions + j)
                if j == len(row) or row[j] < 0 or not matcher.accept_token(row[j]):
                    break                           # later positions are never reached
                advanced += 1
            matcher.rollback(advanced)
        bitmask = bitmask.to(logits.device, non_blocking=True)   # unpacked there: 1/32 the bytes
        bits = torch.arange(32, dtype=torch.int32, device=logits.device)
        allowed = ((bitmask[..., None] >> bits) & 1).bool().flatten(1)[:, :logits.size(-1)]
        allowed = allowed.view(logits.shape)
        masked = logits.masked_fill(~allowed, float('-inf'))
        # min_tokens can block all the grammar allows (its stop ids, once the output is
        # complete): the grammar wins, its tokens alike (greedy: the lowest id)
        stuck = torch.isneginf(masked).all(-1, keepdim=True)
        return torch.where(stuck & allowed, 0.0, masked)
