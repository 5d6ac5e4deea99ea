"""What /health (and /metrics) say of the worker: the link's state as a plain dict."""

from __future__ import annotations

import time
from typing import Any

import msgspec

from gateway.worker_link import WorkerLink


def worker_status(link: WorkerLink) -> dict[str, Any]:
    w = link.worker
    state: dict[str, Any] = {"ready": link.ready, "state": w.vitals.state.value if w else "absent"}
    if w is not None:
        now = time.monotonic()
        state.update(
            pid=w.hello.pid,
            epoch=w.hello.epoch,
            model=w.hello.model,
            context_length=w.hello.context_length,
            capacity=w.hello.capacity,
            sampling_defaults=msgspec.structs.asdict(w.sampling),
            running=w.vitals.running,
            waiting=w.waiting,
            steps=w.vitals.steps,
            last_heartbeat_s=round(now - w.vitals.last_beat, 3),
            up_s=round(now - w.accepted_at, 1),
        )
        if w.prefix_cache is not None:
            state["prefix_cache"] = msgspec.structs.asdict(w.prefix_cache)
        if w.affinity is not None:
            state["affinity"] = {"evaluations": w.affinity.evaluations, "off_main_thread": w.affinity.off_main_thread}
    if (load_error := link.load_error) is not None:
        state["load_error"] = load_error
    state["requests_waiting_for_a_worker"] = link.requests_waiting
    state["workers_lost"] = link.stats.workers_lost
    state["requests_resumed"] = link.stats.requests_resumed
    state["requests_failed_by_loss"] = link.stats.requests_failed_by_loss
    return state
