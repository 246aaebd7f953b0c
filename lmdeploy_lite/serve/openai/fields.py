"""What a request field may be: the base of every request model (strict types, finite numbers,
null for the default, a field in no schema refused), and the two kinds of standard field that
are not honoured: `no_effect` (type-checked, then ignored) and `no_op` (accepted only at a value
that asks for nothing). `allowed_range` writes a numeric field's interval for error messages."""
import json
from typing import Annotated, Any

from annotated_types import Ge, Gt, Le, Lt
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError


def allowed_range(model: type[BaseModel], name: str) -> str | None:
    """'[0, 2]', '(0, 1]', ...: the interval a numeric field's Field(ge/gt/le/lt) allows."""
    if (info := model.model_fields.get(name)) is None:
        return None
    bounds = {type(bound): bound for bound in info.metadata}
    low = f'[{bounds[Ge].ge}' if Ge in bounds else f'({bounds[Gt].gt}' if Gt in bounds else '(-inf'
    high = f'{bounds[Le].le}]' if Le in bounds else f'{bounds[Lt].lt})' if Lt in bounds else 'inf)'
    return f'{low}, {high}'


def _json_equal(a, b) -> bool:
    """Equal as JSON values: 0 == 0.0, but false != 0 and "1" != 1."""
    typed = any(isinstance(x, (bool, str)) for x in (a, b))
    return a == b and (not typed or type(a) is type(b))


def no_op(*values, hint: str = '') -> Any:
    """The type of a field this server does not implement: only null and `values` (which ask for
    nothing) pass, anything else is a 400 naming the field (and `hint`: why, or what to send)."""
    allowed = ' or '.join(json.dumps(v) for v in (None, *values))
    hint = f'; {hint}' if hint else ''

    def check(value):
        if not any(_json_equal(value, v) for v in values):
            raise PydanticCustomError('unsupported', 'not supported by this server (accepted only '
                                      'as {allowed}){hint}', {'allowed': allowed, 'hint': hint})
        return value
    return Annotated[Any, AfterValidator(check),
                     Field(description=f'not supported: accepted only as {allowed} (no effect)')]


def no_effect(annotation, meaning: str) -> Any:
    """The type of a standard field that changes nothing this server generates: its type is
    checked, then it is ignored. `meaning`: what it does at OpenAI (for /docs)."""
    return Annotated[annotation | None, Field(description=f'accepted, no effect here: {meaning}')]


class RequestModel(BaseModel):
    model_config = ConfigDict(extra='forbid', strict=True, allow_inf_nan=False)

    @model_validator(mode='before')
    @classmethod
    def _null_means_default(cls, data):
        """OpenAI clients may send null for any optional field; it means the default."""
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data
