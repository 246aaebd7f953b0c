"""OpenAI wire format (the subset we serve), as pydantic models. Request fields carry the limits a
request is checked against; unknown fields are ignored, as the OpenAI API does."""
from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


def random_id(prefix: str) -> str:
    return f'{prefix}-{uuid.uuid4().hex}'


# ---- errors ---------------------------------------------------------------------------------
class ErrorInfo(BaseModel):
    message: str
    type: str = 'invalid_request_error'
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# ---- requests -------------------------------------------------------------------------------
class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingRequest(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions (top_k, ignore_eos: extensions,
    as in vLLM)."""
    model_config = ConfigDict(extra='ignore')

    model: str | None = None
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1, description='0 or -1: off')
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    ignore_eos: bool = False
    skip_special_tokens: bool = True


class CompletionRequest(SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra='ignore')

    role: str
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        """Content as one string; a list of parts keeps its text parts."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ''
        return ''.join(p.get('text', '') for p in self.content if p.get('type') == 'text')


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)


# ---- responses ------------------------------------------------------------------------------
class SpecDecodeUsage(BaseModel):
    """This request's speculative-decoding figures (an extension of `usage`)."""
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_position: list[int]
    mean_accepted_length: float


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    spec_decode: SpecDecodeUsage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal['model'] = 'model'
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = 'lmdeploy_lite'
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal['list'] = 'list'
    data: list[ModelCard]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal['text_completion'] = 'text_completion'
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatResponseMessage(BaseModel):
    role: Literal['assistant'] = 'assistant'
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatResponseMessage
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal['chat.completion'] = 'chat.completion'
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaMessage(BaseModel):
    role: Literal['assistant'] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal['chat.completion.chunk'] = 'chat.completion.chunk'
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
