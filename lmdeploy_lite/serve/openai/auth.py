"""Who may talk to the server. API keys: where they come from (--api-keys, --api-keys-file, the
LMDEPLOY_LITE_API_KEYS environment variable) and the ASGI middleware that asks for one on every
path but /health — /metrics, /docs and /openapi.json included — before anything reads the
request body. The Host guard: a server bound to a loopback address answers only requests whose
Host header names a loopback host (or one of --allowed-hosts), so that a web page cannot reach it
through a DNS name that resolves to 127.0.0.1 (DNS rebinding)."""
from __future__ import annotations

import ipaddress
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
    found = _stripped(keys or ())
    if keys_file is not None:
        try:
            with open(keys_file, encoding='utf-8') as f:
                in_file = [key for key in _stripped(f) if not key.startswith('#')]
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f'api_keys_file={keys_file!r}: cannot be read ({e})') from None
        if not in_file:
            raise ValueError(f'api_keys_file={keys_file!r}: holds no key (one key per line)')
        found += in_file
    return list(dict.fromkeys(found + _stripped(environ.pop(API_KEYS_ENV, '').split(','))))


def _stripped(keys) -> list[str]:
    return [key.strip() for key in keys if key.strip()]


class APIKeyMiddleware:
    """401 for a request to any path but OPEN_PATHS without "Authorization: Bearer <key>"."""

    def __init__(self, app, api_keys: list[str]):
        self.app, self.keys = app, [k.encode() for k in api_keys]

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


def is_loopback(host: str) -> bool:
    """A loopback address or name ('127.0.0.1', '::1', 'localhost', '[::1]')."""
    host = host.strip('[]').lower()
    try:
        return (host == 'localhost' or host.endswith('.localhost')
                or ipaddress.ip_address(host).is_loopback)
    except ValueError:
        return False


def host_name(header: str) -> str:
    """The host of a Host header, without its port ('[::1]:80' -> '::1')."""
    header = header.strip().lower()
    if header.startswith('['):
        return header[1:header.find(']')] if ']' in header else header
    return header.rsplit(':', 1)[0] if header.count(':') == 1 else header


class HostGuardMiddleware:
    """421 for a request whose Host is neither a loopback host nor one of `allowed_hosts`: for
    a server bound to a loopback address (`create_app`'s `bound_host`)."""

    def __init__(self, app, allowed_hosts: tuple[str, ...] = ()):
        self.app, self.allowed = app, set(_stripped(h.lower() for h in allowed_hosts))

    async def __call__(self, scope, receive, send):
        if scope['type'] == 'http':
            host = host_name(Headers(scope=scope).get('host', ''))
            if not (is_loopback(host) or host in self.allowed):
                await error_response(RequestError(
                    f'Host: {host!r}: this server listens on a loopback address and answers only '
                    f'requests for a loopback host (localhost, 127.0.0.1, ::1); start it with '
                    f'--allowed-hosts {host or "NAME"} to accept this one',
                    code='misdirected_request', status=421))(scope, receive, send)
                return
        await self.app(scope, receive, send)
