"""`pipeline()`: the Python entry point. Batch, streaming and async generation over one engine."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import re
from typing import AsyncIterator, Iterator, Sequence as Seq

from lmdeploy_lite.messages import (GenerationConfig, PytorchEngineConfig, Response,
                                    SpeculativeConfig, is_int)
from lmdeploy_lite.pytorch.engine.executor import connect
from lmdeploy_lite.pytorch.engine.executor.client import Channel, EngineStats
from lmdeploy_lite.pytorch.engine.executor.rank_worker import uses_cuda
from lmdeploy_lite.reasoning import PARSERS, ReasoningParser, reply_parser, template_thinks
from lmdeploy_lite.text_stream import (POLL_S, Backlog, TextStream, _AsyncFanout, _AsyncRequest,
                                       _News, as_batch, batch_decoder, check_prompt,
                                       check_template_kwargs, check_tools, detokenize,
                                       lmdeploy_prompts, per_prompt_configs, token_logprobs)
from lmdeploy_lite.tokenizer import load_tokenizer

Prompt = str | list[int] | list[dict]
GenConfigs = GenerationConfig | list[GenerationConfig] | None    # one for all, or one per prompt
EMBEDDED_MODEL_DIR = os.path.join(os.path.dirname(__file__), 'assets', 'qwen3_5_moe_tiny')
REPO_ID = re.compile(r'^[\w.-]+/[\w.-]+$')          # 'Qwen/Qwen3.5-0.8B'
MODEL_FILES = ['*.json', '*.safetensors', '*.jinja', '*.model', '*.txt', '*.tiktoken']
_CORE_LEFT = []            # use_cpu_threads has left this process's core to the front-end


def use_cpu_threads(device: str, num_threads: int | None = None):
    """torch's CPU threads for this process (mp ranks split them): `num_threads`; else, on CPU
    with OMP_NUM_THREADS unset, all but one core, once per process: the core left serves the
    front-end, whose wake-ups each step otherwise stall the engine's parallel regions
    (BENCHMARKS.md)."""
    import torch
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    elif (not _CORE_LEFT and 'OMP_NUM_THREADS' not in os.environ
          and torch.get_num_threads() >= 2 and not uses_cuda(device)):
        torch.set_num_threads(torch.get_num_threads() - 1)
        _CORE_LEFT.append(True)


def resolve_model_path(model_path: str | None, revision: str | None = None,
                       download_dir: str | None = None) -> str:
    """None: the embedded default model shipped inside the package; a directory: itself; a
    Hugging Face repo id that names no path: its snapshot through huggingface_hub (the cache
    in `download_dir`, default the hub's, first; downloaded at `revision` when missing, unless
    HF_HUB_OFFLINE=1, when a miss is a ValueError naming the id and the cache)."""
    if model_path is not None and (os.path.exists(model_path) or not REPO_ID.match(model_path)):
        return model_path             # a path (ModelConfig names what is missing in it)
    if model_path is not None:        # a repo id
        from huggingface_hub import constants, snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
        try:
            return snapshot_download(model_path, revision=revision, cache_dir=download_dir,
                                     allow_patterns=MODEL_FILES)
        except LocalEntryNotFoundError:
            raise ValueError(f'model_path={model_path!r}: not a directory, and the Hugging Face '
                             f'repo {model_path} is not in the cache at '
                             f'{download_dir or constants.HF_HUB_CACHE} (offline: '
                             f'HF_HUB_OFFLINE=1, or the hub is unreachable)') from None
    if not os.path.isfile(os.path.join(EMBEDDED_MODEL_DIR, 'config.json')):
        raise ValueError(f'model_path=None: the embedded model is missing at {EMBEDDED_MODEL_DIR}; '
                         f'pass a model directory')
    return EMBEDDED_MODEL_DIR


class Pipeline:

    def __init__(self, model_path: str | None = None,
                 backend_config: PytorchEngineConfig | None = None,
                 speculative_config: SpeculativeConfig | None = None, progress: bool = True,
                 engine_process: bool = False, reasoning_parser: str | None = None,
                 chat_template: str | None = None, num_threads: int | None = None,
                 engine_client=None):
        """`engine_process`: run a one-rank engine in a process of its own (an mp rank), not in
        a thread of this one (the server's default: its event loop's streaming would hold the
        GIL the engine's thread needs between steps). `reasoning_parser` ('qwen3'; 'auto': when
        the chat template thinks; None or 'none': off): a chat reply's `<think>` block goes to
        Response.reasoning_content.
        `chat_template`: a Jinja template (a file, or the template itself) instead of the
        model's. `num_threads`: torch's CPU threads (None: `use_cpu_threads`).
        `engine_client`: an EngineClient already connected to a running engine (the server's
        front-end workers: executor/relay.py), used instead of starting one."""
        if reasoning_parser not in PARSERS + (None,):
            raise ValueError(f'reasoning_parser={reasoning_parser!r}: must be one of '
                             f'{PARSERS} or None')
        backend_config = backend_config or PytorchEngineConfig()
        use_cpu_threads(backend_config.device, num_threads)
        self.model_path = resolve_model_path(model_path, backend_config.revision,
                                             backend_config.download_dir)
        self._name = model_path if self.model_path != model_path and model_path else None
        self.tokenizer = load_tokenizer(self.model_path) if os.path.isdir(self.model_path) else None
        if chat_template is not None:
            if self.tokenizer is None:
                raise ValueError(f'chat_template: {self.model_path} has no tokenizer to use it')
            if os.path.isfile(chat_template):
                with open(chat_template) as f:
                    chat_template = f.read()
            self.tokenizer.chat_template = chat_template
        self.reasoning = reasoning_parser == 'qwen3' or (
            reasoning_parser == 'auto' and self.tokenizer is not None
            and template_thinks(getattr(self.tokenizer, 'chat_template', None)))
        self._decode = batch_decoder(self.tokenizer) if self.tokenizer is not None else None
        self._client = engine_client or connect(self.model_path, backend_config,
                                                speculative_config, self.tokenizer, progress,
                                                engine_process)
        self._closed = False
        self._fanouts: dict[asyncio.AbstractEventLoop, _AsyncFanout] = {}
        # sequences the engine runs at once (each DP rank's batch: the KV cache is sized for it)
        self.capacity = backend_config.dp * backend_config.max_batch_size

    @property
    def model_name(self) -> str:
        """The repo id the model came by, else its directory's name (clients never see paths)."""
        return self._name or os.path.basename(os.path.normpath(self.model_path))

    @property
    def engine(self):
        """The engine if it runs in a thread of this process (tests look inside it), else None."""
        return getattr(self._client, 'engine', None)

    @property
    def engine_client(self):
        """The EngineClient this pipeline drives (executor/client.py)."""
        return self._client

    @property
    def error(self) -> BaseException | None:
        """Why the engine stopped for good, or None while it runs."""
        return self._client.error

    def stalled(self, limit_s: float) -> str | None:
        """One line naming the rank (or the engine thread) that has shown no progress for over
        `limit_s` seconds while requests are pending, else None (ray keeps no heartbeat)."""
        return self._client.stalled(limit_s)

    @property
    def session_len(self) -> int:
        """The most tokens a sequence holds (prompt and output)."""
        return self._client.session_len

    @property
    def vocab_size(self) -> int:
        return self._client.model_config.vocab_size

    def validate_request(self, token_ids: list[int], gen_config: GenerationConfig):
        """Raise ValueError naming the field when the engine would refuse this request."""
        self._client.validate_request(token_ids, gen_config)

    def stats(self) -> EngineStats:
        """Engine-wide figures (client.EngineStats), over every DP rank as last reported."""
        return self._client.stats()

    # ---- prompts --------------------------------------------------------------------------
    def encode(self, prompt: Prompt, tools: list[dict] | None = None,
               chat_template_kwargs: dict | None = None) -> list[int]:
        """str: plain text; list of ints: token ids; list of {'role','content'}: chat template
        (an assistant message may carry 'tool_calls', a 'tool' message answers one). `tools`:
        function schemas ({'type': 'function', 'function': {'name', 'description',
        'parameters'}}) that the chat template shows the model; chat messages only, and only
        with a template that renders them. `chat_template_kwargs`: more variables for the
        template (`{'enable_thinking': False}`). Anything else is a ValueError naming the
        prompt (or the message, tools, chat_template_kwargs) and what is wrong."""
        kwargs = check_template_kwargs(chat_template_kwargs)
        chat = isinstance(prompt, list) and prompt and isinstance(prompt[0], dict)
        for name, given in (('tools', tools), ('chat_template_kwargs', kwargs)):
            if given and not chat:
                raise ValueError(f'{name}: given with a prompt that is not chat messages; it '
                                 f'reaches the model through the chat template')
        if isinstance(prompt, list) and prompt and set(map(type, prompt)) == {int}:
            return list(prompt)         # plain ints, checked at C speed (an 8k prompt: ~0.1 ms)
        if isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt):
            return [int(t) for t in prompt]
        prompt = check_prompt(prompt)
        if self.tokenizer is None:
            raise ValueError(f'prompt: {type(prompt).__name__} given, but {self.model_name} has no '
                             f'tokenizer; pass token ids (a list of int)')
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        if tools is not None:
            check_tools(tools)
        self._check_template_renders(prompt, tools)
        from jinja2 import TemplateError
        try:
            return self.tokenizer.apply_chat_template(prompt, tools=tools or None,
                                                      add_generation_prompt=True,
                                                      tokenize=True, return_dict=False, **kwargs)
        except TemplateError as e:          # the template's own checks (raise_exception)
            raise ValueError(f'prompt: the chat template rejects these messages: {e}') from None

    def reasoning_parser(self, prompt_ids: list[int]) -> ReasoningParser:
        """A parser for the reply to this (rendered chat) prompt."""
        return reply_parser(self.tokenizer.decode, prompt_ids)

    def _check_template_renders(self, messages: list[dict], tools: list[dict] | None):
        """A template that never looks at tools or tool_calls would drop them without a word."""
        calls = any(m.get('tool_calls') for m in messages)
        if not (tools or calls):
            return
        template = self.tokenizer.get_chat_template(None, tools or None)
        if tools and 'tools' not in template:
            raise ValueError(f'tools: the chat template of {self.model_name} does not render '
                             f'tools, so the model would never see them')
        if calls and 'tool_calls' not in template:
            raise ValueError(f'prompt: the chat template of {self.model_name} does not render '
                             f"an assistant message's tool_calls")

    # ---- batch and streaming --------------------------------------------------------------
    def __call__(self, prompts: Prompt | Seq[Prompt], gen_config: GenConfigs = None,
                 tools: list[dict] | None = None, chat_template_kwargs: dict | None = None,
                 **lmdeploy_kwargs) -> Response | list[Response]:
        """`gen_config`: one for every prompt, or a list of one per prompt (the same n; as
        lmdeploy). A request that fails in the engine comes back with finish_reason 'error' and the
        reason in Response.error (the other prompts are unaffected); a stopped or closed engine
        raises RuntimeError. `tools`, `chat_template_kwargs`: for every prompt, see `encode`.
        With gen_config.n > 1: every prompt's n choices, flattened (Response.index =
        prompt_index * n + i), a list even for a single prompt. lmdeploy's `do_preprocess`,
        `adapter_name`, `use_tqdm`: see `lmdeploy_prompts`."""
        single, batch = as_batch(prompts)
        batch = lmdeploy_prompts(batch, **lmdeploy_kwargs)
        final = {r.index: r for r in self._stream(batch, gen_config, True, tools,
                                                  chat_template_kwargs)}
        n = per_prompt_configs(gen_config, len(batch))[0].n
        responses = [final[i] for i in range(len(batch) * n)]
        return responses[0] if single and n == 1 else responses

    def stream_infer(self, prompts: Prompt | Seq[Prompt], gen_config: GenConfigs = None,
                     tools: list[dict] | None = None, chat_template_kwargs: dict | None = None,
                     **lmdeploy_kwargs) -> Iterator[Response]:
        """Yields incremental responses (this chunk's text and token ids), each with its index
        (with gen_config.n > 1: prompt_index * n + i); a failed request's last chunk has
        finish_reason 'error' (see __call__)."""
        batch = lmdeploy_prompts(as_batch(prompts)[1], **lmdeploy_kwargs)
        yield from self._stream(batch, gen_config, False, tools, chat_template_kwargs)

    def _stream(self, prompts: list[Prompt], gen_config, cumulative: bool,
                tools: list[dict] | None = None, chat_template_kwargs: dict | None = None
                ) -> Iterator[Response]:
        """All requests share one Channel: one inbox message per engine step, whatever the
        batch; their text is decoded in bulk (while they run only when streamed)."""
        self._check_open()
        configs = per_prompt_configs(gen_config, len(prompts))
        token_lists = [self.encode(p, tools, chat_template_kwargs) for p in prompts]
        inbox: queue.Queue = queue.Queue()
        handles = self._submit(token_lists, configs, Channel(inbox.put))
        n = configs[0].n
        streams = [TextStream(configs[i // n], stream=not cumulative)
                   for i in range(len(handles))]
        thoughts = [self.reasoning_parser(token_lists[i // n]) if self.reasoning and
                    isinstance(prompts[i // n], list) and isinstance(prompts[i // n][0], dict)
                    else None for i in range(len(handles))]
        remaining = len(handles)
        backlogs: list[Backlog | None] = [None] * len(handles)     # cumulative: all so far
        try:
            while remaining:
                items = self._next(inbox)
                for _, item in items:
                    if isinstance(item, BaseException):
                        raise item
                deltas = detokenize(self._decode, [(streams[i], item.new_token_ids, item.finished)
                                                   for i, item in items])
                for (i, item), delta in zip(items, deltas):     # cumulative: text at the end only
                    remaining -= item.finished
                    if cumulative and backlogs[i] is not None:
                        backlogs[i].add(item, delta)
                    else:
                        backlogs[i] = Backlog(item, delta)
                    if cumulative and not item.finished:
                        continue
                    r = self._response(i, backlogs[i], token_lists[i // n], configs[i // n])
                    if thoughts[i] is not None:
                        r.reasoning_content, r.text = thoughts[i].feed(r.text, item.finished)
                    yield r
        finally:
            self._abort_unfinished(handles)

    def _submit(self, prompts: list[list[int]], gen_config: GenerationConfig, channel: Channel,
                tag_of=lambda index: index, request_id: str | None = None) -> list:
        """Every prompt's n choices (the client validates all, gen_config too, before any is
        submitted); choice `index` (= prompt_index * n + i) tagged `tag_of(index)`, its
        hidden-states file named `request_id` (None: a random name), of several choices
        `request_id-index`. Their handles, in index order."""
        config = gen_config[0] if isinstance(gen_config, list) and gen_config else gen_config
        n = getattr(config, 'n', 1)               # a bad gen_config: the client names it
        total = len(prompts) * n
        names = [request_id if request_id is None or total == 1 else f'{request_id}-{index}'
                 for index in range(total)]
        groups = self._client.submit_groups(
            prompts, gen_config, channel, [[tag_of(i) for i in range(p * n, (p + 1) * n)]
                                           for p in range(len(prompts))],
            [names[p * n:(p + 1) * n] for p in range(len(prompts))])
        return [h for group in groups for h in group]

    def _abort_unfinished(self, handles: list):
        for h in handles:
            if not h.finished:
                self._client.abort(h)

    def _next(self, inbox: queue.Queue):
        """The next result; never waits forever on an engine that has stopped."""
        while True:
            try:
                return inbox.get(timeout=POLL_S)
            except queue.Empty:
                if self._client.error is not None:
                    raise RuntimeError(f'the engine stopped: {self._client.error}') from None

    def _check_open(self):
        if self._closed:
            raise RuntimeError('the pipeline is closed')

    @staticmethod
    def _response(index: int, backlog: Backlog, prompt_ids: list[int],
                  gen_config: GenerationConfig) -> Response:
        """What a consumer has not taken yet (a step's output, or several merged), as one."""
        out, ids = backlog.last, backlog.token_ids
        # Response's first fields by position, the rest set: by keyword, its fields cost twice
        # as much (~1 us more a chunk)
        r = Response(backlog.text, ids, len(prompt_ids), out.num_generated,
                     out.finish_reason if out.finished else None, index, out.spec_stats)
        for name in out.RESPONSE_FIELDS:
            setattr(r, name, getattr(out, name))
        if gen_config.logprobs is not None:
            r.logprobs = token_logprobs(ids, backlog.logprobs)
        return r

    # ---- async (the server) ---------------------------------------------------------------
    async def generate(self, prompt: Prompt, gen_config: GenerationConfig | None = None,
                       stream_text: bool = True, tools: list[dict] | None = None,
                       request_id: str | None = None) -> AsyncIterator[Response]:
        """Async stream of one request (`generate_ids` of its token ids); errors as in `__call__`.
        `stream_text=False`: the chunks carry token ids only and the last one the whole text (a
        caller that joins the text at the end saves the incremental decoding)."""
        self._check_open()
        gen_config = GenerationConfig() if gen_config is None else gen_config
        ids = self.encode(prompt, tools)
        async with contextlib.aclosing(self.generate_ids([ids], gen_config, stream_text,
                                                         request_id)) as responses:
            async for r in responses:           # closing this generator closes that one now
                yield r

    async def generate_ids(self, prompts: list[list[int]], gen_config: GenerationConfig,
                           stream_text: bool = True, request_id: str | None = None
                           ) -> AsyncIterator[Response]:
        """Prompts given as token ids, each with gen_config.n choices: the responses of all of
        them as they come, Response.index = prompt_index * n + i. Cancelling the consumer aborts
        every choice that has not finished. `request_id`: see `_submit` (unique)."""
        self._check_open()
        loop = asyncio.get_running_loop()
        fanout = self._fanouts.get(loop)
        if fanout is None:
            if len(self._fanouts) > 8:                # loops that ended (tests, asyncio.run)
                self._fanouts = {lp: f for lp, f in self._fanouts.items() if not lp.is_closed()}
            fanout = self._fanouts[loop] = _AsyncFanout(loop, self._decode,
                                                        lambda: self._client.error)
        news = _News()
        handles = self._submit(prompts, gen_config, fanout.channel, lambda index: _AsyncRequest(
            gen_config, stream_text, index, news), request_id)
        n, requests = gen_config.n, [h.tag for h in handles]
        unfinished = set(range(len(requests)))
        fanout.begin(news)
        try:
            while unfinished:
                request = requests[await news.get()]
                backlog, error = request.take()
                if backlog is not None:
                    if backlog.last.finished:
                        unfinished.discard(request.index)
                    yield self._response(request.index, backlog, prompts[request.index // n],
                                         gen_config)
                if error is not None:
                    raise error
        finally:
            fanout.calls.discard(news)
            self._abort_unfinished(handles)

    # ---- lifetime -------------------------------------------------------------------------
    def close(self):
        """Stops the engine; requests still running end with RuntimeError, later calls raise
        RuntimeError('the pipeline is closed'). Idempotent."""
        if not self._closed:
            self._closed = True
            self._client.close()

    def __enter__(self) -> 'Pipeline':
        return self

    def __exit__(self, *exc):
        self.close()


LMDEPLOY_LOG_LEVELS = ('CRITICAL', 'FATAL', 'ERROR', 'WARN', 'WARNING', 'INFO', 'DEBUG')


def pipeline(*args, log_level: str | None = None, max_log_len: int | None = None,
             trust_remote_code: bool = False, chat_template_config=None, **kwargs) -> Pipeline:
    """`Pipeline(*args, **kwargs)`: every argument as Pipeline takes it; and lmdeploy's
    `log_level` (this package's loggers), `max_log_len` and `trust_remote_code` (accepted: no
    prompt is logged, and Qwen3.5 is built here, not from a checkpoint's code)."""
    if chat_template_config is not None:
        raise ValueError("chat_template_config: lmdeploy's ChatTemplateConfig is not taken "
                         "here; pass chat_template= a Jinja template or its file")
    if log_level is not None:
        if str(log_level).upper() not in LMDEPLOY_LOG_LEVELS:
            raise ValueError(f'log_level={log_level!r}: must be one of {LMDEPLOY_LOG_LEVELS}')
        logging.getLogger('lmdeploy_lite').setLevel(str(log_level).upper())
    return Pipeline(*args, **kwargs)
