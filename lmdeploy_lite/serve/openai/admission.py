"""How many generation requests the server holds at once (`--max-concurrent-requests`, lmdeploy's
name): one past the limit is answered 429 with `Retry-After` before its body is read, so a burst
of clients cannot queue unbounded work; the others keep running. A request counts from its
arrival until its response has been sent in full (a stream: until its last event) or its client
has gone, however it ends: the count is kept around the ASGI call, so no path can leak it."""
from __future__ import annotations

from lmdeploy_lite.serve.openai.errors import RequestError, error_response

GENERATION_PATHS = ('/v1/completions', '/v1/chat/completions')
RETRY_AFTER_S = 1


class ConcurrencyLimitMiddleware:
    """429 for a POST to a generation path while `limit` of them are in flight. `workers`: the
    front-end processes the server's limit is split among (this one holds `limit` of it)."""

    def __init__(self, app, limit: int, workers: int = 1):   # ServerLimits checked limit >= 1
        self.app, self.limit = app, limit
        self.flag = (f'--max-concurrent-requests {limit}' if workers == 1 else
                     f'its share of --max-concurrent-requests over {workers} front-end processes')
        self.in_flight = 0                   # one event loop: no lock needed

    async def __call__(self, scope, receive, send):
        if (scope['type'] != 'http' or scope['method'] != 'POST'
                or scope['path'] not in GENERATION_PATHS):
            await self.app(scope, receive, send)
            return
        if self.in_flight >= self.limit:
            error = RequestError(f'{self.in_flight} requests are in flight, the most this server '
                                 f'holds ({self.flag}); retry after {RETRY_AFTER_S} s',
                                 code='too_many_requests', status=429, type='rate_limit_error')
            response = error_response(error)
            response.headers['Retry-After'] = str(RETRY_AFTER_S)
            await response(scope, receive, send)
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1
