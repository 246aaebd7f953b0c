"""OpenAI wire format (the subset we serve), as pydantic models. Every request field is checked
here (the tool-calling ones in tool_params.py, the field kinds in fields.py), once, before
anything else sees the request: types are strict (`"yes"` is not a bool, `1.5` not an int),
numbers finite and inside the range declared on their Field, `null` means the default.
Each field of OpenAI's request schemas (openai-python's CompletionCreateParams,
ChatCompletionCreateParams and the message params) is one of three kinds: honoured; `no_effect`
(it changes nothing we generate: `metadata`, `store`, `user`, ...), type-checked and then ignored;
or `no_op`, which would change the answer in a way we cannot, accepted only at a value that asks
for nothing and otherwise a 400 naming it. A field in no schema (a typo) is a 400 naming it
(`extra='forbid'`).
"""
import json
import uuid
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from lmdeploy_lite.messages import INT32_MAX as MAX_INT32
from lmdeploy_lite.messages import UINT64_MAX as MAX_SEED
from lmdeploy_lite.messages import (GREEDY_TEMPERATURE, GREEDY_TOP_P, MAX_LOGPROBS,  # the engine's
                                    MAX_N, MAX_OPENAI_PENALTY, MAX_REPETITION_PENALTY,  # ranges
                                    MIN_REPETITION_PENALTY, GenerationConfig)
from lmdeploy_lite.serve.openai.fields import RequestModel, no_effect, no_op
from lmdeploy_lite.serve.openai.tool_params import (AllowedToolChoice, NamedToolChoice, Tool,
                                                    ToolCallParam, ToolChoice)
from lmdeploy_lite.structured import check_response_format, tool_call_format

MAX_STOP_WORDS = 16
MAX_STOP_WORD_CHARS = 256              # stop words are matched against the text at every step
MAX_COMPLETION_LOGPROBS = 5            # the legacy completions API's limit
MIN_SEED = -2**63                      # OpenAI's seed is an int64


def random_id(prefix: str) -> str:
    return f'{prefix}-{uuid.uuid4().hex}'


# ---- requests -------------------------------------------------------------------------------
class StreamOptions(RequestModel):
    include_usage: bool = False
    include_obfuscation: no_effect(bool, 'random padding in stream chunks (a side-channel '
                                         'guard); none is sent') = None


StopWord = Annotated[str, Field(min_length=1, max_length=MAX_STOP_WORD_CHARS)]


