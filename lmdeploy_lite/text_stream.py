"""What a request's outputs become on the way to its caller: text (incremental detokenization,
stop words held back), the backlog of a consumer (and its delivery on an event loop: the
server's), logprobs entries; and the checks of a prompt."""
from __future__ import annotations

import asyncio
import collections

from lmdeploy_lite.messages import GenerationConfig, TokenLogprobs, is_int, short_repr
from lmdeploy_lite.pytorch.engine.executor.client import Channel
from lmdeploy_lite.reasoning import held_back

MESSAGE_ROLES = ('system', 'user', 'assistant', 'tool')
POLL_S = 1.0               # how often a wait for results checks that the engine still runs


class TextStream:
    """The text of one request's output, built as its tokens arrive: while it runs, a short
    window of tokens per step (a prefix and a read offset, as in vLLM and lmdeploy); when it
    finishes, the whole output once, so the final text is exactly `tokenizer.decode(token_ids)`
    (less a stop token id it ended on: `final_ids`) cut before the first stop word that ends
    past `floor`. Text that may still become a stop word, or is an incomplete UTF-8 sequence,
    is held back until it cannot."""

    __slots__ = ('gen_config', 'stream', 'token_ids', 'text', 'sent', 'prefix', 'read', 'floor')

    def __init__(self, gen_config: GenerationConfig, stream: bool):
        self.gen_config = gen_config
        self.stream = stream              # False: no text until the end (the caller reads it then)
        self.token_ids: list[int] = []
        self.text = ''                    # decoded so far (append-only)
        self.sent = 0                     # characters handed out
        self.prefix = self.read = 0       # token offsets of the decode window
        # the text length of the first min_tokens - 1 tokens, where no stop word may end (as
        # the engine's stop checks); None until that many tokens came
        self.floor = 0 if gen_config.min_tokens <= 1 or not gen_config.stop_words else None

    def delta(self, finished: bool) -> str:
        """The text not handed out yet that can be: before the first stop word, and (while
        running) short of a suffix that may still grow into one."""
        text, words = self.text, self.gen_config.stop_words
        if words:               # cut before the first stop word (none ends in the text sent)
            start = max(0, self.sent - max(map(len, words)))
            keep = self.gen_config.include_stop_str_in_output       # cut after it instead
            cuts = [] if self.floor is None else [
                i + len(w) * keep for w in words
                if (i := text.find(w, max(start, self.floor - len(w) + 1))) >= 0]
            text = text[:min(cuts, default=len(text))]
            if not finished:
                text = text[:len(text) - held_back(text, words)]
        out = text[self.sent:]
        self.sent = max(self.sent, len(text))
        return out

    def final_ids(self) -> list[int]:
        """The ids of the final text: less a stop token id that ended the output (lmdeploy and
        vLLM leave its text out) unless include_stop_str_in_output."""
        cfg, ids = self.gen_config, self.token_ids
        stop = ids and ids[-1] in (cfg.stop_token_ids or ()) and not cfg.include_stop_str_in_output
        return ids[:-1] if stop else ids


def batch_decoder(tokenizer):
    """A function (lists of token ids, skip_special_tokens) -> their texts, equal to
    `tokenizer.decode` of each: the Rust tokenizer's own decode, one call per window, where
    transformers adds nothing to it (no clean-up of tokenization spaces, which it never applies
    to BPE; ~10x faster), else transformers' batch_decode."""
    backend = getattr(tokenizer, 'backend_tokenizer', None)
    cleans = getattr(tokenizer, 'clean_up_tokenization_spaces', False)
    if backend is not None and (not cleans or type(backend.model).__name__ == 'BPE'):
        decode = backend.decode
        return lambda batch, skip: [decode(ids, skip_special_tokens=skip) for ids in batch]
    return lambda batch, skip: tokenizer.batch_decode(batch, skip_special_tokens=skip)


