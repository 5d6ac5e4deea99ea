"""MLXD_AFFINITY_AUDIT=1: record the thread of every MLX evaluation.

Invariant 1 of DESIGN.md says only the worker's main thread calls into MLX. The
audit wraps every entry point that forces evaluation (mx.eval, mx.async_eval,
array.item, array.tolist), counts calls, and logs each one made off the main
thread with its stack. The counts travel in every Heartbeat, so a test (or an
operator, through /health) sees them.
"""

from __future__ import annotations

import functools
import logging
import threading
import traceback

import mlx.core as mx

from protocol import AffinityReport

log = logging.getLogger("mlxd.worker.audit")


class AffinityAudit:
    def __init__(self) -> None:
        self.evaluations = 0
        self.off_main_thread = 0
        self._main = threading.main_thread()

    def report(self) -> AffinityReport:
        return AffinityReport(self.evaluations, self.off_main_thread)

    def _wrap(self, fn):
        @functools.wraps(fn)
        def audited(*args, **kwargs):
            self.evaluations += 1
            if threading.current_thread() is not self._main:
                self.off_main_thread += 1
                log.error(
                    "MLX evaluation off the main thread (%s):\n%s",
                    threading.current_thread().name,
                    "".join(traceback.format_stack(limit=12)),
                )
            return fn(*args, **kwargs)

        return audited

    def install(self) -> "AffinityAudit":
        mx.eval = self._wrap(mx.eval)
        mx.async_eval = self._wrap(mx.async_eval)
        mx.array.item = self._wrap(mx.array.item)  # type: ignore[method-assign]
        mx.array.tolist = self._wrap(mx.array.tolist)  # type: ignore[method-assign]
        return self
