"""The benchmarks' streaming load generator: chat completions over HTTP/1.1.

It shares the machine with the server under test, so every cycle it spends
is a cycle the server does not get. An httpx client spent more CPU per token
than mlxd's gateway (0.10-0.20 ms against 0.07-0.12 ms, measured at 8-64
streams), so this one is an asyncio Protocol around httptools' C parser:
keep-alive connections, chunked or close-delimited bodies (mlx_lm.server
answers HTTP/1.0), SSE events split and decoded with msgspec. What it
measures is what the client sees: the time to the first chunk with text, the
gaps between chunks with text, and the tokens the server's usage reports.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httptools
import msgspec

MESSAGES = [{"role": "user", "content": "Write a long story about a lighthouse keeper and the sea."}]
# As clients commonly do: a server that has not accepted the connection by
# then (a full listen backlog) fails the request, rather than stall the run.
CONNECT_TIMEOUT_S = 10


@dataclass
class Result:
    tokens: int = 0
    wall: float = 0.0
    ttfts: list[float] = field(default_factory=list)
    itls: list[float] = field(default_factory=list)
    failures: int = 0
    first_tokens: list[float] = field(default_factory=list)  # the engine's, text or not

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall if self.wall else 0.0

    def add(self, other: Result) -> None:
        """Pool another run's figures into these."""
        self.tokens += other.tokens
        self.wall += other.wall
        self.ttfts += other.ttfts
        self.itls += other.itls
        self.failures += other.failures
        self.first_tokens += other.first_tokens


def pct(values: list[float], q: float) -> float:
    """The q-quantile of `values` (seconds), in milliseconds."""
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(int(q * len(values)), len(values) - 1)] * 1000


class _Chunk(msgspec.Struct):
    choices: list[dict] = []
    usage: dict | None = None


_decode_chunk = msgspec.json.Decoder(_Chunk).decode


class _Exchange(asyncio.Protocol):
    """One connection; one request at a time on it."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._parser: httptools.HttpResponseParser | None = None
        self._done: asyncio.Future | None = None
        self._buffer = b""
        self._on_event = None
        self.status = 0
        self._keep_alive = False

    def start(self, request: bytes, on_event) -> asyncio.Future:
        """Send `request`; the future is done when its response has ended."""
        self._parser = httptools.HttpResponseParser(self)
        self._done = asyncio.get_running_loop().create_future()
        self._buffer = b""
        self._on_event = on_event
        self.status = 0
        self._keep_alive = False
        self.transport.write(request)
        return self._done

    @property
    def reusable(self) -> bool:
        return not self.closed and self._keep_alive

    # asyncio.Protocol
    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._finish(e)

    def connection_lost(self, exc) -> None:
        self.closed = True
        # A close-delimited body (HTTP/1.0) ends here; anything else was cut short.
        self._finish(exc if exc or not self.status else None)

    # httptools callbacks
    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        now = time.perf_counter()
        self._buffer += body
        *events, self._buffer = self._buffer.split(b"\n\n")
        for event in events:
            if event.startswith(b"data: ") and event != b"data: [DONE]" and self._on_event(event[6:], now):
                self.closed = True  # the client hangs up
                self.transport.close()
                self._finish(None)
                return

    def on_message_complete(self) -> None:
        # Asked now: once the message is complete, the parser has forgotten the response's headers.
        self._keep_alive = self._parser.should_keep_alive()
        self._finish(None)

    def _finish(self, error) -> None:
        if self._done is not None and not self._done.done():
            if error is None and self.status == 200:
                self._done.set_result(None)
            else:
                self._done.set_exception(ConnectionError(error or f"HTTP {self.status}"))


class Client:
    """Keep-alive connections to one server, as many as are in use at once."""

    def __init__(self, url: str, timeout: float = 600) -> None:
        parts = urlsplit(url)
        self.host, self.port = parts.hostname, parts.port
        self.timeout = timeout
        self._idle: list[_Exchange] = []

    async def post_stream(self, path: str, body: dict, on_event) -> None:
        """POST `body`; call on_event(data, arrival time) for each SSE event.
        An on_event that returns True hangs up: the connection is closed then."""
        payload = msgspec.json.encode(body)
        request = (f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json\r\n"
                   f"Content-Length: {len(payload)}\r\n\r\n").encode() + payload
        while self._idle and self._idle[-1].closed:
            self._idle.pop()
        if self._idle:
            exchange = self._idle.pop()
        else:
            connecting = asyncio.get_running_loop().create_connection(_Exchange, self.host, self.port)
            _, exchange = await asyncio.wait_for(connecting, CONNECT_TIMEOUT_S)
        try:
            await asyncio.wait_for(exchange.start(request, on_event), self.timeout)
        except BaseException:
            exchange.transport.close()
            raise
        if exchange.reusable:
            self._idle.append(exchange)
        else:
            exchange.transport.close()

    def close(self) -> None:
        for exchange in self._idle:
            exchange.transport.close()
        self._idle.clear()


async def one_request(client: Client, model: str, tokens: int, extra: dict, result: Result) -> None:
    """One streamed chat completion of `tokens` tokens, recorded into `result`."""
    body = {"model": model, "messages": MESSAGES, "max_tokens": tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **extra}
    started = time.perf_counter()
    last = None
    chunks = 0
    usage = None

    def on_event(data: bytes, now: float) -> None:
        nonlocal last, chunks, usage
        chunk = _decode_chunk(data)
        usage = chunk.usage or usage
        if not chunk.choices or not chunk.choices[0].get("delta", {}).get("content"):
            return
        if last is None:
            result.ttfts.append(now - started)
        else:
            result.itls.append(now - last)
        last = now
        chunks += 1

    try:
        await client.post_stream("/v1/chat/completions", body, on_event)
    except (OSError, ConnectionError, TimeoutError, msgspec.DecodeError):
        result.failures += 1
        return
    # Tokens as the server counts them: a token can end mid-character and
    # arrive in the next chunk, so chunks undercount (by a third on a random model).
    result.tokens += usage["completion_tokens"] if usage else chunks


async def load(url: str, model: str, concurrency: int, requests: int, tokens: int, extra: dict) -> Result:
    """`requests` requests from `concurrency` users, after a warm-up round at that concurrency."""
    result = Result()
    client = Client(url)
    try:
        # The first calls of a new batch shape compile kernels.
        await asyncio.gather(*(one_request(client, model, 8, extra, Result()) for _ in range(concurrency)))
        remaining = requests

        async def user() -> None:
            nonlocal remaining
            while remaining > 0:
                remaining -= 1
                await one_request(client, model, tokens, extra, result)

        begin = time.perf_counter()
        await asyncio.gather(*(user() for _ in range(concurrency)))
        result.wall = time.perf_counter() - begin
    finally:
        client.close()
    return result
