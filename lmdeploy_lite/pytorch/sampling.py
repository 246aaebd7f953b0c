"""Token sampling: greedy, temperature, top-k, top-p, min-p, with one RNG per request.

Reproducibility: a seeded request owns one `torch.Generator` for its whole life, and every random
draw for its row comes from it only, a fixed amount per step (V exponentials per sampled token,
plus k uniforms per verify step in the rejection sampler): a seed gives the same output whatever
else is in the batch. Penalties, logit_bias (bad_token_ids: -inf) and min_tokens
(`apply_penalties`) change the target's raw logits first, greedy rows included; a batch without
any carries `penalties=None` and pays nothing."""
from __future__ import annotations

from collections.abc import Sequence
import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from lmdeploy_lite.messages import GREEDY_TEMPERATURE, GREEDY_TOP_P, INT32_MAX
from lmdeploy_lite.pytorch.backends import get_backend
from lmdeploy_lite.pytorch.grammar import TokenMasks


def make_generator(seed: int | None, device: torch.device | str = 'cpu') -> torch.Generator | None:
    return None if seed is None else torch.Generator(device=device).manual_seed(seed)


@dataclass
class Penalties:
    """The penalties of a batch of B rows (tensors on the logits' device; a row without one has
    repetition 1.0, presence and frequency 0.0 and no ids).
    repetition, presence, frequency [B] float; prompt_ids [2, N] long: (row, token id) of every
    prompt token of the rows with a repetition penalty; output_ids [2, M] long: (row, token id)
    of every token the rows with a penalty generated so far (repeats included: they count).
    The host builds them each step from the sequences' tokens, so a step with a penalised row
    needs the tokens of the step before it (Engine._can_continue)."""
    repetition: Tensor
    presence: Tensor
    frequency: Tensor
    prompt_ids: Tensor
    output_ids: Tensor
    any_repetition: bool = True            # host-side: some row's repetition penalty is not 1
    any_additive: bool = True              # host-side: some row's presence or frequency is not 0
    # logit_bias: (row, token id) [2, N] long and the values [N]; None: no row has one
    bias_ids: Tensor | None = None
    bias_values: Tensor | None = None
    # min_tokens: (row, stop id) [2, S] long of rows still short of it, and each row's count of
    # positions (from the step's first) whose stop ids are blocked [B] long; None: none
    stop_ids: Tensor | None = None
    stop_blocked: Tensor | None = None

    @classmethod
    def from_values(cls, repetition: Sequence[float], presence: Sequence[float],
                    frequency: Sequence[float], prompt_ids: Sequence[Sequence[int]],
                    output_ids: Sequence[Sequence[int]], device: torch.device | str = 'cpu'
                    ) -> Penalties:
        """Per-row values (as GenerationConfig validated them) and token ids (prompt_ids[b] is
        only read where repetition[b] != 1)."""
        if len({len(repetition), len(presence), len(frequency), len(prompt_ids),
                len(output_ids)}) > 1:
            raise ValueError('Penalties.from_values: all per-row lists must have one entry per row')
        batch = len(repetition)
        prompt_ids = [ids if r != 1.0 else () for r, ids in zip(repetition, prompt_ids)]
        rows = [b for b, ids in enumerate(prompt_ids) for _ in ids]
        rows += [b for b, ids in enumerate(output_ids) for _ in ids]
        ids = [t for row in prompt_ids for t in row] + [t for row in output_ids for t in row]
        values = [float(v) for v in (*repetition, *presence, *frequency)]
        # one host-to-device copy each for the ids and the values (pinned on a GPU)
        packed_ids = to_device(torch.tensor([rows, ids], dtype=torch.long).view(2, -1), device)
        packed_values = to_device(torch.tensor(values, dtype=torch.float64), device)
        num_prompt = len(rows) - sum(len(o) for o in output_ids)
        return cls(*packed_values.view(3, batch), prompt_ids=packed_ids[:, :num_prompt],
                   output_ids=packed_ids[:, num_prompt:],
                   any_repetition=any(r != 1.0 for r in repetition),
                   any_additive=any(v != 0.0 for v in (*presence, *frequency)))

    def with_bias_and_min_tokens(self, logit_bias: Sequence[dict | None],
                                 blocked: Sequence[int], stop_ids: Sequence[Sequence[int]],
                                 device: torch.device | str = 'cpu') -> Penalties:
        """These penalties plus each row's logit_bias ({token id: value}, None) and min_tokens:
        `blocked[b]` positions from the step's first (min_tokens - tokens generated) where the
        row's `stop_ids` cannot be emitted."""
        bias = [(b, t, v) for b, row in enumerate(logit_bias) for t, v in (row or {}).items()]
        stops = [(b, t) for b, ids in enumerate(stop_ids) if blocked[b] > 0 for t in ids]
        changes = {}
        if bias:
            rows, ids, values = zip(*bias)
            changes.update(bias_ids=to_device(torch.tensor([rows, ids]), device),
                           bias_values=to_device(torch.tensor(values, dtype=torch.float64),
                                                  device))
        if stops:
            changes.update(stop_ids=to_device(torch.tensor(stops).T.contiguous(), device),
                           stop_blocked=to_device(torch.tensor(list(blocked)), device))
        return dataclasses.replace(self, **changes)


