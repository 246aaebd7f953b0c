"""`pipeline()`: the Python entry point. Batch, streaming and async generation over one engine."""
from __future__ import annotations

import asyncio
import os
import queue
from typing import AsyncIterator, Iterator, Sequence as Seq

from lmdeploy_lite.messages import (GenerationConfig, PytorchEngineConfig, Response,
                                    SpeculativeConfig)
from lmdeploy_lite.pytorch.engine.engine import Engine, StepOutput
from lmdeploy_lite.pytorch.engine.engine_loop import EngineLoop
from lmdeploy_lite.pytorch.engine.stopping import truncate_at_stop_word

Prompt = str | list[int] | list[dict]

EMBEDDED_MODEL_DIR = os.path.join(os.path.dirname(__file__), 'assets', 'qwen3_5_moe_tiny')


def resolve_model_path(model_path: str | None) -> str:
    """None means the embedded default model shipped inside the package."""
    if model_path is not None:
        return model_path
    if not os.path.isfile(os.path.join(EMBEDDED_MODEL_DIR, 'config.json')):
        raise ValueError(f'model_path=None: the embedded model is missing at {EMBEDDED_MODEL_DIR}; '
                         f'pass a model directory')
    return EMBEDDED_MODEL_DIR


def load_tokenizer(model_path: str):
    """The model directory's tokenizer through transformers, offline; None if it has none."""
    names = ('tokenizer.json', 'tokenizer_config.json', 'vocab.json', 'tokenizer.model')
    if not any(os.path.isfile(os.path.join(model_path, n)) for n in names):
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model_path, local_files_only=True)


class _Detokenizer:
    """Incremental text of one request; holds back text that may still turn into a stop word."""

    def __init__(self, tokenizer, gen_config: GenerationConfig):
        self.tokenizer = tokenizer
        self.gen_config = gen_config
        self.token_ids: list[int] = []
        self.sent = 0                                     # characters already handed out

    def add(self, token_ids: list[int], finished: bool) -> str:
        self.token_ids += token_ids
        if self.tokenizer is None:
            return ''
        text = self.tokenizer.decode(self.token_ids,
                                     skip_special_tokens=self.gen_config.skip_special_tokens)
        stop_words = self.gen_config.stop_words or ()
        text = truncate_at_stop_word(text, stop_words)
        if not finished:
            if text.endswith('\ufffd'):                   # an incomplete UTF-8 sequence
                text = text.rstrip('\ufffd')
            hold = max((n for w in stop_words for n in range(len(w), 0, -1)
                        if text.endswith(w[:n])), default=0)
            text = text[:len(text) - hold]
        delta = text[self.sent:]
        self.sent = max(self.sent, len(text))
        return delta


