"""/tokenize and /detokenize, in vLLM's shapes: the token ids that a prompt or a conversation
becomes (by default exactly those /v1/completions and /v1/chat/completions run), and the text of
token ids. Each is a function of the server's context and the request body, run off the event
loop like the checks of the generation endpoints."""
from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, model_validator
from pydantic_core import PydanticCustomError

from lmdeploy_lite.serve.openai.body import parse_request, render
from lmdeploy_lite.serve.openai.checks import ServerContext, check_model, encode
from lmdeploy_lite.serve.openai.errors import RequestError
from lmdeploy_lite.serve.openai.protocol import MAX_INT32, ChatMessage, RequestModel, Tool


class TokenizeRequest(RequestModel):
    """A prompt (as /v1/completions takes it) or a conversation (as /v1/chat/completions), not
    both. The defaults give the ids those endpoints run."""
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    tools: list[Tool] | None = Field(None, description='messages only: shown by the template')
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description='messages only: more template variables, as the chat endpoint takes')
    add_special_tokens: bool = Field(False, description="the tokenizer's BOS/EOS around the "
                                                        "text (default false: as this server "
                                                        "encodes prompts)")
    add_generation_prompt: bool = Field(True, description="messages only: end with the "
                                                          "assistant turn's opening")
    return_token_strs: bool = Field(False, description="also each token's string")

    @model_validator(mode='after')
    def _one_prompt(self):
        if (self.prompt is None) == (self.messages is None):
            raise PydanticCustomError('prompt', 'give "prompt" (text) or "messages" (a '
                                      'conversation), one of them')
        return self


TokenId = Annotated[int, Field(ge=0, le=MAX_INT32)]


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[TokenId]


def check_tokenize(ctx: ServerContext, body: bytes) -> dict:
    """{'count', 'max_model_len', 'tokens'} (+ 'token_strs' when asked)."""
    req = parse_request(body, TokenizeRequest)
    check_model(ctx, req.model)
    tokenizer = _tokenizer(ctx)
    if req.prompt is not None:
        ids = encode(ctx, req.prompt, 'prompt', None)
        if req.add_special_tokens:
            ids = tokenizer.encode(req.prompt, add_special_tokens=True)
    else:
        messages = [m.template_message() for m in req.messages]
        tools = [t.model_dump(exclude_none=True) for t in req.tools or ()]
        kwargs = req.chat_template_kwargs
        ids = encode(ctx, messages, 'messages', tools, kwargs)   # the chat endpoint's prompt
        if req.add_special_tokens or not req.add_generation_prompt:
            from jinja2 import TemplateError     # importable: encode rendered the template
            try:
                text = tokenizer.apply_chat_template(
                    messages, tools=tools or None, tokenize=False,
                    add_generation_prompt=req.add_generation_prompt, **(kwargs or {}))
            except TemplateError as e:
                raise RequestError(f'messages: the chat template refuses them ({e})',
                                   'messages') from None
            ids = tokenizer.encode(text, add_special_tokens=req.add_special_tokens)
    answer = {'count': len(ids), 'max_model_len': ctx.pipe.session_len, 'tokens': ids}
    if req.return_token_strs:
        answer['token_strs'] = tokenizer.convert_ids_to_tokens(ids)
    return answer


def check_detokenize(ctx: ServerContext, body: bytes) -> dict:
    """{'prompt': the text of `tokens`, special tokens included}."""
    req = parse_request(body, DetokenizeRequest)
    check_model(ctx, req.model)
    tokenizer, vocab_size = _tokenizer(ctx), ctx.pipe.vocab_size
    for i, token in enumerate(req.tokens):
        if token >= vocab_size:
            raise RequestError(f'tokens.{i}={render(token)}: not a token id of this model '
                               f'(0 to {vocab_size - 1})', f'tokens.{i}')
    return {'prompt': tokenizer.decode(req.tokens)}


def _tokenizer(ctx: ServerContext):
    if ctx.pipe.tokenizer is None:
        raise RequestError(f'{ctx.model_name} has no tokenizer: this server takes and returns '
                           f'token ids only', code='no_tokenizer')
    return ctx.pipe.tokenizer