class SamplingRequest(RequestModel):
    """Fields shared by /v1/completions and /v1/chat/completions (top_k, ignore_eos,
    skip_special_tokens, repetition_penalty: extensions, as in vLLM). Penalties act on the raw
    logits before temperature, top-k and top-p (GenerationConfig)."""
    model: str | None = None
    temperature: float = Field(1.0, ge=0,
                               description=f'below {GREEDY_TEMPERATURE} (0 included): greedy')
    top_p: float = Field(1.0, ge=0, le=1, description=f'below {GREEDY_TOP_P} (0 included): greedy')
    top_k: int = Field(0, ge=-1, le=MAX_INT32,
                       description='0 or -1: off; at least the vocabulary size: off')
    stop: StopWord | Annotated[list[StopWord], Field(max_length=MAX_STOP_WORDS)] | None = None
    seed: int | None = Field(None, ge=MIN_SEED, le=MAX_SEED, description="OpenAI's int64 or a "
                             "uint64; a negative seed is taken mod 2**64")
    stream: bool = False
    stream_options: StreamOptions | None = Field(None, description='needs "stream": true')
    user: no_effect(str, 'identifies the end user to OpenAI') = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    n: int = Field(1, ge=1, le=MAX_N, description='choices per prompt, sampled from one '
                   'shared prefill; with a seed, choice i uses seed + i (mod 2**64)')
    presence_penalty: float = Field(0.0, ge=-MAX_OPENAI_PENALTY, le=MAX_OPENAI_PENALTY,
                                    description='logit -= presence_penalty for every token the '
                                                'output holds; 0: off')
    frequency_penalty: float = Field(0.0, ge=-MAX_OPENAI_PENALTY, le=MAX_OPENAI_PENALTY,
                                     description='logit -= frequency_penalty x the times the '
                                                 'output holds the token; 0: off')
    repetition_penalty: float = Field(1.0, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY,
                                      description='a token of the prompt or output: logit / p '
                                                  'if positive, else logit x p; 1: off')
    logit_bias: dict[Annotated[str, Field(pattern=r'^[0-9]{1,10}$')],
                     Annotated[float, Field(ge=-100, le=100)]] | None = Field(
        None, description='{"token id": bias in [-100, 100]} added to those logits')
    min_p: float = Field(0.0, ge=0, le=1, description="sampling keeps tokens with at least "
                                                      "min_p x the top token's probability")
    min_tokens: int = Field(0, ge=0, le=MAX_INT32, description='no stop id before this many tokens')
    response_format: dict[str, Any] | None = Field(
        None, description='{"type": "json_object"}, {"type": "json_schema", "json_schema": '
                          '{"name", "schema", "strict"}} or xgrammar\'s {"type": '
                          '"structural_tag", "format": {...}}: the output follows it (xgrammar)')

    default_max_tokens: ClassVar[int | None] = None     # None: what the session leaves

    @field_validator('stream_options')
    @classmethod
    def _needs_stream(cls, value, info: ValidationInfo):
        if not info.data.get('stream', True):      # absent: stream itself was invalid
            raise PydanticCustomError('stream', 'only allowed with "stream": true (as OpenAI '
                                      'and vLLM)')
        return value

    @field_validator('response_format')
    @classmethod
    def _compiles(cls, value):
        try:
            return check_response_format(value)
        except ValueError as e:        # 'response_format[.sub.field]: reason'
            reason = str(e).removeprefix('response_format').removeprefix(': ').lstrip('.')
            raise PydanticCustomError('response_format', '{reason}', {'reason': reason}) from None

    @property
    def output_format(self) -> dict | None:
        """The grammar the output follows (GenerationConfig.response_format); None: free."""
        return self.response_format

    @property
    def num_candidates(self) -> int:
        """The sequences run per prompt (GenerationConfig.n): n, or completions' best_of."""
        return self.n

    @property
    def picks_best(self) -> bool:
        """The n choices are picked from more candidates (best_of > n)."""
        return self.num_candidates > self.n

    @property
    def includes_usage(self) -> bool:
        """A stream ends with a usage chunk."""
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def length_field(self) -> tuple[str, int | None]:
        """(the field that limits the output's length, as the request spells it; its value, None
        when not given). Each endpoint has its own: max_tokens here."""
        return 'max_tokens', self.max_tokens

    def generation_config(self, room: int, vocab_size: int, defaults: dict | None = None
                          ) -> GenerationConfig:
        """The engine's GenerationConfig for this request; `room`: the tokens the session leaves
        after the prompt; `defaults`: values for the sampling fields the request omits (the
        model's generation_config.json). Raises ValueError ('field=value: reason') as
        GenerationConfig does."""
        if defaults:
            self = self.model_copy(update={k: v for k, v in defaults.items()
                                           if k not in self.model_fields_set})
        greedy = self.temperature < GREEDY_TEMPERATURE or self.top_p < GREEDY_TOP_P
        return GenerationConfig(
            max_new_tokens=max(1, self.length_field[1]
                               or min(self.default_max_tokens or room, room)),
            do_sample=not greedy, temperature=0.0 if greedy else self.temperature,
            top_p=self.top_p or 1.0,                  # 0: greedy (temperature 0 above)
            top_k=0 if self.top_k >= vocab_size else max(self.top_k, 0),
            stop_words=self.stop or None, ignore_eos=self.ignore_eos,
            random_seed=None if self.seed is None else self.seed % 2**64,
            skip_special_tokens=self.skip_special_tokens,
            repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, n=self.num_candidates,
            logprobs=self.num_logprobs,
            min_p=self.min_p, min_tokens=self.min_tokens,
            logit_bias=self.logit_bias and {int(t): v for t, v in self.logit_bias.items()},
            response_format=self.output_format)