def detokenize(decode, updates: list[tuple[TextStream, list[int], bool]]) -> list[str]:
    """Add each update's new token ids (and whether the request finished) to its stream; returns
    each stream's new text, from one batched `decode` (`batch_decoder`; None: no tokenizer)
    per skip_special_tokens setting."""
    for s, ids, _ in updates:
        s.token_ids += ids
    if decode is None:
        return [''] * len(updates)
    for s, _, _ in updates:
        early = s.gen_config.min_tokens - 1
        if s.floor is None and len(s.token_ids) >= early:
            s.floor = len(decode([s.token_ids[:early]], s.gen_config.skip_special_tokens)[0])
    windows: dict[bool, list] = {}          # skip_special_tokens -> [(update index, ...)]
    for i, (s, ids, finished) in enumerate(updates):
        if finished or (s.stream and ids):
            windows.setdefault(s.gen_config.skip_special_tokens, []).append(i)
    for skip, indices in windows.items():
        batch = []
        for i in indices:                    # a window: the tokens already text, then all of them
            s, _, finished = updates[i]
            batch += ([s.final_ids()] if finished else
                      [s.token_ids[s.prefix:s.read], s.token_ids[s.prefix:]])
        texts = iter(decode(batch, skip))
        for i in indices:
            s, _, finished = updates[i]
            if finished:                     # the whole output once: exactly decode()'s text
                s.text = next(texts)
                continue
            before, after = next(texts), next(texts)   # new text: once no character is cut
            if len(after) > len(before) and not after.endswith('\ufffd'):
                s.text += after[len(before):]
                s.prefix, s.read = s.read, len(s.token_ids)
    return [s.delta(finished) if s.stream or finished else '' for s, _, finished in updates]


def token_logprobs(token_ids: list[int], logprobs: list[tuple] | None) -> list[TokenLogprobs]:
    """StepOutput.logprobs (one (logprob, top ids, top logprobs) per token) as TokenLogprobs."""
    return [TokenLogprobs(t, chosen, dict(zip(ids, values)))
            for t, (chosen, ids, values) in zip(token_ids, logprobs or ())]


class Backlog:
    """What a request's consumer has not taken yet, merged as it arrives: the last StepOutput,
    the text, token ids and logprobs of every step since (a slow consumer takes the steps it
    missed as one response)."""
    __slots__ = ('last', 'text', 'token_ids', 'logprobs')

    def __init__(self, out, text: str):
        self.last, self.text = out, text
        self.token_ids, self.logprobs = list(out.new_token_ids), list(out.logprobs or ())

    def add(self, out, text: str):
        self.last = out
        self.text += text
        self.token_ids += out.new_token_ids
        self.logprobs += out.logprobs or ()


class _AsyncFanout:
    """The async front-end of one event loop (the server): the engine thread posts a step's
    results once; on the loop they are detokenized in bulk and added to each request's backlog.
    While calls wait, every POLL_S it looks whether the engine has stopped (`stopped()`: the
    reason, else None) and ends their waits: one timer for the loop, none per wait."""

    def __init__(self, loop: asyncio.AbstractEventLoop, decode, stopped):
        self.decode, self.loop, self.stopped = decode, loop, stopped
        self.calls: set[_News] = set()             # of the generate_ids calls running
        self.watch: asyncio.TimerHandle | None = None
        # posted from the engine's thread:
        self.channel = Channel(lambda items: loop.call_soon_threadsafe(self._dispatch, items))

    def _dispatch(self, items: list):              # the event loop's thread
        updates, requests = [], []
        for request, item in items:
            if isinstance(item, BaseException):
                request.put(item)
            else:
                updates.append((request.text, item.new_token_ids, item.finished))
                requests.append((request, item))
        try:
            deltas = detokenize(self.decode, updates)
        except Exception as e:                     # their text is lost: these requests end
            for request, _ in requests:
                request.put(e)
            return
        for (request, item), delta in zip(requests, deltas):
            request.put((item, delta))

    def begin(self, news: '_News'):
        self.calls.add(news)
        if self.watch is None:
            self.watch = self.loop.call_later(POLL_S, self._watch)

    def _watch(self):
        error = self.stopped()
        if error is not None:
            for news in self.calls:
                news.fail(RuntimeError(f'the engine stopped: {error}'))
        self.watch = self.loop.call_later(POLL_S, self._watch) if self.calls else None


