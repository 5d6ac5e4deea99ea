"""The gateway under uvicorn, with mlxd's way of stopping (drain, then stop)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
from collections.abc import Sequence

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.app import create_app
from gateway.settings import GatewaySettings, PoolSettings
from protocol.worker_settings import WorkerSettings


class DrainingServer(uvicorn.Server):
    """uvicorn, with mlxd's way of stopping.

    The first SIGTERM/SIGINT drains: open streams get --drain-s to finish and
    are then ended cleanly, so shutdown never hangs; a second ends them at
    once. Either way the lifespan shuts down in order (the worker too) and the
    process exits 0, with no re-raised signal and so no traceback. `fail`
    stops serving when it cannot start, and the process then exits 1.
    """

    def __init__(self, config: uvicorn.Config, app) -> None:
        super().__init__(config)
        self._app = app
        self.failure: str | None = None

    @contextlib.contextmanager
    def capture_signals(self):
        handled = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig, frame) -> None:
        if self.should_exit:
            self._app.state.stop_now()
        else:
            self._app.state.begin_drain()
            self.should_exit = True

    def fail(self, reason: str) -> None:
        logging.getLogger("mlxd.gateway").error("%s", reason)
        self.failure = reason
        self.should_exit = True


KEEP_ALIVE_S = 30  # how long an idle connection is kept for the client's next request

# uvicorn's C parser takes a request line and headers of any length, copying
# them as they grow, on the event loop; h11 stops at 16 KiB.
MAX_HEADER_BYTES = 64 * 1024
_TOO_LARGE = b"HTTP/1.1 431 Request Header Fields Too Large\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"


def request_deadlines(timeout_s: float) -> type[HttpToolsProtocol]:
    """uvicorn's HTTP protocol, closing a connection whose request does not
    come whole in time: its headers within `timeout_s` of the connection's
    opening or of the request's first byte, and at most MAX_HEADER_BYTES of
    them (a 431 beyond); its body within twice `timeout_s` of its headers
    (the app answers 408 at `timeout_s` to a body it reads). uvicorn
    waits for them for good: a host on the network, with no key (keys are
    read from the headers), could hold every file descriptor the gateway may
    open with connections that never finish a request, or one whose body
    never ends after its answer. Between requests a connection has
    `timeout_s` too once it sends anything (uvicorn's keep-alive timer stops
    at any byte, even the blank line that begins no request)."""

    class RequestDeadlines(HttpToolsProtocol):
        _deadline: asyncio.TimerHandle | None = None
        # Received since a request began, until its headers are whole: counted from the read after the
        # one it began in (which may hold the end of the request before it), so up to a read more.
        _header_bytes: int | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm(timeout_s)

        def data_received(self, data: bytes) -> None:
            counting = self._header_bytes is not None
            super().data_received(data)
            if counting and self._header_bytes is not None:  # the headers are not whole yet, after this data too
                self._header_bytes += len(data)
                if self._header_bytes > MAX_HEADER_BYTES and not self.transport.is_closing():
                    self.transport.write(_TOO_LARGE)
                    self.transport.close()
            if (self.cycle is None or self.cycle.response_complete) and self.timeout_keep_alive_task is None:
                self._arm(timeout_s)  # between requests, and uvicorn's keep-alive timer stopped by these bytes

        def on_response_complete(self) -> None:
            super().on_response_complete()
            cycle = self.cycle  # the latest request read: the only one whose body may not be whole
            if not self.pipeline and cycle is not None and not cycle.response_complete and cycle.more_body:
                self._arm(2 * timeout_s)  # it was pipelined and starts now: its body, unread till now, has its time

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._header_bytes = 0
            self._arm(timeout_s)

        def on_headers_complete(self) -> None:
            self._disarm()
            self._header_bytes = None
            super().on_headers_complete()
            if not self.pipeline:  # a pipelined request's body waits, unread, for the one before it to end
                self._arm(2 * timeout_s)

        def on_message_complete(self) -> None:
            self._disarm()
            super().on_message_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self, after_s: float) -> None:
            if self._deadline is None:
                self._deadline = self.loop.call_later(after_s, self.transport.close)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

    return RequestDeadlines


def listening_socket(host: str, port: int) -> socket.socket:
    """The HTTP port, taken before anything starts (uvicorn would take it
    after the models' workers, then exit 3 with its own log line); SystemExit
    saying why it cannot be."""
    # IPPROTO_TCP named: asyncio sets TCP_NODELAY only on connections whose socket says it is TCP
    # (without it, a response's last write waited on a delayed ACK: /health took 45 ms under load).
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise SystemExit(f"mlxd: cannot listen on {host}:{port}: {e.strerror}") from None
    return sock


def run_gateway(settings: GatewaySettings, worker_settings: Sequence[WorkerSettings] = (),
                pool_settings: PoolSettings | None = None) -> int:
    listening = listening_socket(settings.host, settings.port)
    app = create_app(settings, worker_settings, pool_settings)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=False,
        # A client without a key is its connection's address (per-client limits, who may cancel a
        # request or read a stored response): a header must not choose it, as X-Forwarded-For from
        # loopback, which uvicorn trusts by default, would.
        proxy_headers=False,
        # The standard asyncio loop: under uvloop the gateway spent more CPU
        # per streamed token (0.072 s per 1000 against 0.05-0.06) and served
        # fewer tokens/s (tests/bench/cpu_share.py, 2026-11-25).
        loop="asyncio",
        # uvicorn's C parser: measured 3-13% less gateway CPU per streamed token than h11.
        http=request_deadlines(settings.body_timeout_s),
        # A backstop only: the drain itself ends every stream after drain_s.
        timeout_graceful_shutdown=int(settings.drain_s) + 3,
        # Longer than clients keep an idle connection for reuse (httpx and the SDKs on it 5 s, Node's
        # undici 4 s, aiohttp 15 s): at uvicorn's 5 s, a client reusing one as the server closed it got
        # "connection reset" (a test's /health after a long stream did, in CI).
        timeout_keep_alive=KEEP_ALIVE_S,
    )
    server = DrainingServer(config, app)
    app.state.fail = server.fail
    try:
        server.run(sockets=[listening])
    finally:
        for supervisor in app.state.supervisors:
            if supervisor.process is not None and supervisor.process.returncode is None:
                # Should the orderly stop not have run (uvicorn failed to start), do not leave the worker behind.
                os.kill(supervisor.process.pid, signal.SIGTERM)
    if server.failure is not None:
        print(f"mlxd: error: {server.failure}", file=sys.stderr)
        return 1
    return 0