class CompletionRequest(SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(None, ge=1, le=MAX_INT32, description='default 16; prompt '
                                   '+ max_tokens must fit in session_len')
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS,
                                 description='the most likely tokens returned with each output '
                                             'token (and the chosen one); 0: the chosen only')
    default_max_tokens: ClassVar[int] = 16           # OpenAI's default for /v1/completions
    echo: bool = Field(False, description='each choice begins with its prompt (a stream: in a '
                       'first chunk); not with logprobs (those of the prompt are not computed)')
    best_of: int | None = Field(None, ge=1, le=MAX_N, description='candidates per prompt; '
                                'above n, the n whose tokens have the highest mean log-'
                                'probability come back (best first), all counted in usage; '
                                'not streamed (as OpenAI)')
    suffix: no_op('') = None

    @field_validator('best_of')
    @classmethod
    def _not_streamed(cls, value, info: ValidationInfo):
        if value > info.data.get('n', 1) and info.data.get('stream'):
            raise PydanticCustomError('best_of', 'above n it cannot be streamed (the best are '
                                      'known at the end), as OpenAI; send "stream": false or '
                                      'best_of <= n')
        return value

    @field_validator('echo')
    @classmethod
    def _no_prompt_logprobs(cls, value, info: ValidationInfo):
        if value and info.data.get('logprobs') is not None:
            raise PydanticCustomError('echo', 'not with logprobs: they would include the '
                                      "prompt's, which this server does not compute; send one")
        return value

    @property
    def num_candidates(self) -> int:
        return max(self.best_of or 1, self.n)        # best_of <= n: nothing to pick

    @property
    def num_logprobs(self) -> int | None:
        """GenerationConfig.logprobs: the top-N to return, None for no logprobs (picking the
        best needs the chosen tokens' at least)."""
        return 0 if self.logprobs is None and self.picks_best else self.logprobs


class ContentPart(RequestModel):
    """A part of a message's content: text, or (assistant messages) a refusal's text."""
    type: Literal['text', 'refusal'] = Field(description="'refusal': assistant messages only")
    text: str | None = None
    refusal: str | None = None
    prompt_cache_breakpoint: no_effect(dict[str, Any], 'a prompt-cache boundary (prefix '
                                                       'caching here is automatic)') = None

    @field_validator('type', mode='before')
    @classmethod
    def _text_only(cls, value):
        if value in ('image_url', 'input_audio', 'file'):          # OpenAI's other user parts
            raise PydanticCustomError('content_part', "this server's models read text only: "
                                      "allowed 'text' (and 'refusal' in assistant messages)")
        return value

    @model_validator(mode='after')
    def _its_text(self):
        texts = {'text': self.text, 'refusal': self.refusal}
        if texts.pop(self.type) is None or texts.popitem()[1] is not None:
            raise PydanticCustomError('content_part', "a 'text' part has text, a 'refusal' part "
                                      "has refusal")
        return self


# ChatMessage's fields that depend on its role: (is this value wrong for the role?, why)
ROLE_RULES = {
    'name': (lambda value, role: role == 'tool',
             "a 'tool' message has no name (tool_call_id says which call it answers)"),
    'refusal': (lambda value, role: role != 'assistant',
                'only assistant messages carry a refusal'),
    'content': (lambda value, role: isinstance(value, list) and role != 'assistant' and any(
        part.type == 'refusal' for part in value), "only assistant messages have 'refusal' parts"),
    'tool_calls': (lambda value, role: bool(value) and role != 'assistant',
                   'only assistant messages make tool calls'),
    'tool_call_id': (lambda value, role: (value is None) == (role == 'tool'),
                     "a 'tool' message needs tool_call_id (the id of the call it answers), and "
                     "only a 'tool' message has one"),
}


