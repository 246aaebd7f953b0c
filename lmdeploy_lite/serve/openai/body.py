"""From the bytes of a request body to a validated request model, or a RequestError naming what is
wrong: 413 for a body over the limit, 400 for anything else. `read_body` counts bytes as they
arrive, so an oversized body is refused before it is read whole; `parse_request` (JSON, the
Unicode check, validation) is CPU work, which the server runs off the event loop."""
from __future__ import annotations

import json
from typing import TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request

from lmdeploy_lite.messages import is_unicode
from lmdeploy_lite.serve.openai.errors import CLIENT_DISCONNECTED, RequestError
from lmdeploy_lite.serve.openai.fields import allowed_range

Model = TypeVar('Model', bound=BaseModel)

RANGE_ERRORS = ('greater_than', 'greater_than_equal', 'less_than', 'less_than_equal')
TYPE_ERRORS = {'string_type': 'a string', 'int_type': 'an integer', 'int_from_float': 'an integer',
               'float_type': 'a number', 'finite_number': 'a finite number',
               'bool_type': 'true or false', 'list_type': 'a list', 'dict_type': 'a JSON object',
               'model_type': 'a JSON object', 'model_attributes_type': 'a JSON object'}


def too_large(limit: int) -> RequestError:
    return RequestError(f'the request body is larger than {limit} bytes, the limit of this '
                        f'server (--max-request-bytes)', code='request_too_large', status=413)


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body; 415 for a Content-Type that is not JSON (a browser's cross-site form
    post sends text/plain, application/x-www-form-urlencoded or multipart/form-data; none is
    read); 413 as soon as it is known to exceed `limit` bytes: from Content-Length before
    reading anything, else counted as the chunks of a chunked upload arrive."""
    if (media := request.headers.get('content-type')) is not None and not is_json_media(media):
        raise RequestError(f'Content-Type: {render(media)}: the request body must be JSON; send '
                           f'"Content-Type: application/json"', status=415,
                           type='invalid_request_error', code='unsupported_media_type')
    length = request.headers.get('content-length', '')
    if length.isdigit() and (len(length) > 18 or int(length) > limit):
        raise too_large(limit)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large(limit)
            chunks.append(chunk)
    except ClientDisconnect:
        raise RequestError('the client disconnected before sending the whole body',
                           code=CLIENT_DISCONNECTED, status=499) from None
    return b''.join(chunks)


def is_json_media(content_type: str) -> bool:
    """application/json or a +json type, any parameters (charset=...) allowed."""
    media = content_type.split(';', 1)[0].strip().lower()
    return media == 'application/json' or (media.startswith('application/')
                                           and media.endswith('+json'))


def parse_request(body: bytes, model: type[Model]) -> Model:
    """JSON -> `model`, or a RequestError (400) naming the field, the value and the reason."""
    try:
        data = json.loads(body)
    except RecursionError:
        raise RequestError('the request body is nested too deeply') from None
    except json.JSONDecodeError as e:
        raise RequestError(f'the request body is not valid JSON ({e.msg} at character {e.pos})'
                           ) from None
    except UnicodeDecodeError:
        raise RequestError('the request body is not UTF-8 text') from None
    except ValueError:               # Python reads integers of at most 4300 digits
        raise RequestError('the request body holds a number too long to read') from None
    if (where := find_lone_surrogate(data)) is not None:
        raise RequestError(f'{where or "the request body"}: a string holds a lone UTF-16 '
                           f'surrogate (such as "\\ud800"), which is not Unicode text',
                           where or None)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        param, message = describe_validation_error(deepest(e.errors()), model)
        raise RequestError(message, param) from None


def find_lone_surrogate(data) -> str | None:
    """The dotted path of the first string (key or value) that is not valid Unicode, '' for the
    top level, None when all are valid. Iterative: JSON may nest as deep as json.loads allows."""
    todo: list[tuple[str, object]] = [('', data)]
    while todo:
        path, value = todo.pop()
        items = (value.items() if isinstance(value, dict) else enumerate(value)
                 if isinstance(value, list) else ())
        for key, item in items:
            child = f'{path}.{printable(str(key))}' if path else printable(str(key))
            if any(isinstance(x, str) and not is_unicode(x) for x in (key, item)):
                return child
            if isinstance(item, (dict, list)):
                todo.append((child, item))
        if isinstance(value, str) and not is_unicode(value):
            return path
    return None


def printable(text: str, limit: int = 60) -> str:
    """`text` shortened to `limit` characters, lone surrogates written as escapes."""
    short = text if len(text) <= limit else text[:limit] + '...'
    return short.encode('utf-8', 'backslashreplace').decode('utf-8')


def deepest(errors: list[dict]) -> dict:
    """The most specific of pydantic's errors (a union reports one per member): the deepest,
    and among those one from a member whose type matched (a constraint failed)."""
    return max(errors, key=lambda err: (len(err.get('loc', ())), err['type'] not in TYPE_ERRORS))


def render(value) -> str:
    """A request value as it would be quoted in an error message, shortened."""
    if isinstance(value, int) and not isinstance(value, bool):
        digits = str(value)
        return digits if len(digits) <= 24 else f'{digits[:12]}...({len(digits)} digits)'
    if isinstance(value, str):
        return json.dumps(printable(value), ensure_ascii=False)
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (ValueError, TypeError, RecursionError):
        text = type(value).__name__
    return printable(text, 80)


def describe_validation_error(err: dict, model: type[BaseModel]) -> tuple[str | None, str]:
    """(param, message) of one pydantic error, in the request's own terms."""
    kind, loc = err.get('type'), list(err.get('loc', ()))
    user_key = [printable(str(loc.pop()))] if kind == 'extra_forbidden' and loc else []
    # union members ('str', 'list[int]', 'constrained-str', ...) are not part of the request
    path = [str(x) for x in loc if isinstance(x, int)
            or not any(c in x for c in '[-') and x not in ('str', 'int', 'float', 'bool')]
    param = '.'.join(path + user_key) or None
    if kind == 'extra_forbidden':
        return param, f'{param}: unknown field; this server does not support it'
    if kind == 'missing':
        return param, f"'{param}' is required"
    if param is None:                # the body's type, or a check of the whole request
        return None, ('the request body must be a JSON object' if kind in TYPE_ERRORS
                      else err.get('msg', 'invalid request'))
    if kind in RANGE_ERRORS and len(path) == 1 and allowed_range(model, path[0]):
        reason = f'must be in {allowed_range(model, path[0])}'
    elif kind in TYPE_ERRORS:
        reason = f'must be {TYPE_ERRORS[kind]}'
    else:
        msg = err.get('msg', 'invalid value')
        reason = msg[:1].lower() + msg[1:]
    return param, f'{param}={render(err.get("input"))}: {reason}'
