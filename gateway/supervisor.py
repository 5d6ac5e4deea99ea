"""`mlxd serve`'s child worker: started after the gateway binds, stopped before it exits."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

from protocol.settings import to_arguments
from protocol.worker_settings import WorkerSettings

log = logging.getLogger("mlxd.gateway.supervisor")


class WorkerProcess:
    def __init__(self, settings: WorkerSettings, stop_timeout_s: float = 10.0) -> None:
        # The worker is its own program (`python -m worker`): the gateway
        # never imports it, and MLX never enters this process.
        self.argv = [sys.executable, "-m", "worker", *to_arguments(settings)]
        self.stop_timeout_s = stop_timeout_s
        self.process: asyncio.subprocess.Process | None = None
        self._watch: asyncio.Task | None = None

    async def start(self) -> None:
        self.process = await asyncio.create_subprocess_exec(*self.argv)
        log.info("started worker pid %d", self.process.pid)
        self._watch = asyncio.create_task(self._watch_exit(self.process))

    async def _watch_exit(self, process: asyncio.subprocess.Process) -> None:
        code = await process.wait()
        log.warning("worker pid %d exited with status %s", process.pid, code)

    async def stop(self) -> None:
        process = self.process
        if process is None or process.returncode is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), self.stop_timeout_s)
        except TimeoutError:
            log.warning("worker pid %d ignored SIGTERM for %gs; killing it", process.pid, self.stop_timeout_s)
            process.kill()
            await process.wait()
        if self._watch:
            self._watch.cancel()
