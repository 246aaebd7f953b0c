"""Response.logprobs (TokenLogprobs per generated token) in the OpenAI wire formats: chat's
`{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}` and the completions' legacy
`{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`.

A token's string is the tokenizer's decoding of that token alone (special tokens spelled out; a
piece of a multi-byte character decodes to U+FFFD); its `bytes` are the token's own bytes where the
tokenizer is byte-level BPE (Qwen's: a piece of a character included), else the string's UTF-8
bytes. Without a tokenizer (a model served on token ids) a token's string is `token_id:<id>`."""
from __future__ import annotations

import codecs
import functools
import json
import math

from lmdeploy_lite.messages import TokenLogprobs


class TokenStrings:
    """The string and bytes of single tokens of one tokenizer (cached per token id)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.special_ids = frozenset(getattr(tokenizer, 'all_special_ids', ()) or ())
        self.text, self.bytes = functools.cache(self._text), functools.cache(self._bytes)
        self.json_head = functools.cache(self._json_head)
        backend = getattr(tokenizer, 'backend_tokenizer', None)
        self._byte_of = None                # byte-level BPE: the alphabet's char -> byte
        if backend is not None and type(backend.decoder).__name__ == 'ByteLevel':
            from transformers.convert_slow_tokenizer import bytes_to_unicode
            self._byte_of = {char: byte for byte, char in bytes_to_unicode().items()}
            self._added = frozenset(getattr(tokenizer, 'added_tokens_decoder', {}) or {})

    def _text(self, token_id: int) -> str:
        return (f'token_id:{token_id}' if self.tokenizer is None
                else self.tokenizer.decode([token_id], skip_special_tokens=False))

    def _bytes(self, token_id: int) -> bytes:
        if self._byte_of is not None and token_id not in self._added:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            if piece and all(c in self._byte_of for c in piece):
                return bytes(self._byte_of[c] for c in piece)
        return self.text(token_id).encode('utf-8')

    def _json_head(self, token_id: int) -> str:
        """`{"token":...,"bytes":[...],"logprob":` of this token, as JSON text."""
        return (f'{{"token":{json.dumps(self.text(token_id), ensure_ascii=False)},'
                f'"bytes":{json.dumps(list(self.bytes(token_id)))},"logprob":')


def chat_logprobs_json(strings: TokenStrings, entries: list[TokenLogprobs]) -> str:
    """Chat's `{"content": [...]}` of `entries` (one per generated token, each with its top-N),
    as JSON text written directly: a whole response's logprobs (n choices x tokens x top-N)
    would be that many objects built in Python while the engine thread and the event loop wait
    for the GIL; this is a string join over cached per-token text."""
    head = strings.json_head
    content = [f'{head(e.token_id)}{_number(e.logprob)},"top_logprobs":['
               + ','.join(f'{head(t)}{_number(lp)}}}' for t, lp in e.top_logprobs.items())
               + ']}' for e in entries]
    return '{"content":[' + ','.join(content) + ']}'


def _number(x: float) -> str:
    return repr(x) if math.isfinite(x) else 'null'      # JSON has no -inf


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


class CompletionLogprobs:
    """The legacy completions format for one request, chunk after chunk: `text_offset` counts
    characters from the start of the completion, so it carries on across a stream's chunks:
    each token's bytes go through one incremental UTF-8 decoder (a token that ends inside a
    character adds nothing until the character is complete; a special token adds nothing when
    the request skips them)."""

    def __init__(self, strings: TokenStrings, skip_special_tokens: bool):
        self.strings, self.skip_special_tokens, self.offset = strings, skip_special_tokens, 0
        self.decoder = codecs.getincrementaldecoder('utf-8')('replace')

    def add(self, entries: list[TokenLogprobs]) -> dict:
        """These entries (the next tokens of the completion) in the legacy format; the top
        dicts hold the top-N and the chosen token, most likely first (-inf: null, as JSON has
        no infinity)."""
        strings, offsets, top = self.strings, [], []
        for entry in entries:
            offsets.append(self.offset)
            if not (self.skip_special_tokens and entry.token_id in strings.special_ids):
                self.offset += len(self.decoder.decode(strings.bytes(entry.token_id)))
            tops = {}                   # two ids may share a string: the likelier one's
            for token_id, logprob in sorted(entry.items(), key=lambda item: -item[1]):
                tops.setdefault(strings.text(token_id), _finite(logprob))
            top.append(tops)
        return {'tokens': [strings.text(e.token_id) for e in entries],
                'token_logprobs': [_finite(e.logprob) for e in entries], 'top_logprobs': top,
                'text_offset': offsets}
