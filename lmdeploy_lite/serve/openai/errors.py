"""OpenAI-style error bodies, and the handlers that turn every failure into one: a RequestError
(a status and a message meant for the client), a 404/405, and anything unexpected (a 500 with a
short message; the traceback goes to the server log, never into a response)."""
from __future__ import annotations

import json
import logging
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger('lmdeploy_lite.serve')
CLIENT_DISCONNECTED = 'client_disconnected'     # the body's upload did not finish (499)


class RequestError(Exception):
    def __init__(self, message: str, param: str | None = None, code: str | None = None,
                 status: int = 400, type: str = 'invalid_request_error'):
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.type = (message, param, code,
                                                                       status, type)

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = 'invalid_request_error', param: str | None = None,
               code: str | None = None) -> dict:
    return {'error': {'message': message, 'type': type, 'param': param, 'code': code}}


class ErrorJSONResponse(JSONResponse):
    """ASCII JSON: an error that quotes the request stays valid whatever the request held."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(',', ':')).encode()


def error_response(e: RequestError) -> ErrorJSONResponse:
    return ErrorJSONResponse(e.body(), status_code=e.status)


def install_error_handlers(app: FastAPI, count: Callable[[str], None]):
    """`count(outcome)` is called for every request rejected as invalid (400, 413: 'invalid') and
    for one whose client left before its body was in ('abort', as a client that leaves later)."""

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, e: RequestError):
        if e.code == CLIENT_DISCONNECTED:
            count('abort')
        elif e.status in (400, 413):
            count('invalid')
        return error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        return ErrorJSONResponse(error_body(str(e.detail)), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, e: Exception):
        logger.error('%s %s failed: %r', request.method, request.url.path, e)  # uvicorn: the trace
        return ErrorJSONResponse(error_body('internal server error; the server log has the '
                                            'details', 'internal_error', code='internal_error'),
                                 status_code=500)
