"""Thinking models' replies split into reasoning and answer (`--reasoning-parser qwen3`).

Qwen3 and Qwen3.5 think inside `<think>...</think>`. Their chat templates open the block in the
prompt when thinking (`<|im_start|>assistant\\n<think>\\n`) and write a closed, empty one when not
(`<think>\\n\\n</think>\\n\\n`), so the reply may carry no opening tag: where it starts is read from
the rendered prompt (`starts_in_thought`), not guessed from the reply. (vLLM's qwen3 parser takes a
reply with no tags for reasoning, and so returns a non-thinking answer as reasoning: vllm#53284.)
A reply that opens its own block (a template that adds nothing) is handled too; where the prompt
opened one already, a `<think>` the reply starts with is dropped (as vLLM does); where it closed
one at its end (thinking off), the reply is all answer, a `<think>` in it too (as vLLM).

Qwen3.5 sometimes writes a tool call inside its thought without closing it first: a `<tool_call>`
before any `</think>` ends the thought as `</think>` would, and opens the answer, where the tool
parser reads it (vLLM's qwen3 parser does the same: vllm#35687); a `</think>` after it is answer
text."""
from __future__ import annotations

OPEN, CLOSE = '<think>', '</think>'
TOOL_CALL = '<tool_call>'         # Qwen3.5's call block (serve/openai/tool_parser.py)
PARSERS = ('auto', 'qwen3', 'none')


THOUGHT_TAIL = 32          # prompt tokens read to know whether the reply starts in a thought


def starts_in_thought(prompt_text: str) -> bool:
    """The reply starts inside a think block: the prompt opened one it did not close."""
    return prompt_text.rfind(OPEN) > prompt_text.rfind(CLOSE)


def starts_answered(prompt_text: str) -> bool:
    """The prompt ends with a closed think block (Qwen3.5 not thinking): the reply is all
    answer, even where it begins with `<think>` (as vLLM, which then parses nothing)."""
    end = prompt_text.rfind(CLOSE)
    return end > prompt_text.rfind(OPEN) and not prompt_text[end + len(CLOSE):].strip()


def reply_parser(decode, prompt_ids: list[int]) -> ReasoningParser:
    """The parser of the reply to a prompt given as token ids (`decode`: ids -> text), from the
    prompt's tail as `reply_in_thought` reads it."""
    tail = decode(prompt_ids[-THOUGHT_TAIL:])
    return ReasoningParser(starts_in_thought(tail), starts_answered(tail))


def reply_in_thought(decode, prompt_ids: list[int]) -> bool:
    """`starts_in_thought` of a prompt given as token ids (`decode`: ids -> text), from its tail:
    what the reasoning parser and the structured-output grammar both go by."""
    return starts_in_thought(decode(prompt_ids[-THOUGHT_TAIL:]))


def template_thinks(template: str | None) -> bool:
    """`--reasoning-parser auto`: a chat template that writes think blocks."""
    return bool(template) and OPEN in template


def held_back(text: str, words) -> int:
    """How many trailing characters of `text` could begin one of `words` (held until the next
    text shows whether they do)."""
    for n in range(min(max(map(len, words)) - 1, len(text)), 0, -1):
        if any(len(w) > n and w.startswith(text[-n:]) for w in words):
            return n
    return 0


def _first(text: str, words) -> int:
    """Where the first of `words` starts in `text` (-1: none does)."""
    found = [i for i in (text.find(w) for w in words) if i >= 0]
    return min(found, default=-1)


class ReasoningParser:
    """Feed a reply's text as it comes; get (reasoning, content) deltas. Text that could be the
    start of a tag is held back until the next feed (or `final`). The newlines that follow
    `</think>` belong to neither. A reply cut inside its thought is reasoning only; a
    `<tool_call>` in the thought ends it and begins the content."""

    def __init__(self, in_thought: bool, answered: bool = False):
        """`in_thought`: the prompt opened a block; `answered`: it closed one at its end."""
        self.state = 'answer' if answered else 'start'   # start: may open a block
        self.in_thought = in_thought     # where the reply starts if it does not
        self.pending = ''
        self.after_close = False

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        self.pending += text
        reasoning = content = ''
        if self.state == 'start':
            head = self.pending.lstrip()
            if head.startswith(OPEN):
                self.state, self.pending = 'thought', head[len(OPEN):]
            elif not final and (head == '' or OPEN.startswith(head)):
                return '', ''                               # may still open a block
            else:
                self.state = 'thought' if self.in_thought else 'answer'
        if self.state == 'thought':
            end = _first(self.pending, (CLOSE, TOOL_CALL))
            if end < 0:
                keep = 0 if final else held_back(self.pending, (CLOSE, TOOL_CALL))
                reasoning = self.pending[:len(self.pending) - keep]
                self.pending = self.pending[len(self.pending) - keep:]
                return reasoning, ''
            closed = self.pending.startswith(CLOSE, end)     # else a call opens the answer
            reasoning = self.pending[:end]
            self.pending = self.pending[end + len(CLOSE) if closed else end:]
            self.state, self.after_close = 'answer', closed
        content, self.pending = self.pending, ''
        if self.after_close:
            content = content.lstrip('\n')
            self.after_close = not content
        return reasoning, content
