"""The ops page (GET /admin) and what it reads and does.

The page is one file (gateway/ops_page.html: its styles and script inline, no
CDN or font to fetch, as the LAN may be offline) that holds no state: it
reads GET /admin/state every few seconds, behind the same keys as every
/admin/* endpoint (gateway/security.py), and acts through the admin
endpoints. This module keeps what no other part of the gateway keeps: a
short history of throughput, time to first token and queue depth, and the
tail of the gateway's log.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass
from importlib.resources import files
from typing import Any

from starlette.requests import Request
from starlette.responses import HTMLResponse, Response

from gateway.health import workers_status
from gateway.responses import MsgspecResponse
from gateway.serving import PROMPTS_LOGGER, Serving
from gateway.supervisor import WorkerSupervisor, local_pids

SAMPLE_S = 2.0
SAMPLES_KEPT = 300  # ten minutes
LOG_LINES_KEPT = 200
# Lost workers stay on the page this long after their loss.
LOST_SHOWN_S = 300.0
# Everything the page needs is in it; it may talk only to this server.
CONTENT_SECURITY_POLICY = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                           "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
                           "frame-ancestors 'none'")


class LogTail(logging.Handler):
    """The gateway's latest log lines. Prompts and completions (in the log
    under --log-prompts) never reach it; keys reach no log."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: deque[dict[str, Any]] = deque(maxlen=LOG_LINES_KEPT)

    def emit(self, record: logging.LogRecord) -> None:
        if record.name == PROMPTS_LOGGER:
            return
        self.lines.append({"at": record.created, "level": record.levelname, "logger": record.name,
                           "message": record.getMessage()})


@dataclass
class Sample:
    at: float  # time.time()
    tokens_per_s: float
    ttft_ms: float | None  # the mean over the interval; None when no request started
    queue: int  # requests waiting: in the workers' queues, or for a worker
    running: int


class History:
    """A sample every SAMPLE_S seconds of what the plots show."""

    def __init__(self, serving: Serving) -> None:
        self.serving = serving
        self.samples: deque[Sample] = deque(maxlen=SAMPLES_KEPT)
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._sample(), name="mlxd-ops-history")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _sample(self) -> None:
        link, ttft = self.serving.link, self.serving.metrics.time_to_first_token
        last = (time.monotonic(), link.outputs.tokens_generated, ttft.sum, sum(ttft.counts))
        while True:
            await asyncio.sleep(SAMPLE_S)
            now = (time.monotonic(), link.outputs.tokens_generated, ttft.sum, sum(ttft.counts))
            elapsed, tokens, ttft_sum, started = (b - a for a, b in zip(last, now))
            last = now
            workers = link.workers.values()
            self.samples.append(Sample(
                at=time.time(),
                tokens_per_s=round(tokens / elapsed, 1),
                ttft_ms=round(ttft_sum / started * 1000, 1) if started else None,
                # Waiting in a worker, for one after a loss, or for a model to load or a worker to be ready.
                queue=sum(w.waiting for w in workers) + link.requests_waiting + self.serving.leasing,
                running=sum(w.vitals.running for w in workers),
            ))


# /admin/state holds the log's tail: kept in no cache (a browser's on disk, opened without keys), never
# taken for anything but JSON.
PRIVATE = {"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff"}


class OpsAPI:
    def __init__(self, serving: Serving, supervisors: list[WorkerSupervisor], log_tail: LogTail) -> None:
        self.serving = serving
        self.supervisors = supervisors
        self.log_tail = log_tail
        self.history = History(serving)
        self.page = files("gateway").joinpath("ops_page.html").read_bytes()

    async def show(self, _request: Request) -> Response:
        """The page itself: no state in it, so no key needed to fetch it."""
        return HTMLResponse(self.page, headers={"Cache-Control": "no-cache", "X-Frame-Options": "DENY",
                                                "Content-Security-Policy": CONTENT_SECURITY_POLICY})

    async def state(self, _request: Request) -> Response:
        serving, link, pool = self.serving, self.serving.link, self.serving.pool
        now = time.time()
        local = local_pids(self.supervisors)
        workers = workers_status(link, local)
        for w, entry in zip(link.workers.values(), workers):
            entry["epoch"] = str(w.hello.epoch)  # 64 bits: more than a JavaScript number holds
        lost = [{"pid": e.pid, "model": e.model, "state": "lost", "lost_s_ago": round(now - e.at, 1),
                 "detail": e.detail}
                for e in link.events if e.event == "lost" and now - e.at < LOST_SHOWN_S]
        return MsgspecResponse({
            "server": {"status": "draining" if serving.draining else "ok", "up_s": round(now - serving.started, 1),
                       "log_prompts": serving.settings.log_prompts, "requests_running": len(serving.running),
                       "requests_waiting_to_start": serving.leasing},
            "pool": pool.ledger() if pool.models else None,
            "workers": workers,
            "lost_workers": lost,
            "restartable": sorted(local),
            "history": {"interval_s": SAMPLE_S, "samples": list(self.history.samples)},
            "events": list(link.events),
            "log": list(self.log_tail.lines),
        }, headers=PRIVATE)
