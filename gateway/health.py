"""What /health (and /metrics) say of the workers: the link's state as plain dicts."""

from __future__ import annotations

import time
from typing import Any

import msgspec

from gateway.worker_link import WorkerLink, WorkerState


def _worker_entry(w: WorkerState, now: float, local: set[int] | None = None) -> dict[str, Any]:
    """local: the pids of the workers this gateway started (None: not known, `remote` left out)."""
    entry: dict[str, Any] = dict(
        ready=w.ready,
        state=w.vitals.state.value,
        pid=w.hello.pid,
        epoch=w.hello.epoch,
        model=w.hello.model,
        names=w.names,  # what clients call it (--served-model-name, or the model's NAME)
        context_length=w.hello.context_length,
        capacity=w.hello.capacity,
        sampling_defaults=msgspec.structs.asdict(w.sampling),
        running=w.vitals.running,
        waiting=w.waiting,
        steps=w.vitals.steps,
        last_heartbeat_s=round(now - w.vitals.last_beat, 3),
        up_s=round(now - w.accepted_at, 1),
        weights_bytes=w.hello.weights_bytes,
    )
    if local is not None:
        # Connected on its own: launchd's worker, a replica, another Mac (its memory is not this pool's).
        entry["remote"] = w.hello.pid not in local
    if w.hello.ranks:
        entry["ranks"] = [msgspec.structs.asdict(r) for r in w.hello.ranks]
    if w.memory is not None:
        entry["memory"] = msgspec.structs.asdict(w.memory)
    if w.prefix_cache is not None:
        entry["prefix_cache"] = msgspec.structs.asdict(w.prefix_cache)
    if w.affinity is not None:
        entry["affinity"] = {"evaluations": w.affinity.evaluations, "off_main_thread": w.affinity.off_main_thread}
    return entry


def served_name(worker: dict[str, Any]) -> str:
    """A worker entry's model as clients call it (its `model` is the source with --served-model-name)."""
    return (worker.get("names") or [worker["model"]])[0]


def workers_status(link: WorkerLink, local: set[int]) -> list[dict[str, Any]]:
    """One entry per connected worker (replicas included), oldest first; `local`: the pids this gateway started."""
    now = time.monotonic()
    return [_worker_entry(w, now, local) for w in link.workers.values()]


def worker_status(link: WorkerLink) -> dict[str, Any]:
    """The oldest worker (kept for existing probes) and the link's own counters;
    `ready` is the link's: some worker can take requests."""
    w = link.worker
    state: dict[str, Any] = {"state": "absent"}
    if w is not None:
        state.update(_worker_entry(w, time.monotonic()))
    state["ready"] = link.ready
    if (load_error := link.load_error) is not None:
        state["load_error"] = load_error
    state["requests_waiting_for_a_worker"] = link.requests_waiting
    state["workers_lost"] = link.stats.workers_lost
    state["requests_resumed"] = link.stats.requests_resumed
    state["requests_failed_by_loss"] = link.stats.requests_failed_by_loss
    return state
