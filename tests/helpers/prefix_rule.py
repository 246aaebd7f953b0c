"""The prefix cache's hit rule, written out independently of the engine (engine/prefix_cache.py,
scheduler.py), so that a test can compute each request's Response.num_cached_tokens itself.

The rule, for requests that run to completion one after another (or one batch admitted together),
with a cache large enough that nothing is evicted:
  * a request R gets num_cached_tokens = the largest P = m * block_size with 0 < P <= len(R) - 1
    such that an earlier request E kept a state snapshot at P and R shares E's first P tokens
    (with a draft that keeps its KV in the blocks, `lookahead`: its first P + 1 tokens, since a
    block's key includes the token after it); 0 if there is none;
  * E keeps snapshots, during its prefill from its own hit h on, at
      - its prompt end point (len(E) - 1) // block_size * block_size,
      - its branch point: the end of its run of cached full blocks (those of every earlier
        request's prompt and answer: a finished request leaves its (len(prompt + answer) - 1) //
        block_size full blocks), when that is beyond h,
      - the block-aligned ends of its prefill chunks before its last token: chunks of at most
        `chunk` tokens (max_prefill_token_num) from h on, a chunk also ending at each of the
        two points above.
A batch's requests are each looked up against what was cached before the batch (`batch` checks
that their peers' snapshots could not give them more, whatever order the steps ran them in). With
dp > 1 the rule holds per rank; it is the same as one cache's when each request is routed to the
rank holding its prefix.
"""
from __future__ import annotations


class PrefixRule:

    def __init__(self, block_size: int, lookahead: bool = False, chunk: int | None = None):
        self.block_size = block_size
        self.extra = 1 if lookahead else 0
        self.chunk = chunk
        self.blocks: set[tuple[int, ...]] = set()       # a cached block, by the tokens naming it
        self.snapshots: set[tuple[int, ...]] = set()    # the same, for a block ending at a snapshot

    def _name(self, tokens: list[int], end: int) -> tuple[int, ...]:
        """The block ending at token `end` is named by all tokens before it (plus the next)."""
        return tuple(tokens[:end + self.extra])

    def lookup(self, prompt: list[int]) -> tuple[int, int]:
        """(hit, matched) in tokens: the longest cached prefix ending at a snapshot, and the run
        of cached full blocks from the start; at least one token left to compute."""
        hit = matched = 0
        for end in range(self.block_size, len(prompt), self.block_size):
            name = self._name(prompt, end)
            if name not in self.blocks:
                break
            matched = end
            if name in self.snapshots:
                hit = end
        return hit, matched

    def _prefill(self, prompt: list[int], hit: int, matched: int, chunk: int | None = None):
        bs = self.block_size
        chunk = chunk or self.chunk or len(prompt)
        points = sorted(p for p in {matched, (len(prompt) - 1) // bs * bs} if p > hit)
        start = hit
        while start < len(prompt):
            end = min(len(prompt), start + chunk)
            end = min([end] + [p for p in points if p > start])
            if end % bs == 0 and end < len(prompt):
                self.snapshots.add(self._name(prompt, end))
                self.blocks.update(self._name(prompt, e) for e in range(bs, end + 1, bs))
            start = end

    def _finish(self, tokens: list[int]):
        bs = self.block_size
        full = (len(tokens) - 1) // bs
        self.blocks.update(self._name(tokens, e) for e in range(bs, full * bs + 1, bs))

    def run(self, prompt: list[int], answer: list[int]) -> int:
        """One request from admission to its end; returns its num_cached_tokens."""
        return self.batch([prompt], [answer])[0]

    def batch(self, prompts: list[list[int]], answers: list[list[int]]) -> list[int]:
        """Requests admitted in one step (all looked up before any of them ran); returns their
        num_cached_tokens. Asserts that no request's hit could depend on how its peers' prefills
        were chunked and ordered: a snapshot at any block boundary of a peer's prefill would give
        it no more (so the answer is the rule's alone, even where a batch's chunks share the
        token budget and a request is admitted a step after its peers)."""
        before = self._copy()
        found = [self.lookup(p) for p in prompts]
        for prompt, (hit, matched) in zip(prompts, found):
            self._prefill(prompt, hit, matched)
        for prompt, answer in zip(prompts, answers):
            self._finish(list(prompt) + list(answer))
        for i, (prompt, (hit, _)) in enumerate(zip(prompts, found)):
            peers = before._copy()
            for j, (other, (other_hit, other_matched)) in enumerate(zip(prompts, found)):
                if j != i:
                    peers._prefill(other, other_hit, other_matched, chunk=self.block_size)
            assert peers.lookup(prompt)[0] == hit, (
                f'ambiguous batch: a peer leaves request {i} a snapshot past {hit}')
        return [hit for hit, _ in found]

    def _copy(self) -> 'PrefixRule':
        other = PrefixRule(self.block_size, bool(self.extra), self.chunk)
        other.blocks, other.snapshots = set(self.blocks), set(self.snapshots)
        return other