def to_device(tensor: Tensor, device: torch.device | str) -> Tensor:
    """A fresh host tensor to `device`; to a GPU through pinned memory without blocking (the
    caching host allocator keeps the pinned block until the copy has run)."""
    if torch.device(device).type == 'cuda':
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def apply_penalties(logits: Tensor, penalties: Penalties, drafts: Tensor | None = None) -> Tensor:
    """Penalised logits (a new tensor of probs_dtype).
    logits [B, V], or [B, P, V] over the P = k + 1 positions of a verify; drafts [B, k] long
    (with [B, P, V]): position j counts drafts[:, :j] as generated tokens too (the tokens it
    follows when it is reached), -1 placeholders count nothing. Repetition first (x * p where
    x < 0, else x / p, for every token of the prompt or the output), then
    x -= frequency * count + presence * (count > 0) over the output's counts, as vLLM does.
    Every position is penalised by the [B, V] counts of the tokens before the step; then the
    entries of the drafted tokens (at most k per position) are recomputed from the raw logits
    with the drafts before each position added, so no [B, P, V] count table is made."""
    squeeze = logits.dim() == 2
    raw = logits.to(probs_dtype(logits.dtype))
    if squeeze:
        raw = raw[:, None]
    out = _penalised(raw, penalties, drafts)
    _bias_and_min_tokens(out, penalties)
    return out[:, 0] if squeeze else out


def _bias_and_min_tokens(logits: Tensor, penalties: Penalties):
    """logits [B, P, V] in place: += each row's logit_bias, then -inf at the stop ids of the
    positions that min_tokens blocks (position j is the step's (j + 1)-th token)."""
    if penalties.bias_ids is not None:
        rows, ids = penalties.bias_ids
        logits[rows, :, ids] += penalties.bias_values.to(logits.dtype)[:, None]
    if penalties.stop_ids is not None:
        rows, ids = penalties.stop_ids
        positions = torch.arange(logits.size(1), device=logits.device)
        blocked = positions < penalties.stop_blocked[rows, None]              # [S, P]
        logits[rows, :, ids] = logits[rows, :, ids].masked_fill(blocked, float('-inf'))


def _penalised(raw: Tensor, penalties: Penalties, drafts: Tensor | None) -> Tensor:
    """`apply_penalties` before logit_bias and min_tokens: raw [B, P, V] -> a new tensor."""
    if not (penalties.any_repetition or penalties.any_additive):
        return raw.clone()                   # every row neutral: still a new tensor
    batch, num_positions, vocab_size = raw.shape
    counts = raw.new_zeros(batch, vocab_size)                      # output tokens per row
    rows, ids = penalties.output_ids
    counts.index_put_((rows, ids), torch.ones_like(ids, dtype=counts.dtype), accumulate=True)
    seen = counts > 0                                              # prompt or output
    seen[penalties.prompt_ids[0], penalties.prompt_ids[1]] = True
    out = _penalise(raw, counts[:, None], seen[:, None], penalties)
    if drafts is None or drafts.shape[1] == 0:
        return out
    # token t = drafts[:, i] at position j: its count gains the drafts before j equal to t
    # (every (j, i) pair is recomputed, so entries of one token written twice agree)
    k, device = drafts.shape[1], raw.device
    tokens = drafts.clamp(min=0)                                   # placeholders: token 0
    same = (tokens[:, :, None] == tokens[:, None, :]) & (drafts[:, None, :] >= 0)   # [B, i, i']
    before = torch.arange(k, device=device) < torch.arange(num_positions, device=device)[:, None]
    extra = (same[:, None] & before[None, :, None, :]).sum(-1).to(raw.dtype)         # [B, P, k]
    index = tokens[:, None].expand(-1, num_positions, -1)                            # [B, P, k]
    draft_counts = counts.gather(-1, tokens)[:, None] + extra
    draft_seen = seen.gather(-1, tokens)[:, None] | (draft_counts > 0)
    values = _penalise(raw.gather(-1, index), draft_counts, draft_seen, penalties)
    return out.scatter_(-1, index, values)


