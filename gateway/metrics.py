"""GET /metrics: Prometheus' text exposition format, written by hand (it is a
few lines, and a dependency would be more)."""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Callable
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.admission import WORK
from gateway.health import served_name

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


LOADED = {"loaded": 1, "loading": 0.5, "unloading": 0, "unloaded": 0}


class Metrics:
    def __init__(self) -> None:
        self.requests: Counter[tuple[str, int]] = Counter()
        self.time_to_first_token = Histogram()
        self.inter_token_latency = Histogram()
        self.prompt_tokens = 0
        self.generation_tokens = 0

    def render(self, link: dict, workers: list[dict], restarts: int, ledger: dict | None = None) -> str:
        """link: the link's own state (health.worker_status); workers: one
        entry per connected worker (health.workers_status); restarts: the
        supervised workers' restarts, all models; ledger: the pool's
        (ModelPool.ledger), when `mlxd serve` runs models."""
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
            "# HELP mlxd_worker_ready Whether some worker can take requests.",
            "# TYPE mlxd_worker_ready gauge",
            f"mlxd_worker_ready {int(link.get('ready', False))}",
        ]
        for name, value in (("mlxd_workers_lost_total", link.get("workers_lost", 0)),
                            ("mlxd_requests_resumed_total", link.get("requests_resumed", 0)),
                            ("mlxd_worker_restarts_total", restarts)):
            lines += [f"# TYPE {name} counter", f"{name} {value}"]
        # Each worker's own numbers, labelled with its model and pid: with several
        # models (or replicas) one unlabelled number would describe one worker only.
        for name, kind, help_text, read in WORKER_SERIES:
            samples = [(w, value) for w in workers if (value := read(w)) is not None]
            if samples:
                lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
                lines += [f'{name}{{model="{label(served_name(w))}",pid="{w["pid"]}"}} {value}' for w, value in samples]
        if ledger is not None:
            lines += ["# HELP mlxd_memory_budget_bytes The pool's memory budget (--memory-budget).",
                      "# TYPE mlxd_memory_budget_bytes gauge", f"mlxd_memory_budget_bytes {ledger['budget']}",
                      "# HELP mlxd_memory_charged_bytes What the ledger charges each loaded model, by part.",
                      "# TYPE mlxd_memory_charged_bytes gauge"]
            lines += [f'mlxd_memory_charged_bytes{{model="{label(name)}",part="{part}"}} {value}'
                      for name, model in ledger["models"].items()
                      for part, value in model.get("memory", {}).items() if part not in ("total", "here")]
            lines += ["# HELP mlxd_model_loaded Whether a model is loaded (1), loading (0.5), "
                      "or unloading or unloaded (0).",
                      "# TYPE mlxd_model_loaded gauge"]
            lines += [f'mlxd_model_loaded{{model="{label(name)}"}} {LOADED[model["status"]]}'
                      for name, model in ledger["models"].items()]
            lines += ["# HELP mlxd_requests_waiting_for_memory Requests waiting for the running ones to leave "
                      "room for their KV state.",
                      "# TYPE mlxd_requests_waiting_for_memory gauge"]
            lines += [f'mlxd_requests_waiting_for_memory{{model="{label(name)}"}} {model["waiting_for_memory"]}'
                      for name, model in ledger["models"].items()]
        return "\n".join(lines) + "\n"


def _field(part: str, key: str) -> Callable[[dict], int | None]:
    """A number from a worker entry's `part` (its prefix_cache, its memory), None where it has none."""
    return lambda worker: worker[part].get(key, 0) if part in worker else None


# (name, type, help, the value in a worker's /health entry). A worker's totals
# start again at 0 when it restarts (under a new pid): counters, as Prometheus reads them.
WORKER_SERIES: list[tuple[str, str, str, Callable[[dict], Any]]] = [
    ("mlxd_worker_up", "gauge", "A connected worker, 1 when it can take requests.",
     lambda w: int(w["ready"])),
    ("mlxd_worker_epoch", "gauge", "The worker's epoch (its start).", lambda w: w["epoch"]),
    ("mlxd_worker_requests_running", "gauge", "Requests in the worker's batch.", lambda w: w["running"]),
    ("mlxd_worker_requests_waiting", "gauge", "Requests the worker holds that are not prefilled yet.",
     lambda w: w["waiting"]),
    ("mlxd_worker_steps_total", "counter", "The worker's engine steps.", lambda w: w["steps"]),
    ("mlxd_prefix_cache_lookups_total", "counter", "Prompts looked up in the prefix cache.",
     _field("prefix_cache", "lookups")),
    ("mlxd_prefix_cache_hits_total", "counter", "Prompts that reused cached KV state (hits / lookups: the hit rate).",
     _field("prefix_cache", "hits")),
    ("mlxd_prefix_cache_cached_tokens_total", "counter",
     "Prompt tokens whose KV state was reused, from RAM or disk.", _field("prefix_cache", "cached_tokens")),
    ("mlxd_prefix_cache_disk_tokens_total", "counter",
     "Prompt tokens whose KV state was read back from disk (within cached_tokens).",
     _field("prefix_cache", "disk_tokens")),
    ("mlxd_prefix_cache_disk_hits_total", "counter", "Prompts that read KV state back from disk.",
     _field("prefix_cache", "disk_hits")),
    ("mlxd_prefix_cache_prefilled_tokens_total", "counter", "Prompt tokens computed: nothing cached held them.",
     _field("prefix_cache", "prefilled_tokens")),
    ("mlxd_prefix_cache_bytes", "gauge", "KV state the prefix cache holds in RAM.", _field("prefix_cache", "bytes")),
    ("mlxd_prefix_cache_disk_bytes", "gauge", "KV state the prefix cache's disk tier holds.",
     _field("prefix_cache", "disk_bytes")),
    ("mlxd_prefix_cache_disk_budget_bytes", "gauge",
     "What the disk tier may hold now: --prefix-cache-disk-bytes, less while its disk is full.",
     _field("prefix_cache", "disk_budget")),
    ("mlxd_image_feature_cache_hits_total", "counter", "Requests whose images skipped the vision tower.",
     _field("prefix_cache", "image_hits")),
    ("mlxd_image_feature_cache_bytes", "gauge", "Image features kept for reuse.", _field("prefix_cache", "image_bytes")),
    ("mlxd_worker_memory_active_bytes", "gauge", "MLX's arrays in the worker.", _field("memory", "active")),
    ("mlxd_worker_memory_peak_bytes", "gauge", "The most MLX held at once since the worker started.",
     _field("memory", "peak")),
    ("mlxd_worker_memory_cache_bytes", "gauge", "Freed buffers MLX keeps for reuse.", _field("memory", "cache")),
]


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