class _News:
    """Which choices of one `generate_ids` call have something to take, in the order they got
    it, and the future its consumer awaits for the next: set by the loop's dispatch, one per
    wait (no queue, no timer: the fanout watches the engine for every call at once)."""
    __slots__ = ('ready', 'waiter', 'error')

    def __init__(self):
        self.ready: collections.deque[int] = collections.deque()
        self.waiter: asyncio.Future | None = None
        self.error: BaseException | None = None     # the engine stopped

    def put(self, index: int):
        self.ready.append(index)
        self._wake()

    def fail(self, error: BaseException):
        self.error = error
        self._wake()

    def _wake(self):
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def get(self) -> int:
        """The index of the next choice with something to take."""
        while not self.ready:
            if self.error is not None:
                raise self.error
            self.waiter = asyncio.get_running_loop().create_future()
            await self.waiter
        return self.ready.popleft()


class _AsyncRequest:
    """One choice of a `generate_ids` call: its text and what its consumer has not taken yet
    (one Backlog, and an error that came after it); `news` (shared by the call's choices) learns
    the index of a choice once it has something to take, not once per step."""
    __slots__ = ('text', 'index', 'news', 'backlog', 'error')

    def __init__(self, gen_config: GenerationConfig, stream_text: bool, index: int,
                 news: _News):
        self.text, self.index, self.news = TextStream(gen_config, stream_text), index, news
        self.backlog: Backlog | None = None
        self.error: BaseException | None = None

    def put(self, item):
        idle = self.backlog is None and self.error is None
        if isinstance(item, BaseException):
            self.error = item
        elif self.backlog is None:
            self.backlog = Backlog(*item)
        else:
            self.backlog.add(*item)
        if idle:
            self.news.put(self.index)

    def take(self) -> tuple[Backlog | None, BaseException | None]:
        taken = self.backlog, self.error
        self.backlog = self.error = None
        return taken


def as_batch(prompts) -> tuple[bool, list]:
    """(single, the prompts as a list): a str, a list of token ids or a list of messages is one
    prompt; a list or tuple of those is a batch; anything else one prompt `encode` rejects."""
    if isinstance(prompts, (list, tuple)) and (not prompts or isinstance(prompts[0], (str, list,
                                                                                      tuple))):
        return False, list(prompts)
    return True, [prompts]


def lmdeploy_prompts(prompts: list, do_preprocess: bool | None = None,
                     adapter_name: str | None = None, use_tqdm: bool = False) -> list:
    """The prompts under lmdeploy's pipeline arguments: `do_preprocess=True` sends a str through
    the chat template as a user message (None, the default here, and False: a str is plain
    text; chat messages always go through the template); `adapter_name` (LoRA) only None;
    `use_tqdm` accepted (no progress bar: it changes no output)."""
    if adapter_name is not None:
        raise ValueError(f'adapter_name={short_repr(adapter_name)}: LoRA adapters are not '
                         f'supported; only None')
    if not isinstance(use_tqdm, bool) or do_preprocess not in (None, True, False):
        raise ValueError(f'use_tqdm={short_repr(use_tqdm)}, do_preprocess='
                         f'{short_repr(do_preprocess)}: must be bools (do_preprocess: or None)')
    if not do_preprocess:
        return prompts
    return [[{'role': 'user', 'content': p}] if isinstance(p, str) else p for p in prompts]


def per_prompt_configs(gen_config, num_prompts: int) -> list:
    """Each prompt's GenerationConfig: `gen_config` for all (None: the defaults), or, as lmdeploy
    takes it, a list with one per prompt (all with the same n, so that choice i of prompt p is
    Response.index p * n + i)."""
    if not isinstance(gen_config, (list, tuple)):
        return [GenerationConfig() if gen_config is None else gen_config] * num_prompts
    if len(gen_config) != num_prompts:
        raise ValueError(f'gen_config: a list of {len(gen_config)} configs for {num_prompts} '
                         f'prompts; give one GenerationConfig, or one per prompt')
    configs = [GenerationConfig() if c is None else c for c in gen_config]
    counts = [getattr(c, 'n', 1) for c in configs]
    bad = next((i for i, n in enumerate(counts) if n != counts[0]), None)
    if bad is not None:
        raise ValueError(f'gen_config[{bad}].n={counts[bad]}: every prompt of a batch needs the '
                         f'same n (gen_config[0].n={counts[0]})')
    return configs