def _penalise(logits: Tensor, counts: Tensor, seen: Tensor, penalties: Penalties) -> Tensor:
    """The penalty rule elementwise: logits [B, P, N]; counts (float) and seen (bool)
    broadcastable to it."""
    shape = (logits.size(0), 1, 1)
    if penalties.any_repetition:
        repetition = penalties.repetition.to(logits.dtype).view(shape)
        penalised = torch.where(logits < 0, logits * repetition, logits / repetition)
        logits = torch.where(seen, penalised, logits)
    if penalties.any_additive:
        frequency = penalties.frequency.to(logits.dtype).view(shape)
        presence = penalties.presence.to(logits.dtype).view(shape)
        logits = logits - frequency * counts - presence * (counts > 0).to(logits.dtype)
    return logits


@dataclass
class SamplingInputs:
    """Per-row sampling parameters of a batch of B sequences (tensors on the logits' device).
    do_sample [B] bool, temperature [B] float, top_k [B] long (0 = off), top_p [B] float (1.0 =
    off), generators: B entries, None = default RNG. The bool flags are host-side summaries that
    let the sampler skip work without a device sync.
    `penalties`: None when no row has one (greedy fast paths, CUDA graphs that end in an argmax
    and the cached greedy tables all need None).
    `logprobs`: the top-N logprobs the step computes for its emitted tokens (the batch's
    largest request's N; None: no row asks, nothing is computed)."""
    do_sample: Tensor
    temperature: Tensor
    top_k: Tensor
    top_p: Tensor
    generators: list[torch.Generator | None]
    all_greedy: bool
    needs_filter: bool                     # any sampled row with top-k or top-p on
    penalties: Penalties | None = None
    logprobs: int | None = None
    min_p: Tensor | None = None            # [B] float; None: no sampled row has one
    masks: TokenMasks | None = None        # grammar.py: the constrained rows' token masks

    @classmethod
    def from_values(cls, do_sample: Sequence[bool], temperature: Sequence[float],
                    top_k: Sequence[int], top_p: Sequence[float],
                    generators: Sequence[torch.Generator | None] | None = None,
                    seeds: Sequence[int | None] | None = None,
                    device: torch.device | str = 'cpu') -> SamplingInputs:
        """Build from per-request plain values (as GenerationConfig validated them: finite,
        top_k in 0..INT32_MAX). A row with temperature < GREEDY_TEMPERATURE or top_p <
        GREEDY_TOP_P is greedy (messages.py says why). top_k past the vocabulary keeps every
        token, as 0 does. Pass the engine's long-lived per-request `generators`; `seeds` (fresh
        generators) is for one-off calls and tests."""
        if generators is None:
            generators = [make_generator(s, device) for s in (seeds or [None] * len(do_sample))]
        if len({len(do_sample), len(temperature), len(top_k), len(top_p), len(generators)}) > 1:
            raise ValueError('SamplingInputs.from_values: all per-request lists must have one '
                             'entry per row')
        top_k = [min(int(k), INT32_MAX) for k in top_k]          # exact in the float64 packing
        top_p = [float(p) for p in top_p]
        # a finite temperature stays finite in float32 (logits / inf would make -inf logits nan)
        temperature = [min(float(t), torch.finfo(torch.float32).max) for t in temperature]
        do_sample = [bool(s) and t >= GREEDY_TEMPERATURE and p >= GREEDY_TOP_P
                     for s, t, p in zip(do_sample, temperature, top_p)]
        # one host-to-device copy, split there
        packed = to_device(torch.tensor([do_sample, temperature, top_k, top_p],
                                         dtype=torch.float64).reshape(4, -1), device)
        return cls(packed[0].bool(), packed[1].float(), packed[2].long(), packed[3].float(),
                   list(generators), all_greedy=not any(do_sample),
                   needs_filter=any(s and (k > 0 or p < 1.0)
                                    for s, k, p in zip(do_sample, top_k, top_p)))

    @classmethod
    def greedy(cls, batch_size: int, device: torch.device | str = 'cpu') -> SamplingInputs:
        return cls.from_values([False] * batch_size, [0.0] * batch_size, [0] * batch_size,
                               [1.0] * batch_size, device=device)


