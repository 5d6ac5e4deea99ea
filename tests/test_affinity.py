"""Invariant 1: in the worker, only the main thread evaluates MLX arrays."""

from __future__ import annotations

import threading

import httpx
import mlx.core as mx

from tests.conftest import MODEL_NAME, wait_for


def test_audit_sees_no_off_main_thread_evaluation(server):
    """Concurrency and aborts through the real stack; the worker runs with MLXD_AFFINITY_AUDIT=1."""
    # The first heartbeat carries it.
    wait_for(lambda: "affinity" in server.health()["worker"], 5, "the audit's first report")
    before = server.health()["worker"]["affinity"]["evaluations"]

    def stream(i: int, abort_after: int | None) -> None:
        body = {"model": MODEL_NAME, "prompt": f"Tale {i}", "max_tokens": 200, "temperature": 0.8,
                "seed": i, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
            for n, _ in enumerate(r.iter_lines()):
                if abort_after is not None and n >= abort_after:
                    return

    threads = [threading.Thread(target=stream, args=(i, 20 if i % 2 else None)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    server.wait_idle()
    affinity = server.health()["worker"]["affinity"]
    assert affinity["evaluations"] > before + 100
    assert affinity["off_main_thread"] == 0


def test_audit_catches_an_evaluation_off_the_main_thread(monkeypatch):
    """The audit itself can fail: an eval on another thread is counted."""
    from worker.audit import AffinityAudit

    for name in ("eval", "async_eval"):
        monkeypatch.setattr(mx, name, getattr(mx, name))
    for name in ("item", "tolist"):
        monkeypatch.setattr(mx.array, name, getattr(mx.array, name))
    audit = AffinityAudit().install()
    mx.eval(mx.array([1, 2]) + 1)
    assert (mx.array(3) * 2).item() == 6
    assert audit.report().off_main_thread == 0

    thread = threading.Thread(target=lambda: mx.eval(mx.array([1.0]) * 2))
    thread.start()
    thread.join()
    report = audit.report()
    assert report.evaluations == 3
    assert report.off_main_thread == 1
