"""Admission: how many requests may be in flight, in total and per client."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from gateway.errors import APIError


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