class SamplingTables:
    """A step's SamplingInputs from its rows' configs: cached for all-greedy batches (one per
    size) and a dummy forward's one greedy row, built for the others."""

    def __init__(self, device: torch.device, stop_ids=lambda seq: ()):
        self.device, self.stop_ids = device, stop_ids         # stop_ids(seq): min_tokens blocks
        self.idle = SamplingInputs.greedy(1, device)
        self._greedy: dict[int, SamplingInputs] = {}

    def for_batch(self, batch) -> SamplingInputs:
        """Rows of a prefill chunk that does not reach the sequence's end sample nothing, so
        they draw nothing from the request's generator: a seed's stream does not depend on how
        the prompt was chunked. Penalised rows that sample add their penalties and token ids
        (the host's). With the logprobs the step computes when some row asks for them: the
        largest request's top-N, once for the whole batch. No batch: the dummy forward's."""
        if batch is None:
            return self.idle
        seqs, mask = batch.seqs, batch.sample_mask
        cfgs = [s.gen_config for s in seqs]
        if all(c.is_greedy for c in cfgs):
            if len(cfgs) not in self._greedy:
                self._greedy[len(cfgs)] = SamplingInputs.greedy(len(cfgs), self.device)
            sampling = self._greedy[len(cfgs)]
        else:
            sampling = SamplingInputs.from_values(
                do_sample=[not c.is_greedy and m for c, m in zip(cfgs, mask)],
                temperature=[c.temperature for c in cfgs], top_k=[c.top_k for c in cfgs],
                top_p=[c.top_p for c in cfgs],
                generators=[s.generator if m else None for s, m in zip(seqs, mask)],
                device=self.device)
        changes = {}
        penalised = [c.has_penalties and m for c, m in zip(cfgs, mask)]
        if any(penalised):
            neutral = (1.0, 0.0, 0.0, (), (), None, 0, ())          # a row without any
            rows = [(c.repetition_penalty, c.presence_penalty, c.frequency_penalty,
                     s.token_ids[:s.num_prompt], s.token_ids[s.num_prompt:], _bias(c),
                     c.min_tokens - s.num_generated, self.stop_ids(s) if c.min_tokens else ())
                    if p else neutral for c, s, p in zip(cfgs, seqs, penalised)]
            *values, bias, blocked, stop_ids = zip(*rows)
            changes['penalties'] = Penalties.from_values(
                *values, device=self.device).with_bias_and_min_tokens(
                bias, blocked, stop_ids, self.device)
        matchers = [s.grammar if m else None for s, m in zip(seqs, mask)]
        if any(g is not None for g in matchers):
            changes['masks'] = TokenMasks(matchers)
        if any(c.min_p > 0 and m and not c.is_greedy for c, m in zip(cfgs, mask)):
            changes['min_p'] = to_device(torch.tensor([c.min_p for c in cfgs]), self.device)
        asked = [c.logprobs for c in cfgs if c.logprobs is not None]
        if asked:
            changes['logprobs'] = max(asked)
        return dataclasses.replace(sampling, **changes) if changes else sampling   # cached: kept


def _bias(cfg) -> dict[int, float] | None:
    """A config's logit_bias, with -inf at its bad_token_ids (never emitted)."""
    if not cfg.bad_token_ids:
        return cfg.logit_bias
    return {**(cfg.logit_bias or {}), **dict.fromkeys(cfg.bad_token_ids, float('-inf'))}


