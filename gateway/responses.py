"""The gateway's two response classes: a JSON body encoded by msgspec, and an SSE stream."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterable
from typing import Any

import msgspec
from starlette.responses import JSONResponse, StreamingResponse
from starlette.types import Receive, Scope, Send

_encoder = msgspec.json.Encoder()


class MsgspecResponse(JSONResponse):
    """Starlette's JSONResponse with msgspec's encoder (structs as they are,
    faster than the json module): one hook overridden."""

    def render(self, content: Any) -> bytes:
        return _encoder.encode(content)


class EventStream(StreamingResponse):
    """Server-sent events, and the generation they come from closed however the
    response ends: even when the client leaves before the first event, when
    the events were never iterated and so could not close it themselves."""

    def __init__(self, events: AsyncIterable[bytes], source: AsyncGenerator[Any]) -> None:
        super().__init__(
            events, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
        self._source = source

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._source.aclose()
