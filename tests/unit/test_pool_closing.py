"""A draining server loads nothing: a request that got past the door before
the drain began (it was waiting for the pool) is refused, and no worker is
started beside the ones that are finishing their streams."""

import asyncio

import pytest

from gateway.pool import ModelPool, Unavailable
from gateway.worker_link import WorkerLink
from protocol.worker_settings import WorkerSettings


def test_a_draining_pool_starts_no_worker(tmp_path):
    async def run() -> None:
        link = WorkerLink(f"ipc://{tmp_path}/gw.sock", worker_timeout_s=30, hung_worker_s=30, worker_wait_s=5)
        pool = ModelPool(link, [WorkerSettings(model=f"alpha={tmp_path}")], budget=1 << 30, max_loaded=1,
                         keep_alive_s=60, stop_timeout_s=5)
        alpha = pool.models["alpha"]
        try:
            pool.stop_restarting()
            with pytest.raises(Unavailable, match="shutting down"):
                await pool.lease("alpha", None, wait_s=1)
            assert alpha.supervisor.process is None and alpha.users == 0
        finally:
            await pool.stop()

    asyncio.run(run())