class Pipeline:

    def __init__(self, model_path: str | None = None,
                 backend_config: PytorchEngineConfig | None = None,
                 speculative_config: SpeculativeConfig | None = None, progress: bool = True):
        self.model_path = resolve_model_path(model_path)
        self.tokenizer = load_tokenizer(self.model_path) if os.path.isdir(self.model_path) else None
        backend_config = backend_config or PytorchEngineConfig()
        if backend_config.distributed_executor_backend == 'ray':       # one actor per rank
            from lmdeploy_lite.pytorch.engine.executor.ray import RayEngineLoop
            self.engine = None
            self._loop = RayEngineLoop(self.model_path, backend_config, speculative_config)
        elif backend_config.tp * backend_config.dp > 1:      # one process per rank
            from lmdeploy_lite.pytorch.engine.executor.mp import MPEngineLoop
            self.engine = None
            self._loop = MPEngineLoop(self.model_path, backend_config, speculative_config)
        else:
            self.engine = Engine(self.model_path, backend_config, speculative_config,
                                 tokenizer=self.tokenizer, progress=progress)
            self._loop = EngineLoop(self.engine)

    # ---- prompts --------------------------------------------------------------------------
    def encode(self, prompt: Prompt) -> list[int]:
        """str: plain text; list of ints: token ids; list of {'role','content'}: chat template."""
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt) and prompt:
            return list(prompt)
        if self.tokenizer is None:
            raise ValueError(f'prompt: {type(prompt).__name__} given, but {self.model_path} has no '
                             f'tokenizer; pass token ids (a list of int)')
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            return self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True,
                                                      tokenize=True, return_dict=False)
        if isinstance(prompt, list) and not prompt:
            raise ValueError('prompt: empty; give at least one token')
        raise ValueError(f'prompt: {type(prompt).__name__} is not a str, a list of token ids '
                         f'or a list of chat messages')

    # ---- batch and streaming --------------------------------------------------------------
    def __call__(self, prompts: Prompt | Seq[Prompt], gen_config: GenerationConfig | None = None
                 ) -> Response | list[Response]:
        single = isinstance(prompts, str) or (isinstance(prompts, list) and prompts
                                              and not isinstance(prompts[0], (str, list)))
        batch = [prompts] if single else list(prompts)
        final: dict[int, Response] = {}
        for r in self._stream(batch, gen_config, cumulative=True):
            final[r.index] = r
        responses = [final[i] for i in range(len(batch))]
        return responses[0] if single else responses

    def stream_infer(self, prompts: Prompt | Seq[Prompt],
                     gen_config: GenerationConfig | None = None) -> Iterator[Response]:
        """Yields incremental responses (this chunk's text and token ids), each with its index."""
        single = isinstance(prompts, str) or (isinstance(prompts, list) and prompts
                                              and not isinstance(prompts[0], (str, list)))
        yield from self._stream([prompts] if single else list(prompts), gen_config,
                                cumulative=False)

    def _stream(self, prompts: list[Prompt], gen_config, cumulative: bool) -> Iterator[Response]:
        gen_config = gen_config or GenerationConfig()
        token_lists = [self.encode(p) for p in prompts]
        for ids in token_lists:                       # validate all before any work starts
            self._loop.validate_request(ids, gen_config)
        inbox: queue.Queue = queue.Queue()
        handles = [self._loop.submit(ids, gen_config,
                                     lambda item, i=i: inbox.put((i, item)))
                   for i, ids in enumerate(token_lists)]
        detoks = [_Detokenizer(self.tokenizer, gen_config) for _ in prompts]
        texts = [''] * len(prompts)
        remaining = len(prompts)
        try:
            while remaining:
                i, item = self._next(inbox)
                if isinstance(item, BaseException):
                    raise item
                delta = detoks[i].add(item.new_token_ids, item.finished)
                texts[i] += delta
                remaining -= item.finished
                if cumulative and not item.finished:
                    continue
                yield self._response(i, item, token_lists[i],
                                     texts[i] if cumulative else delta,
                                     detoks[i].token_ids if cumulative else item.new_token_ids)
        finally:
            for h in handles:
                if h.seq is None or not h.seq.is_finished:
                    self._loop.abort(h)

    def _next(self, inbox: queue.Queue):
        """The next result; never waits forever on an engine that has stopped."""
        while True:
            try:
                return inbox.get(timeout=1.0)
            except queue.Empty:
                if self._loop.error is not None:
                    raise RuntimeError(f'the engine stopped: {self._loop.error}') from None

    @staticmethod
    def _response(index: int, out: StepOutput, prompt_ids: list[int], text: str,
                  token_ids: list[int]) -> Response:
        return Response(text=text, token_ids=list(token_ids), input_token_len=len(prompt_ids),
                        generate_token_len=out.num_generated, index=index,
                        finish_reason=out.finish_reason if out.finished else None,
                        spec_stats=out.spec_stats)

    # ---- async (the server) ---------------------------------------------------------------
    async def generate(self, prompt: Prompt, gen_config: GenerationConfig | None = None
                       ) -> AsyncIterator[Response]:
        """Async stream of one request; cancelling the consumer aborts the request."""
        gen_config = gen_config or GenerationConfig()
        ids = self.encode(prompt)
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue = asyncio.Queue()
        handle = self._loop.submit(ids, gen_config,
                                   lambda item: loop.call_soon_threadsafe(inbox.put_nowait, item))
        detok = _Detokenizer(self.tokenizer, gen_config)
        finished = False
        try:
            while not finished:
                item = await inbox.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                delta = detok.add(item.new_token_ids, finished)
                yield self._response(0, item, ids, delta, item.new_token_ids)
        finally:
            if not finished:
                self._loop.abort(handle)

    # ---- lifetime -------------------------------------------------------------------------
    def close(self):
        self._loop.close()

    def __enter__(self) -> 'Pipeline':
        return self

    def __exit__(self, *exc):
        self.close()


def pipeline(model_path: str | None = None, backend_config: PytorchEngineConfig | None = None,
             speculative_config: SpeculativeConfig | None = None, progress: bool = True
             ) -> Pipeline:
    return Pipeline(model_path, backend_config, speculative_config, progress=progress)