class ChatMessage(RequestModel):
    role: Literal['system', 'user', 'assistant', 'developer', 'tool'] = Field(
        description="'developer' is a 'system' message; 'tool' answers a tool call")
    content: str | list[ContentPart] | None = None
    name: str | None = Field(None, description="the participant's name, passed to the chat "
                             "template (which may show it); not on 'tool' messages")
    refusal: str | None = Field(None, description="an assistant's refusal as it came back: the "
                                                  "message's text when it has no content")
    tool_calls: list[ToolCallParam] | None = Field(None, description='assistant messages only')
    tool_call_id: str | None = Field(None, validate_default=True, description="the call a "
                                     "'tool' message answers (required there, and only there)")
    audio: no_op(hint='this server generates text only, so no reply of its has audio') = None
    function_call: no_op(hint='the legacy function-calling API; send tool_calls instead') = None

    @field_validator('role', mode='before')
    @classmethod
    def _not_legacy(cls, value):
        if value == 'function':
            raise PydanticCustomError('role', "the legacy function-calling API's role: send the "
                                      "result as a 'tool' message; allowed: 'system', 'user', "
                                      "'assistant', 'developer', 'tool'")
        return value

    @field_validator(*ROLE_RULES)
    @classmethod
    def _fits_role(cls, value, info: ValidationInfo):
        wrong, message = ROLE_RULES[info.field_name]
        if wrong(value, info.data.get('role')):
            raise PydanticCustomError('role', message)
        return value

    def template_message(self) -> dict:
        """As the chat template takes it: text content, tool call arguments as dicts."""
        calls = [{'id': call.id, 'type': 'function', 'function': {
            'name': call.function.name, 'arguments': json.loads(call.function.arguments)}}
            for call in self.tool_calls or ()]
        message = {'role': 'system' if self.role == 'developer' else self.role,
                   'content': self.text(), 'name': self.name, 'tool_calls': calls or None,
                   'tool_call_id': self.tool_call_id}
        return {key: value for key, value in message.items() if value is not None}

    def text(self) -> str:
        """Content as one string (a list of parts joins their text); no content: the refusal."""
        if self.content is None or isinstance(self.content, str):
            return self.content or self.refusal or ''
        return ''.join(p.refusal if p.type == 'refusal' else p.text for p in self.content)


class PromptCacheOptions(RequestModel):
    mode: Literal['implicit', 'explicit'] | None = None
    ttl: Literal['30m'] | None = None


