"""The tool-calling fields of a chat request: `tools` (function definitions), `tool_choice` (its
string modes, a named function, or "allowed_tools") and the calls an assistant message of the
history made. Checked as protocol.py checks every field."""
import json
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, field_validator
from pydantic_core import PydanticCustomError

from lmdeploy_lite.serve.openai.fields import RequestModel

FunctionName = Annotated[str, Field(pattern=r'^[A-Za-z0-9_.:-]{1,64}$',
                                    description='letters, digits, _ . : - (1 to 64)')]


class FunctionCall(RequestModel):
    name: str = Field(min_length=1)
    arguments: str = Field(description='a JSON object, as text')

    @field_validator('arguments')
    @classmethod
    def _json_object(cls, value: str) -> str:
        try:
            if isinstance(json.loads(value), dict):
                return value
        except (ValueError, RecursionError):
            pass
        raise PydanticCustomError('json_object', 'must be a JSON object written as a string '
                                  '(as the tool call came back)')


class ToolCallParam(RequestModel):
    """A call an assistant message made, in the history."""
    id: str
    type: Literal['function']
    function: FunctionCall


class FunctionDefinition(RequestModel):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description='a JSON schema')
    strict: bool | None = Field(None, description='true: calls to it follow its schema '
                                                  '(xgrammar), with tool_choice "auto" too')


class Tool(RequestModel):
    type: Literal['function']
    function: FunctionDefinition


class NamedFunction(RequestModel):
    name: FunctionName


class NamedToolChoice(RequestModel):
    type: Literal['function']
    function: NamedFunction


class AllowedTools(RequestModel):
    mode: Literal['auto', 'required'] = Field(description='"auto": calls to these or text')
    tools: list[NamedToolChoice] = Field(min_length=1, description='the tools it may call')


class AllowedToolChoice(RequestModel):
    type: Literal['allowed_tools']
    allowed_tools: AllowedTools


TOOL_CHOICES = ('"none", "auto", "required", {"type": "function", "function": {"name": ...}} or '
                '{"type": "allowed_tools", "allowed_tools": {"mode": "auto"|"required", "tools"}}')


def _tool_choice_form(value) -> str | None:
    """ToolChoice's member `value` is (tags with '-': an error's param names no member)."""
    if isinstance(value, str):
        return 'mode-choice' if value in ('none', 'auto', 'required') else None
    kind = value.get('type') if isinstance(value, dict) else getattr(value, 'type', None)
    return {'function': 'function-choice', 'allowed_tools': 'allowed-choice'}.get(kind)


ToolChoice = Annotated[
    Annotated[Literal['none', 'auto', 'required'], Tag('mode-choice')]
    | Annotated[NamedToolChoice, Tag('function-choice')]
    | Annotated[AllowedToolChoice, Tag('allowed-choice')],
    Discriminator(_tool_choice_form, custom_error_type='tool_choice',
                  custom_error_message=f'must be {TOOL_CHOICES}')]
