"""`mlxd worker`: load a model and serve it to a gateway over ZeroMQ."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from protocol.settings import add_arguments, resolve
from protocol.worker_settings import WorkerSettings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="mlxd worker",
        description="Load a model and serve it to an mlxd gateway. The main thread makes "
        "every MLX call. MLXD_AFFINITY_AUDIT=1 records the thread of every MLX evaluation "
        "and reports any made off the main thread.",
    )
    add_arguments(parser, WorkerSettings)
    args = parser.parse_args(argv)
    try:
        settings = resolve(WorkerSettings, args)
    except ValueError as e:
        parser.error(str(e))
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s mlxd-worker[%(process)d] %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    # BLAS must be chosen before anything imports mlx, so the serving loop
    # (which imports mlx) is imported only after it.
    from worker.blas import load_fast_blas

    blas = load_fast_blas()
    from worker.serve import serve

    audit = os.environ.get("MLXD_AFFINITY_AUDIT", "") not in ("", "0")
    return serve(settings, blas=blas, audit=audit)
