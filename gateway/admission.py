"""Admission: how many requests may be in flight, in total and per client."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.errors import APIError, error_response


class Admission:
    """Requests in flight, in total and per client (API key, or address without keys)."""

    def __init__(self, total: int, per_client: int) -> None:
        self.limit_total = total
        self.limit_per_client = per_client
        self.total = 0
        self.by_client: Counter[str] = Counter()

    def admit(self, client_id: str) -> Callable[[], None]:
        """Count the request in; return the function that counts it out (once)."""
        if self.by_client[client_id] >= self.limit_per_client:
            raise APIError(
                429, f"too many requests in flight for this client (limit {self.limit_per_client})",
                type="requests", code="rate_limit_exceeded", headers={"Retry-After": "1"},
            )
        if self.total >= self.limit_total:
            raise APIError(
                503, f"the server is at its limit of {self.limit_total} requests in flight",
                type="service_unavailable", code="overloaded", headers={"Retry-After": "1"},
            )
        self.total += 1
        self.by_client[client_id] += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.total -= 1
                self.by_client[client_id] -= 1
                if not self.by_client[client_id]:
                    del self.by_client[client_id]

        return release


# The routes that make the server work (generate, embed, tokenize); a cancel,
# /api/show and the rest stay free, even for a client at its limit.
WORK = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses", "/v1/messages",
                  "/v1/messages/count_tokens", "/api/chat", "/api/generate", "/api/embed", "/api/embeddings"})


class Admitted:
    """ASGI middleware: a request for work is in flight from its arrival to its
    response's last byte, its body, images and prompt included: counted only
    once generating, a client could keep any number of slow bodies or
    many-image prompts going at once, past every limit."""

    def __init__(self, app: ASGIApp, admission: Admission) -> None:
        self.app = app
        self.admission = admission

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in WORK:
            return await self.app(scope, receive, send)
        try:
            release = self.admission.admit(scope["state"]["client_id"])
        except APIError as e:
            return await error_response(scope, e)(scope, receive, send)
        try:
            await self.app(scope, receive, send)
        finally:
            release()
