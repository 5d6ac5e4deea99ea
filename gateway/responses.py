"""The gateway's two response classes: a JSON body encoded by msgspec, and an SSE stream;
and the times and lines they carry."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterable
from datetime import datetime, timezone
from typing import Any

import msgspec
from starlette.responses import JSONResponse, StreamingResponse
from starlette.types import Receive, Scope, Send

log = logging.getLogger("mlxd.gateway.api")
_encoder = msgspec.json.Encoder()
SSE = "text/event-stream"
NDJSON = "application/x-ndjson"

NEVER = "9999-12-31T23:59:59.999999Z"  # the latest time `timestamp` writes (a model kept loaded for good)
LAST_MOMENT = datetime.max.replace(tzinfo=timezone.utc).timestamp()


def timestamp(at: float | None = None) -> str:
    """RFC 3339 in UTC with its fraction of a second, as Ollama and Anthropic write
    their times (clients such as OllamaKit read no time without one); NEVER for a
    time past what it can write."""
    if at is not None and not at < LAST_MOMENT:
        return NEVER
    moment = datetime.now(timezone.utc) if at is None else datetime.fromtimestamp(at, timezone.utc)
    return moment.isoformat(timespec="microseconds").replace("+00:00", "Z")


# JSON lets these stand unescaped inside a string, but many line readers
# (httpx's iter_lines, Python's str.splitlines) end a line at them, cutting an
# event's data in two. Outside a string they cannot occur in encoded JSON.
_LINE_BREAKS_IN_STRINGS = ((b"\xc2\x85", b"\\u0085"), (b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029"))


def json_line(payload: Any) -> bytes:
    """The payload as JSON that no line reader cuts, whatever text it carries."""
    data = _encoder.encode(payload)
    for raw, escaped in _LINE_BREAKS_IN_STRINGS:
        if raw in data:
            data = data.replace(raw, escaped)
    return data


def sse_event(payload: Any, name: str | None = None) -> bytes:
    """One server-sent event: an optional `event:` line and the payload as JSON
    on one `data:` line."""
    head = b"event: " + name.encode() + b"\n" if name else b""
    return head + b"data: " + json_line(payload) + b"\n\n"


class MsgspecResponse(JSONResponse):
    """Starlette's JSONResponse with msgspec's encoder (structs as they are,
    faster than the json module): one hook overridden."""

    def render(self, content: Any) -> bytes:
        return _encoder.encode(content)


class EventStream(StreamingResponse):
    """Server-sent events (or NDJSON lines), and the generation they come from
    closed however the response ends: even when the client leaves before the
    first event, when the events were never iterated and so could not close
    it themselves.

    A client that hangs up cancels the stream. Starlette watches for that with
    an anyio task group per response, which cost a tenth of a streamed
    request's CPU in the gateway; one asyncio task does the same here. So
    does `cut`, for a client that stopped reading.
    """

    def __init__(self, events: AsyncIterable[bytes], source: AsyncGenerator[Any], media_type: str = SSE) -> None:
        """media_type: SSE, or NDJSON for Ollama's streams (one JSON object a line)."""
        super().__init__(
            events, media_type=media_type, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
        self._source = source
        self._streaming: asyncio.Task | None = None  # the task writing it, while it does
        self._ended_here = False  # cancelled by its client's hang-up or a cut, not by the server stopping

    def cut(self) -> None:
        """End the response whose writer waits at a send to a client that
        reads no more (its request has ended, but the error queued for it is
        never taken): its request's slot and state are given back, and uvicorn
        closes the connection. A no-op once the response has ended."""
        if self._streaming is not None:
            log.warning("a stream's client stopped reading after its request ended: its response is cut")
            self._end_here(self._streaming)

    def _end_here(self, streaming: asyncio.Task) -> None:
        if not self._ended_here:  # once: a hang-up during a cut is the same end
            self._ended_here = True
            streaming.cancel()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        streaming = asyncio.current_task()
        assert streaming is not None
        self._streaming = streaming

        async def hang_up() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            self._end_here(streaming)

        watcher = asyncio.create_task(hang_up())
        try:
            await self.stream_response(send)
        except asyncio.CancelledError:
            if not self._ended_here or streaming.uncancel() > 0:
                raise  # (also) cancelled from outside: the server is stopping
        finally:
            self._streaming = None
            watcher.cancel()
            await self._source.aclose()