def check_prompt(prompt):
    """The prompt, or ValueError naming what is wrong with one that is not token ids. A chat
    message's content may be OpenAI's list of text parts (`[{'type': 'text', 'text': ...}]`):
    joined into one string, as the server joins them."""
    if isinstance(prompt, str):
        _check_text('prompt', prompt)
        return prompt
    if not isinstance(prompt, list):
        raise ValueError(f'prompt: {type(prompt).__name__} is not a str, a list of token ids '
                         f'or a list of chat messages')
    if not prompt:
        raise ValueError('prompt: empty; give at least one token')
    if not isinstance(prompt[0], dict):
        bad = next(i for i, t in enumerate(prompt) if not is_int(t))
        raise ValueError(f'prompt[{bad}]={short_repr(prompt[bad])}: token ids must be ints '
                         f'(a prompt is a str, a list of token ids or a list of chat messages)')
    return [_check_message(i, message) for i, message in enumerate(prompt)]


def _check_message(i: int, message) -> dict:
    if not isinstance(message, dict):
        raise ValueError(f'prompt[{i}]={short_repr(message)}: a chat message is a dict '
                         f"with 'role' and 'content'")
    role, content = message.get('role'), message.get('content')
    if role not in MESSAGE_ROLES:
        raise ValueError(f'prompt[{i}].role={short_repr(role)}: must be one of {MESSAGE_ROLES}')
    calls = message.get('tool_calls')
    if calls is not None and (role != 'assistant' or not isinstance(calls, list)
                              or not all(isinstance(c, dict) for c in calls)):
        raise ValueError(f'prompt[{i}].tool_calls={short_repr(calls)}: a list of dicts, '
                         f'in assistant messages only')
    if isinstance(content, list):
        content = ''.join(_part_text(f'prompt[{i}].content[{j}]', part)
                          for j, part in enumerate(content))
        message = {**message, 'content': content}
    if not isinstance(content, str) and not (content is None and calls):
        raise ValueError(f'prompt[{i}].content={short_repr(content)}: must be a str or a list '
                         f"of text parts ({{'type': 'text', 'text': ...}})")
    if content is not None:
        _check_text(f'prompt[{i}].content', content)
    return message


def _part_text(name: str, part) -> str:
    if not isinstance(part, dict) or part.get('type') != 'text' or not isinstance(
            part.get('text'), str):
        raise ValueError(f"{name}={short_repr(part)}: a content part here is {{'type': 'text', "
                         f"'text': str}} (this engine's models read text only)")
    return part['text']


def check_tools(tools):
    """ValueError naming what is wrong with a tools list (the template reads the rest)."""
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise ValueError(f'tools={short_repr(tools)}: must be a list of dicts (function schemas)')


# apply_chat_template's own arguments: a template variable must not change the call itself
TEMPLATE_CALL_ARGS = frozenset((
    'conversation', 'messages', 'tools', 'documents', 'chat_template', 'add_generation_prompt',
    'continue_final_message', 'tokenize', 'padding', 'truncation', 'max_length',
    'return_tensors', 'return_dict', 'return_assistant_tokens_mask', 'tokenizer_kwargs'))


def check_template_kwargs(kwargs) -> dict:
    """`chat_template_kwargs` as template variables ({} for None), or a ValueError naming it."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise ValueError(f'chat_template_kwargs={short_repr(kwargs)}: must be an object of '
                         f'template variables, e.g. {{"enable_thinking": false}}')
    if TEMPLATE_CALL_ARGS & kwargs.keys():
        raise ValueError(f'chat_template_kwargs: {sorted(TEMPLATE_CALL_ARGS & kwargs.keys())} '
                         f'are set from the request itself, not template variables')
    return kwargs


def _check_text(name: str, text: str):
    """A str holding a lone surrogate cannot be tokenized (or sent anywhere as UTF-8)."""
    try:
        text.encode('utf-8')
    except UnicodeEncodeError as e:
        raise ValueError(f'{name}: not valid unicode text ({e.reason} at position {e.start})'
                         ) from None
