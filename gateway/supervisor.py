"""`mlxd serve`'s worker supervision: start it, restart it, stop it.

A worker that exits is restarted after a backoff that doubles from 0.5 s up
to 30 s (and starts over once a worker has stayed up a minute). Five exits
within a minute is a crash loop: reported in /health and the log, and retried
at the slowest pace rather than spun, until a worker stays up a minute. A
worker the link reports hung is killed, and so restarted. The first worker of a start that cannot load its model
stops the supervisor and reports the reason (on_fatal): retrying would only
fail the same way. The pool (gateway/pool.py) starts and stops supervisors as
models load and unload.

The worker runs in a process group of its own, so a Ctrl-C in the terminal
reaches the gateway alone, which lets open streams finish, then stops the worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable

import msgspec

from gateway.worker_link import WorkerLink
from protocol import EXIT_LOAD_FAILED, LoadFailed
from protocol.settings import to_arguments, without_variables
from protocol.worker_settings import WorkerSettings, worker_command

log = logging.getLogger("mlxd.gateway.supervisor")

INITIAL_BACKOFF_S = 0.5
MAX_BACKOFF_S = 30.0
STABLE_AFTER_S = 60.0
CRASH_LOOP_EXITS = 5
CRASH_LOOP_WINDOW_S = 60.0
# How long a worker's LoadFailed may trail its exit.
LOAD_FAILED_WAIT_S = 1.0


class Restarts:
    """When to start a worker again after it exits, and whether it is in a
    crash loop: CRASH_LOOP_EXITS exits within CRASH_LOOP_WINDOW_S, after which
    it is retried at the slowest pace until a worker stays up STABLE_AFTER_S
    (at that pace the window would soon hold fewer exits: that is no recovery)."""

    def __init__(self) -> None:
        self._backoff = INITIAL_BACKOFF_S
        self._exits: list[float] = []
        self._looping = False

    def exited(self, started: float, now: float) -> float:
        """A worker started at `started` exited at `now`: the seconds to wait before the next."""
        if now - started >= STABLE_AFTER_S:  # it had recovered: start over
            self._backoff, self._exits, self._looping = INITIAL_BACKOFF_S, [], False
        self._exits = [t for t in self._exits if now - t < CRASH_LOOP_WINDOW_S] + [now]
        self._looping = self._looping or len(self._exits) >= CRASH_LOOP_EXITS
        wait = MAX_BACKOFF_S if self._looping else self._backoff
        self._backoff = min(self._backoff * 2, MAX_BACKOFF_S)
        return wait

    def asked(self) -> None:
        """A worker restarted on request: the next exit is waited on from the shortest pace."""
        self._backoff = INITIAL_BACKOFF_S

    def in_loop(self, running_since: float | None, now: float) -> bool:
        """In a crash loop, unless the worker running since `running_since` (None: none runs) has recovered."""
        return self._looping and not (running_since is not None and now - running_since >= STABLE_AFTER_S)


class WorkerSupervisor:
    def __init__(self, settings: WorkerSettings, link: WorkerLink, stop_timeout_s: float) -> None:
        # The worker is its own program (`python -m worker`): the gateway
        # never imports it, and MLX never enters this process.
        # The pool may change the settings (the MLX memory limit) before each start.
        self.settings = msgspec.structs.replace(settings, parent_pid=os.getpid())
        self.model = settings.model  # as its worker names it in a LoadFailed
        self.link = link
        self.stop_timeout_s = stop_timeout_s
        self.process: asyncio.subprocess.Process | None = None
        self.restarts = 0
        self.last_exit_status: int | None = None
        self._restarts = Restarts()
        self._running_since: float | None = None
        self._stopping = False
        self._restart_requested = False
        self._task: asyncio.Task | None = None
        # Called with the reason when serving cannot start (the model does not load).
        self.on_fatal: Callable[[str], None] | None = None

    @property
    def running(self) -> bool:
        """Started, and neither stopped nor given up on a model that cannot load."""
        return self.alive and not self._stopping

    @property
    def alive(self) -> bool:
        """Started, and not yet stopped: also while the server drains (no restarts)."""
        return self._task is not None and not self._task.done()

    async def start(self) -> None:
        self.link.load_failures.pop(self.model, None)  # an earlier start's
        self._stopping = False
        self._restart_requested = False  # one asked of the last start's worker, stopped before it came
        self._restarts = Restarts()  # a new start (the pool loads the model again) starts afresh
        self.restarted = False  # its worker exited since this start: the model was served and is not now
        self._task = asyncio.create_task(self._run(), name="mlxd-supervisor")

    @property
    def crash_loop(self) -> bool:
        return self._restarts.in_loop(self._running_since, time.monotonic())

    def status(self) -> dict:
        process = self.process
        return {
            # An exited worker's pid may soon be another process's.
            "pid": process.pid if process is not None and process.returncode is None else None,
            "restarts": self.restarts,
            "last_exit_status": self.last_exit_status,
            "crash_loop": self.crash_loop,
        }

    async def _run(self) -> None:
        argv = worker_command(to_arguments(self.settings))
        # The settings were resolved here, the variables with them; the flags carry them all.
        environ = without_variables(os.environ, WorkerSettings)
        first = True
        while not self._stopping:
            started = self._running_since = time.monotonic()
            # A process group of its own, in the same session: a terminal's
            # Ctrl-C goes to the foreground group only, while the scheduler
            # (Linux autogroups are per session) weighs it as before.
            self.process = await asyncio.create_subprocess_exec(*argv, process_group=0, env=environ)
            log.info("started worker pid %d", self.process.pid)
            status = await self.process.wait()
            self._running_since = None
            self.link.worker_process_exited(self.process.pid, status, asked=self._stopping or self._restart_requested)
            if self._stopping:
                return
            if status == EXIT_LOAD_FAILED and first:
                await self._fail_to_start()
                return
            first = False
            now = time.monotonic()
            self.restarts += 1
            self.restarted = True
            self.last_exit_status = status
            if self._restart_requested:
                self._restart_requested = False
                self._restarts.asked()
                continue
            backoff = self._restarts.exited(started, now)
            if self.crash_loop:
                log.error("worker crash loop: %d exits within %gs, or slow retries since (last status %s); "
                          "retrying every %gs", CRASH_LOOP_EXITS, CRASH_LOOP_WINDOW_S, status, MAX_BACKOFF_S)
            log.warning(
                "worker pid %d exited with status %s after %.1fs; restarting in %.1fs",
                self.process.pid, status, now - started, backoff,
            )
            await asyncio.sleep(backoff)

    async def _fail_to_start(self) -> None:
        def failure() -> LoadFailed | None:
            return self.link.load_failures.get(self.model)

        deadline = time.monotonic() + LOAD_FAILED_WAIT_S
        while failure() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        found = failure()
        reason = found.reason if found is not None else "the worker could not load its model (see its log above)"
        self.last_exit_status = EXIT_LOAD_FAILED
        if self.on_fatal is not None:
            self.on_fatal(f"cannot load the model: {reason}")

    def restart(self) -> bool:
        """An operator's restart: the worker drains (its unfinished requests
        move to the next one) and is started again at once, not counted
        towards a crash loop. False if no worker process runs."""
        if self.process is None or self.process.returncode is not None or self._stopping:
            return False
        log.info("restarting worker pid %d on an admin request", self.process.pid)
        self._restart_requested = True
        self.process.send_signal(signal.SIGTERM)
        # A draining worker is never called hung, and one stuck in a step never
        # ends its drain: as for a stop, past its time it is killed.
        asyncio.get_running_loop().call_later(self.stop_timeout_s, self._kill_if_running, self.process)
        return True

    def _kill_if_running(self, process: asyncio.subprocess.Process) -> None:
        if process.returncode is None:
            log.warning("worker pid %d ignored SIGTERM for %gs; killing it", process.pid, self.stop_timeout_s)
            _kill_group(process.pid)

    def stop_restarting(self) -> None:
        """The gateway is stopping: a worker that exits now stays down."""
        self._stopping = True

    def kill(self, pid: int) -> None:
        """The link found this worker hung or unresponsive: kill it (and so
        restart it), with its process group: a distributed worker's ranks on
        this machine, which a hung group cannot stop itself."""
        if self.process is not None and self.process.pid == pid and self.process.returncode is None:
            log.error("killing hung worker pid %d", pid)
            _kill_group(pid)

    async def stop(self) -> None:
        self._stopping = True
        process = self.process
        if process is not None and process.returncode is None:
            process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(process.wait(), self.stop_timeout_s)
            except TimeoutError:
                self._kill_if_running(process)
                await process.wait()
            finally:
                if process.returncode is None:  # the stop was cancelled: the worker must not outlive it
                    _kill_group(process.pid)
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self.process = None


def local_pids(supervisors: list[WorkerSupervisor]) -> set[int]:
    """The workers these supervisors run: the others connected on their own
    (launchd's worker, a replica, another Mac)."""
    return {s.process.pid for s in supervisors if s.process is not None}


def _kill_group(pid: int) -> None:
    """SIGKILL the worker's process group (it leads one of its own)."""
    with contextlib.suppress(ProcessLookupError):  # it exited meanwhile
        os.killpg(pid, signal.SIGKILL)