def _filter_top_k_top_p(logits: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """Set logits outside each row's top-k, then outside its top-p nucleus, to -inf.
    logits [B, ..., V]; top_k, top_p [B, 1, ..., 1]. top-k keeps exactly k tokens (ties broken by
    lower token id); top-p keeps the smallest prefix (by descending probability) whose mass
    reaches top_p, and always the most likely token."""
    vocab_size = logits.size(-1)
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab_size, device=logits.device)
    k = torch.where(top_k > 0, top_k, vocab_size)
    sorted_logits = sorted_logits.masked_fill(rank >= k, float('-inf'))
    sorted_probs = sorted_logits.softmax(-1)
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    drop = (mass_before >= top_p) & (top_p < 1.0)            # top_p == 1.0: off, even with fp error
    sorted_logits = sorted_logits.masked_fill(drop, float('-inf'))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def probs_dtype(logits_dtype: torch.dtype) -> torch.dtype:
    """The dtype of `probs_from_logits`' result for logits of `logits_dtype`."""
    return torch.float64 if logits_dtype == torch.float64 else torch.float32


def probs_from_logits(logits: Tensor, sampling: SamplingInputs) -> Tensor:
    """The distribution each row samples from: logits [B, ..., V] -> probs [B, ..., V]
    (probs_dtype). Sampled rows: softmax of logits / temperature after top-k then top-p
    filtering (renormalised). Greedy rows: one-hot of argmax (first max on ties)."""
    shape = (logits.size(0),) + (1,) * (logits.dim() - 1)       # [B, 1, ..., 1]: per row
    logits = logits.to(probs_dtype(logits.dtype))
    temperature = torch.where(sampling.do_sample, sampling.temperature, 1.0).to(logits.dtype)
    scaled = logits / temperature.view(shape)
    if sampling.needs_filter:
        scaled = _filter_top_k_top_p(scaled, sampling.top_k.view(shape), sampling.top_p.view(shape))
    if sampling.min_p is not None:        # p < min_p * p_max, as logits: below max + log(min_p)
        floor = scaled.amax(-1, keepdim=True) + sampling.min_p.to(scaled.dtype).log().view(shape)
        scaled = scaled.masked_fill(scaled < floor, float('-inf'))
    probs = scaled.softmax(-1)
    one_hot = torch.nn.functional.one_hot(logits.argmax(-1), logits.size(-1)).to(probs.dtype)
    return torch.where(sampling.do_sample.view(shape), probs, one_hot)


def random_like_rows(shape: Sequence[int], generators: Sequence[torch.Generator | None],
                     kind: str, dtype: torch.dtype = torch.float32,
                     device: torch.device | str = 'cpu') -> Tensor:
    """Random tensor [B, ...]: row b drawn only from generators[b] (default RNG where None);
    kind: 'uniform' ([0, 1)) or 'exponential' (rate 1)."""
    out = torch.empty(tuple(shape), dtype=dtype, device=device)
    if any(g is None for g in generators):
        getattr(out, kind + '_')()
    for row, generator in enumerate(generators):
        if generator is not None:
            getattr(out[row], kind + '_')(generator=generator)
    return out


def draw_from_probs(probs: Tensor, generators: Sequence[torch.Generator | None]) -> Tensor:
    """One token per row from probs [B, V] (rows need not be normalised) -> tokens [B] long.
    Exponential race: argmax_v probs[v] / E_v with E_v ~ Exp(1) picks v with probability
    probs[v] / sum(probs); zero-probability tokens are never picked (unless a row is all zero)."""
    noise = random_like_rows(probs.shape, generators, 'exponential', probs.dtype, probs.device)
    noise.clamp_(min=torch.finfo(probs.dtype).tiny)            # exponential_ may return exactly 0
    return (probs / noise).argmax(-1)


def sample(logits: Tensor, sampling: SamplingInputs) -> Tensor:
    """logits [B, V] -> tokens [B] long, after the penalties (if any). Greedy rows: the first
    maximum (the backend's `argmax`); sampled rows: a draw from probs_from_logits with the
    row's generator."""
    if sampling.penalties is not None:
        logits = apply_penalties(logits, sampling.penalties)
    if sampling.masks is not None:
        logits = sampling.masks.apply(logits)
    greedy_tokens = get_backend(logits.device).argmax(logits)
    if sampling.all_greedy:
        return greedy_tokens
    sampled_tokens = draw_from_probs(probs_from_logits(logits, sampling), sampling.generators)
    return torch.where(sampling.do_sample, sampled_tokens, greedy_tokens)
