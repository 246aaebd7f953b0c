"""What one TCP connection may hold of the server (`HttpLimits`): uvicorn's HTTP protocol
(httptools where installed, else h11) with deadlines, so that no client can keep a connection, a
file descriptor or a request open by being slow or silent (slowloris), and a cap on open
connections.

- A new connection, and one between requests (keep-alive), is closed after `idle_timeout_s`
  without a byte.
- A request's headers must arrive in full within `header_timeout_s` of its first byte (408, then
  closed): a deadline, not an inactivity timer, so a byte every second does not extend it.
- Its body must arrive in full within `body_timeout_s` of its headers; past that the connection
  closes and the request ends as a client that went away.
- Past `max_connections` open connections, a new one is closed at once; the deadlines above close
  the idle and slow ones within seconds, so a flood cannot lock the others out for long.

`bind_socket` takes host:port before the model loads, so a taken port fails in a second, not after.
"""
from __future__ import annotations

import dataclasses
import errno
import logging
import resource
import socket

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:                    # httptools is not installed: h11 only
    HttpToolsProtocol = None

logger = logging.getLogger('lmdeploy_lite.serve')

REQUEST_TIMEOUT = (b'HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n'
                   b'connection: close\r\ncontent-length: %d\r\n\r\n%s')
RESERVED_FDS = 128            # file descriptors kept for the engine, the model files, the logs
BIND_HINTS = {errno.EADDRINUSE: 'another process listens there; stop it or choose another '
                                'port (--server-port)',
              errno.EADDRNOTAVAIL: 'not an address of this host (--server-name)',
              errno.EACCES: 'ports below 1024 need privileges; choose another (--server-port)'}


class CannotListen(OSError):
    """host:port cannot be bound; the message names it and what to do."""


def bind_socket(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """A socket bound to host:port as uvicorn binds one (SO_REUSEADDR; IPv6 when the host has a
    ':'), not yet listening: until the server starts, a client is refused rather than left
    waiting. `reuse_port`: SO_REUSEPORT too (where the system has it), so that other sockets of
    this user may bind the same address, each with its own share of the connections (front-end
    workers, workers.py). Raises CannotListen."""
    sock = socket.socket(socket.AF_INET6 if ':' in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port and hasattr(socket, 'SO_REUSEPORT'):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except (OSError, OverflowError) as e:       # OverflowError: a port past 65535
        sock.close()
        reason = getattr(e, 'strerror', None) or str(e)
        hint = BIND_HINTS.get(getattr(e, 'errno', None))
        raise CannotListen(f'cannot listen on {host}:{port}: {reason}'
                           + (f'; {hint}' if hint else '')) from None
    return sock


def default_max_connections() -> int:
    """Open connections the process can hold: its file-descriptor soft limit less a reserve."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return 1024 if soft == resource.RLIM_INFINITY else max(16, min(1024, soft - RESERVED_FDS))


@dataclasses.dataclass(frozen=True)
class HttpLimits:
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    idle_timeout_s: float = 15.0
    max_connections: int = dataclasses.field(default_factory=default_max_connections)

    def __post_init__(self):
        for name in ('header_timeout_s', 'body_timeout_s', 'idle_timeout_s'):
            if not getattr(self, name) > 0:
                raise ValueError(f'{name}={getattr(self, name)}: must be > 0')
        if self.max_connections < 1:
            raise ValueError(f'max_connections={self.max_connections}: must be >= 1')

    def protocol(self, parser: str = 'auto') -> type:
        """uvicorn's `http` protocol class with these limits (uvicorn builds one per connection):
        over httptools where it is installed ('auto'; the C parser, and a response body written
        in one call: ~15% of the server's CPU per streamed chunk), else over h11."""
        if parser == 'auto':
            parser = 'h11' if HttpToolsProtocol is None else 'httptools'
        if parser == 'httptools' and HttpToolsProtocol is None:
            raise ValueError("parser='httptools': httptools is not installed")
        base = {'h11': LimitedH11Protocol, 'httptools': LimitedHttpToolsProtocol}[parser]
        return type(base.__name__, (base,), {'limits': self})


class Deadlines:
    """The deadlines of `limits` on one connection, over either of uvicorn's protocols: each
    says which phase its request is in (`_enter`); uvicorn's keep-alive timer is the idle
    timeout between requests (`timeout_keep_alive`, set from the same limits)."""
    limits: HttpLimits
    _deadline = None                   # the TimerHandle of the phase below, if any
    _phase = None                      # 'idle', 'header' or 'body'

    def connection_made(self, transport):
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            logger.warning('%d connections open (--max-connections %d): closing a new one',
                           len(self.connections) - 1, self.limits.max_connections)
            transport.close()
            return
        self._arm('idle')

    def connection_lost(self, exc):
        self._disarm()
        super().connection_lost(exc)

    def on_response_complete(self):
        self._disarm()                 # uvicorn's keep-alive timer takes over
        super().on_response_complete()

    def _enter(self, phase: str | None):
        """Arm the deadline of `phase` once (None: the request is in; the response is the
        app's)."""
        if self.transport.is_closing():
            return
        if phase is None:
            self._disarm()
        elif self._phase != phase:
            self._arm(phase)

    def _arm(self, phase: str):
        self._disarm()
        self._phase = phase
        self._deadline = self.loop.call_later(getattr(self.limits, f'{phase}_timeout_s'),
                                              self._expire, phase)

    def _disarm(self):
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = self._phase = None

    def _expire(self, phase: str):
        self._deadline = self._phase = None
        if self.transport.is_closing():
            return
        if phase == 'header':
            body = (b'{"error":{"message":"the request headers did not arrive within %gs",'
                    b'"type":"invalid_request_error","code":"request_timeout"}}'
                    % self.limits.header_timeout_s)
            self.transport.write(REQUEST_TIMEOUT % (len(body), body))
        elif phase == 'body':
            logger.warning('%s: the request body did not arrive within %g s; closing',
                           self.client, self.limits.body_timeout_s)
        self.transport.close()


class LimitedH11Protocol(Deadlines, H11Protocol):
    def data_received(self, data: bytes):
        super().data_received(data)
        state = self.conn.their_state  # IDLE with bytes buffered: a request's headers pending
        self._enter('header' if state is h11.IDLE else 'body' if state is h11.SEND_BODY else None)


# without httptools the class is never handed out (`HttpLimits.protocol`): its base is a stand-in
class LimitedHttpToolsProtocol(Deadlines, HttpToolsProtocol or H11Protocol):
    def on_message_begin(self):
        super().on_message_begin()
        self._enter('header')

    def on_headers_complete(self):
        super().on_headers_complete()
        self._enter('body')

    def on_message_complete(self):
        super().on_message_complete()
        self._enter(None)
