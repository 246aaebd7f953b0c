"""API keys: where they come from (--api-keys, --api-keys-file, the LMDEPLOY_LITE_API_KEYS
environment variable) and the ASGI middleware that asks for one on every path but /health —
/metrics, /docs and /openapi.json included — before anything reads the request body."""
from __future__ import annotations

import os
import secrets

from starlette.datastructures import Headers

from lmdeploy_lite.serve.openai.errors import RequestError, error_response

API_KEYS_ENV = 'LMDEPLOY_LITE_API_KEYS'
OPEN_PATHS = ('/health',)


def load_api_keys(keys: list[str] | None = None, keys_file: str | None = None,
                  environ: dict | None = None) -> list[str]:
    """All keys given: on the command line, in `keys_file` (one per line; blank lines and lines
    starting with # skipped) and in LMDEPLOY_LITE_API_KEYS (comma-separated), which is removed
    from the environment once read so that worker processes do not inherit it."""
    environ = os.environ if environ is None else environ
    found = [k.strip() for k in keys or () if k.strip()]
    if keys_file is not None:
        try:
            with open(keys_file, encoding='utf-8') as f:
                in_file = [line.strip() for line in f
                           if line.strip() and not line.strip().startswith('#')]
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f'api_keys_file={keys_file!r}: cannot be read ({e})') from None
        if not in_file:
            raise ValueError(f'api_keys_file={keys_file!r}: holds no key (one key per line)')
        found += in_file
    found += [k.strip() for k in environ.pop(API_KEYS_ENV, '').split(',') if k.strip()]
    return list(dict.fromkeys(found))


class APIKeyMiddleware:
    """401 for a request to any path but OPEN_PATHS without "Authorization: Bearer <key>"."""

    def __init__(self, app, api_keys: list[str]):
        self.app = app
        self.keys = [k.encode() for k in api_keys]

    async def __call__(self, scope, receive, send):
        if scope['type'] == 'http' and scope['path'] not in OPEN_PATHS \
                and not self._authorized(scope):
            error = RequestError('missing or invalid API key: send "Authorization: Bearer <key>" '
                                 'with one of the keys the server was given',
                                 code='invalid_api_key', status=401)
            await error_response(error)(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _authorized(self, scope) -> bool:
        scheme, _, key = Headers(scope=scope).get('authorization', '').partition(' ')
        key_bytes = key.strip().encode('latin-1')             # header values are latin-1
        return scheme.lower() == 'bearer' and any(secrets.compare_digest(key_bytes, k)
                                                  for k in self.keys)