class Prediction(RequestModel):
    type: Literal['content']
    content: str | list[ContentPart]


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=MAX_INT32, description='default: what session_'
                                   'len leaves after the prompt; more than that is rejected')
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_INT32,
                                              description='max_tokens by its newer name')
    logprobs: bool = Field(False, description="each output token's log-probability")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description='the most likely '
                                     'tokens returned with each output token (needs logprobs: '
                                     'true)')
    tools: list[Tool] | None = Field(None, description='shown to the model by the chat template')
    tool_choice: ToolChoice | None = Field(
        None, description='"auto" (the default with tools): calls in the output come back as '
                          'tool_calls; "none": the output is text; "required" or {"type": '
                          '"function", "function": {"name": ...}}: the output is calls (to that '
                          'function), following their schemas (xgrammar); "allowed_tools": the '
                          'model sees every tool, its calls (its mode) go to these only')
    parallel_tool_calls: bool = Field(True, description='false: calls after the first are '
                                                        'dropped (as vLLM)')
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description='more chat-template variables (vLLM, SGLang): {"enable_thinking": '
                          'false} turns thinking off')
    functions: no_op(hint='the legacy function-calling API; send tools instead') = None
    function_call: no_op(hint='the legacy function-calling API; send tool_choice instead') = None
    # standard fields that change nothing generated here
    metadata: no_effect(dict[str, str], 'tags stored with the completion') = None
    store: no_effect(bool, 'stores the completion for distillation and evals') = None
    service_tier: no_effect(Literal['auto', 'default', 'flex', 'scale', 'priority', 'fast'],
                            'the processing tier billed') = None
    safety_identifier: no_effect(str, 'identifies the end user for abuse detection') = None
    prompt_cache_key: no_effect(str, 'groups requests for prompt caching (automatic here: '
                                     'prefix caching)') = None
    prompt_cache_retention: no_effect(Literal['in_memory', '24h'],
                                      'how long cached prompts live') = None
    prompt_cache_options: no_effect(PromptCacheOptions, 'prompt-cache breakpoints and '
                                                        'lifetime') = None
    prediction: no_effect(Prediction, 'predicted output: faster, the same answer') = None
    # standard fields that would change the answer in a way this server cannot
    modalities: no_op(['text'], hint='this server generates text only') = None
    audio: no_op(hint='this server generates text only') = None
    reasoning_effort: no_op(hint='this server has no reasoning-effort control') = None
    verbosity: no_op(hint='this server has no verbosity control') = None
    web_search_options: no_op(hint='this server has no web search') = None
    moderation: no_op(hint='this server runs no moderation model') = None

    @field_validator('top_logprobs')
    @classmethod
    def _needs_logprobs(cls, value, info: ValidationInfo):
        if not info.data.get('logprobs'):
            raise PydanticCustomError('logprobs', 'needs "logprobs": true (top_logprobs asks '
                                      'for the top tokens of the logprobs it turns on)')
        return value

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @field_validator('tool_choice')
    @classmethod
    def _forced_call(cls, value, info: ValidationInfo):
        names = [t.function.name for t in info.data.get('tools') or ()]
        if value in ('none', 'auto', None):
            return value
        if not names:
            raise PydanticCustomError('tools', 'forcing a call needs "tools"')
        chosen = ([value] if isinstance(value, NamedToolChoice) else value.allowed_tools.tools
                  if isinstance(value, AllowedToolChoice) else [])
        if unknown := [c.function.name for c in chosen if c.function.name not in names]:
            raise PydanticCustomError('tools', 'names no function of "tools" ({names}): '
                                      '{unknown}', {'unknown': ', '.join(unknown),
                                                    'names': ', '.join(names)})
        if info.data.get('response_format'):
            raise PydanticCustomError('response_format', 'forcing or restricting calls and '
                                      'response_format cannot both hold the output; send one '
                                      'of them')
        return value

    @property
    def output_format(self) -> dict | None:
        """A forced call (tool_choice "required" or named), or calls to `strict` functions, as a
        grammar (Qwen3.5's tool-call blocks); else the response_format."""
        strict = any(t.function.strict for t in self.tools or ())
        if self.tool_choice not in (None, 'none', 'auto') or (
                strict and self.tool_choice != 'none' and not self.response_format):
            tools, choice = self.callable_tools()
            return tool_call_format([t.model_dump(exclude_none=True) for t in tools], choice,
                                    self.parallel_tool_calls)
        return self.response_format

    def callable_tools(self) -> tuple[list[Tool], str | dict]:
        """The tools the output may call and tool_call_format's tool_choice: "allowed_tools"
        keeps those it lists, with its mode ("auto": the grammar's triggered calls name only
        them)."""
        choice = self.tool_choice or 'auto'
        if isinstance(choice, AllowedToolChoice):
            names = {c.function.name for c in choice.allowed_tools.tools}
            return ([t for t in self.tools if t.function.name in names],
                    choice.allowed_tools.mode)
        return self.tools, choice if isinstance(choice, str) else choice.model_dump()

    @property
    def length_field(self) -> tuple[str, int | None]:
        if self.max_completion_tokens:               # the newer name, when given
            return 'max_completion_tokens', self.max_completion_tokens
        return 'max_tokens', self.max_tokens

    @property
    def parses_tool_calls(self) -> bool:
        return bool(self.tools) and self.tool_choice != 'none'
