"""GET /metrics: Prometheus' text exposition format, written by hand (it is a
few lines, and a dependency would be more)."""

from __future__ import annotations

import bisect
from collections import Counter

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.admission import WORK

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Histogram:
    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value

    def lines(self, name: str) -> list[str]:
        out, total = [], 0
        for bound, count in zip((*self.buckets, float("inf")), self.counts):
            total += count
            le = "+Inf" if bound == float("inf") else repr(bound)
            out.append(f'{name}_bucket{{le="{le}"}} {total}')
        out += [f"{name}_sum {self.sum}", f"{name}_count {total}"]
        return out


LOADED = {"loaded": 1, "loading": 0.5, "unloaded": 0}


class Metrics:
    def __init__(self) -> None:
        self.requests: Counter[tuple[str, int]] = Counter()
        self.time_to_first_token = Histogram()
        self.inter_token_latency = Histogram()
        self.prompt_tokens = 0
        self.generation_tokens = 0

    def render(self, worker: dict, supervisor: dict | None, ledger: dict | None = None) -> str:
        """ledger: the pool's (ModelPool.ledger), when `mlxd serve` runs models."""
        lines = [
            "# HELP mlxd_requests_total HTTP requests by endpoint and status.",
            "# TYPE mlxd_requests_total counter",
            *(f'mlxd_requests_total{{endpoint="{path}",status="{status}"}} {n}'
              for (path, status), n in sorted(self.requests.items())),
            "# HELP mlxd_time_to_first_token_seconds From request arrival to the first generated text.",
            "# TYPE mlxd_time_to_first_token_seconds histogram",
            *self.time_to_first_token.lines("mlxd_time_to_first_token_seconds"),
            "# HELP mlxd_inter_token_latency_seconds Between successive deliveries of a request's text.",
            "# TYPE mlxd_inter_token_latency_seconds histogram",
            *self.inter_token_latency.lines("mlxd_inter_token_latency_seconds"),
            "# TYPE mlxd_prompt_tokens_total counter",
            f"mlxd_prompt_tokens_total {self.prompt_tokens}",
            "# TYPE mlxd_generation_tokens_total counter",
            f"mlxd_generation_tokens_total {self.generation_tokens}",
        ]
        gauges = {
            "mlxd_worker_ready": int(worker.get("ready", False)),
            "mlxd_requests_running": worker.get("running", 0),
            "mlxd_requests_waiting": worker.get("waiting", 0),
            "mlxd_worker_steps": worker.get("steps", 0),
            "mlxd_worker_epoch": worker.get("epoch", 0),
            "mlxd_prefix_cache_hits": worker.get("prefix_cache", {}).get("hits", 0),
            "mlxd_prefix_cache_bytes": worker.get("prefix_cache", {}).get("bytes", 0),
            "mlxd_prefix_cache_cached_tokens": worker.get("prefix_cache", {}).get("cached_tokens", 0),
            "mlxd_image_feature_cache_hits": worker.get("prefix_cache", {}).get("image_hits", 0),
            "mlxd_image_feature_cache_bytes": worker.get("prefix_cache", {}).get("image_bytes", 0),
            "mlxd_prefix_cache_disk_tokens": worker.get("prefix_cache", {}).get("disk_tokens", 0),
            "mlxd_prefix_cache_disk_hits": worker.get("prefix_cache", {}).get("disk_hits", 0),
            "mlxd_prefix_cache_disk_bytes": worker.get("prefix_cache", {}).get("disk_bytes", 0),
            "mlxd_prefix_cache_lookups": worker.get("prefix_cache", {}).get("lookups", 0),
            "mlxd_prefix_cache_prefilled_tokens": worker.get("prefix_cache", {}).get("prefilled_tokens", 0),
        }
        counters = {
            "mlxd_workers_lost_total": worker.get("workers_lost", 0),
            "mlxd_requests_resumed_total": worker.get("requests_resumed", 0),
            "mlxd_worker_restarts_total": (supervisor or {}).get("restarts", 0),
        }
        for name, value in gauges.items():
            lines += [f"# TYPE {name} gauge", f"{name} {value}"]
        for name, value in counters.items():
            lines += [f"# TYPE {name} counter", f"{name} {value}"]
        if ledger is not None:
            lines += ["# HELP mlxd_memory_budget_bytes The pool's memory budget (--memory-budget).",
                      "# TYPE mlxd_memory_budget_bytes gauge", f"mlxd_memory_budget_bytes {ledger['budget']}",
                      "# HELP mlxd_memory_charged_bytes What the ledger charges each loaded model, by part.",
                      "# TYPE mlxd_memory_charged_bytes gauge"]
            lines += [f'mlxd_memory_charged_bytes{{model="{label(name)}",part="{part}"}} {value}'
                      for name, model in ledger["models"].items()
                      for part, value in model.get("memory", {}).items() if part != "total"]
            lines += ["# HELP mlxd_model_loaded Whether a model is loaded (1), loading (0.5) or unloaded (0).",
                      "# TYPE mlxd_model_loaded gauge"]
            lines += [f'mlxd_model_loaded{{model="{label(name)}"}} {LOADED[model["status"]]}'
                      for name, model in ledger["models"].items()]
        return "\n".join(lines) + "\n"


def label(value: str) -> str:
    """A label value as Prometheus' text format writes it: a quote, a backslash
    or a newline in a model's name would make the whole scrape unreadable."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class RequestCounter:
    """ASGI middleware: counts every HTTP request by route and status."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500

        async def recording_send(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, recording_send)
        finally:
            # The route's template, never the path the client wrote: that would let anyone (a 401 too)
            # write into the metrics and add a counter per path, without end. A request refused before
            # routing (a key, the in-flight limits) has none: an API's own path, as its route would be.
            route = getattr(scope.get("route"), "path", "") or (scope["path"] if scope["path"] in WORK else "")
            endpoint = route if route.startswith(("/v1/", "/api/")) else "other"
            self.metrics.requests[(endpoint, status)] += 1
