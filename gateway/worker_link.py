"""The gateway's side of the worker protocol: handshake, dispatch, resuming.

Over the transport (gateway/transport.py), each worker's identity carries its
epoch, so messages from a worker that has been replaced are recognised and
ignored.

The worker is ready, draining, unresponsive or hung (gateway/liveness.py);
one given up on is killed under `mlxd serve` and treated as lost.
A worker that is gone (Goodbye, process exit, its ipc connection closed, or
replaced by a newer one) leaves its unfinished requests to be resumed on the
next worker serving the same weights (Hello.model_digest): the prompt plus the
tokens already delivered, so the client sees only a pause. A request survives
one lost worker; one caught in a second, or whose next worker serves another
model, fails cleanly.

A worker that cannot load its model says why (LoadFailed) before it exits:
until a worker is accepted, /health shows the reason and requests get a 503
carrying it at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from gateway.liveness import UNHEALTHY, Liveness, Vitals
from gateway.output_processor import OutputProcessor, RequestState
from gateway.sampling_defaults import SamplingDefaults, sampling_defaults
from gateway.tokenizer import Tokenizer, files_digest
from gateway.tool_formats import ToolFormat, load_tool_format
from gateway.transport import Transport
from protocol import (
    PROTOCOL_VERSION,
    Abort,
    AffinityReport,
    Draining,
    Error,
    Goodbye,
    Heartbeat,
    Hello,
    LoadFailed,
    PrefixCacheStats,
    ProtocolError,
    Refused,
    StepOutput,
    ToWorker,
    Welcome,
    decode_from_worker,
    hello_version,
)

log = logging.getLogger("mlxd.gateway.link")

# How many lost workers a request survives.
MAX_WORKER_LOSSES = 1
WATCHDOG_INTERVAL_S = 0.1


class WorkerUnavailable(Exception):
    pass


@dataclass
class WorkerState:
    identity: bytes
    hello: Hello
    tokenizer: Tokenizer
    accepted_at: float
    vitals: Vitals
    sampling: SamplingDefaults  # for requests that leave sampling parameters out
    tool_format: ToolFormat | None  # mlx-lm's parser for the model's tool calls (Hello.tool_parser)
    # The reasoning block's (start, end): mlx-lm's (Hello.reasoning_markers), else the gateway's own guess.
    reasoning_markers: tuple[str, str] | None
    waiting: int = 0
    affinity: AffinityReport | None = None
    prefix_cache: PrefixCacheStats | None = None


@dataclass
class LinkStats:
    workers_accepted: int = 0
    workers_lost: int = 0
    requests_resumed: int = 0
    requests_failed_by_loss: int = 0


class WorkerLink:
    def __init__(
        self,
        endpoint: str,
        *,
        worker_timeout_s: float,
        hung_worker_s: float,
        worker_wait_s: float,
        curve_secret_key: str | None = None,
        curve_authorized_keys: str | None = None,
        on_unhealthy: Callable[[int], None] | None = None,
    ) -> None:
        self.transport = Transport(endpoint, curve_secret_key, curve_authorized_keys)
        self.worker_timeout_s = worker_timeout_s
        self.hung_worker_s = hung_worker_s
        self.worker_wait_s = worker_wait_s
        # Called with the pid of a worker hung or unresponsive for
        # --hung-worker-s; `mlxd serve` kills it there and starts another.
        self.on_unhealthy = on_unhealthy
        self.worker: WorkerState | None = None
        # The last worker that could not load its model, until one is accepted.
        self.load_failure: LoadFailed | None = None
        self.stats = LinkStats()
        self.outputs = OutputProcessor()  # every unfinished request
        self._resume_by: dict[str, float] = {}  # request id -> deadline to get a worker
        self._ready = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    def bind(self) -> None:
        """Take the endpoint (see Transport.bind)."""
        self.transport.bind()

    async def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._receive_loop(), name="mlxd-link-receive"),
            asyncio.create_task(self._watchdog(), name="mlxd-link-watchdog"),
            asyncio.create_task(self._watch_connections(), name="mlxd-link-connections"),
        ]
        log.info("waiting for a worker on %s", self.transport.endpoint)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        # Streams still open past the server's own shutdown end here; nothing more goes to the worker.
        for state in self.outputs:
            self.outputs.fail(state.request_id, "the gateway is shutting down", 503)
        self.worker = None
        self.transport.close()

    # ---- used by the HTTP handlers -----------------------------------------

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    async def ready_worker(self, timeout_s: float) -> WorkerState:
        if self.load_error is not None and not self.ready:
            raise WorkerUnavailable(self.load_error)
        try:
            await asyncio.wait_for(self._ready.wait(), timeout_s)
        except TimeoutError:
            raise WorkerUnavailable(f"no worker became ready within {timeout_s:g}s") from None
        assert self.worker is not None
        return self.worker

    def submit(self, state: RequestState) -> None:
        if self.worker is None or not self.ready:
            raise WorkerUnavailable("the worker went away")
        state.model_digest = self.worker.hello.model_digest
        self.outputs.add(state)
        self._send(self.worker.identity, state.add_request(), state.buffers)

    def abort(self, request_ids: list[str]) -> None:
        """Drop requests whose client is done with them, and tell the worker to
        drop those still running. Only `Serving.generate` calls this."""
        dropped = [request_id for request_id in request_ids if self.outputs.abort(request_id)]
        for request_id in request_ids:
            self._resume_by.pop(request_id, None)
        if dropped and self.worker is not None:
            self._send(self.worker.identity, Abort(dropped))

    @property
    def load_error(self) -> str | None:
        """Why the last worker could not load its model, until one is accepted."""
        failure = self.load_failure
        if failure is None:
            return None
        return f"the worker cannot load its model {failure.model or '(the default)'!r}: {failure.reason}"

    @property
    def requests_waiting(self) -> int:
        """Requests of a lost worker waiting for the next one."""
        return len(self._resume_by)

    # ---- the link itself ---------------------------------------------------

    def _send(self, identity: bytes, message: ToWorker, buffers: Sequence[Any] = ()) -> None:
        if not self.transport.send(identity, message, buffers):
            # Acted on after the caller is done with its own bookkeeping.
            asyncio.get_running_loop().call_soon(self._on_disconnect, identity)

    async def _watch_connections(self) -> None:
        """When a connection closes, find out whether it was the worker's by
        sending it a Welcome it already has (ignored by a live worker)."""
        while True:
            await self.transport.closed_connection()
            for delay in (0.0, 0.05):  # the socket may learn of the closed pipe a moment after the event
                await asyncio.sleep(delay)
                if self.worker is not None:
                    self._send(self.worker.identity, Welcome(self.worker.hello.epoch))

    async def _receive_loop(self) -> None:
        while True:
            identity, frame = await self.transport.receive()
            try:
                message = decode_from_worker(frame)
            except ProtocolError as e:
                self._reject(identity, frame, e)
                continue
            if isinstance(message, Hello):
                await self._accept(identity, message)
                continue
            if isinstance(message, LoadFailed):
                log.error("worker pid %d cannot load its model %r: %s", message.pid, message.model, message.reason)
                self.load_failure = message
                continue
            w = self.worker
            if isinstance(message, Heartbeat):
                if w is not None and message.epoch == w.hello.epoch:
                    self._on_heartbeat(w, message)
                continue
            if w is None or identity != w.identity:
                continue  # a replaced worker's leftovers
            if isinstance(message, StepOutput):
                aborts = self.outputs.process(message)
                if aborts:  # stop strings, which the worker cannot see
                    self._send(w.identity, Abort(aborts))
            elif isinstance(message, Error):
                self._on_error(message)
            elif isinstance(message, Draining):
                w.vitals.draining = True
                self._assess(w)
            elif isinstance(message, Goodbye):
                self._lose_worker(f"it said goodbye ({message.reason})", handed_back=set(message.handed_back))

    def _reject(self, identity: bytes, frame: bytes, error: ProtocolError) -> None:
        version = hello_version(frame)
        if version is not None and version != PROTOCOL_VERSION:
            self._refuse(identity, version)
        else:
            log.warning("ignored an unreadable message from a worker: %s", error)

    def _refuse(self, identity: bytes, version: int) -> None:
        reason = (
            f"protocol version mismatch: the gateway speaks version {PROTOCOL_VERSION}, "
            f"the worker speaks version {version}"
        )
        log.error("refused a worker: %s", reason)
        self._send(identity, Refused(reason))

    async def _accept(self, identity: bytes, hello: Hello) -> None:
        if hello.protocol_version != PROTOCOL_VERSION:
            self._refuse(identity, hello.protocol_version)
            return
        w = self.worker
        if w is not None and w.identity == identity:
            self._send(identity, Welcome(hello.epoch))  # our Welcome crossed its retry
            return
        if w is not None and hello.epoch < w.hello.epoch:
            log.warning("ignored a Hello from an older worker (epoch %d)", hello.epoch)
            return
        if w is not None and w.tokenizer.digest == files_digest(hello.tokenizer_files):
            tokenizer = w.tokenizer
        else:
            try:
                tokenizer = await asyncio.to_thread(Tokenizer, hello.tokenizer_files, hello.vision)
            except Exception as e:  # files the gateway cannot use: this worker cannot serve through it
                log.exception("refused a worker (pid %d): its tokenizer files cannot be loaded", hello.pid)
                self._send(identity, Refused(f"the gateway cannot load this model's tokenizer: {e}"))
                return
        if self.worker is not None:
            old = self.worker
            self._lose_worker(f"replaced by a newer worker (pid {hello.pid})", handed_back=set())
            # Should the old one wake up, it must not serve beside the new one.
            self._send(old.identity, Refused("replaced by a newer worker"))
        now = time.monotonic()
        self.load_failure = None
        self.stats.workers_accepted += 1
        vitals = Vitals(self.worker_timeout_s, self.hung_worker_s, last_beat=now, last_progress=now)
        self.worker = WorkerState(identity, hello, tokenizer, accepted_at=now, vitals=vitals,
                                  sampling=sampling_defaults(hello.tokenizer_files),
                                  tool_format=load_tool_format(hello.tool_parser),
                                  reasoning_markers=(hello.reasoning_markers[0], hello.reasoning_markers[1])
                                  if len(hello.reasoning_markers) == 2 else tokenizer.reasoning_markers)
        self._send(identity, Welcome(hello.epoch))
        self._ready.set()
        log.info(
            "worker ready: pid %d, epoch %d, model %s, context %d, capacity %d",
            hello.pid, hello.epoch, hello.model, hello.context_length, hello.capacity,
        )
        self._resume_waiting()

    def _resume_waiting(self) -> None:
        w = self.worker
        assert w is not None
        resumed = 0
        for request_id in list(self._resume_by):
            del self._resume_by[request_id]
            state = self.outputs.get(request_id)
            if state is None:
                continue
            if state.model_digest != w.hello.model_digest:
                self._fail_after_loss(request_id, f"the worker came back serving other weights ({w.hello.model}); "
                                      "this request cannot continue on them")
                continue
            self._send(w.identity, state.add_request(), state.buffers)
            resumed += 1
        if resumed:
            self.stats.requests_resumed += resumed
            log.info("resumed %d requests on worker pid %d", resumed, w.hello.pid)

    def _on_heartbeat(self, w: WorkerState, beat: Heartbeat) -> None:
        w.vitals.beat(time.monotonic(), beat.step, beat.running)
        w.waiting, w.affinity, w.prefix_cache = beat.waiting, beat.affinity, beat.prefix_cache
        self._assess(w)

    def _assess(self, w: WorkerState) -> None:
        """Act on what the worker's vitals say: log a change, set readiness,
        kill a hung worker, give up on one unhealthy too long."""
        verdict = w.vitals.assess(time.monotonic())
        if verdict.changed:
            level = logging.WARNING if verdict.state in UNHEALTHY else logging.INFO
            log.log(level, "worker pid %d: %s -> %s", w.hello.pid, verdict.previous.value, verdict.state.value)
        if verdict.state == Liveness.READY:
            self._ready.set()
        else:
            self._ready.clear()
        if verdict.kill and verdict.state == Liveness.HUNG:
            log.error("worker pid %d is hung: no step for %gs with requests running", w.hello.pid, self.hung_worker_s)
        if verdict.kill and self.on_unhealthy is not None:
            self.on_unhealthy(w.hello.pid)
        if verdict.give_up:
            # Its requests move on to the next worker (or fail after
            # --worker-wait-s) rather than wait for it forever.
            self._lose_worker(f"{verdict.state.value} for {verdict.unhealthy_for:.0f}s", handed_back=set())

    def _on_disconnect(self, identity: bytes) -> None:
        """A peer's connection closed. Over ipc the worker process is gone (a
        stopped or busy one keeps its socket); over tcp it may be a network
        blip that ZeroMQ reconnects, so the worker is only unresponsive."""
        w = self.worker
        if w is None or identity != w.identity:
            return
        if self.transport.ipc:
            self._lose_worker("its connection closed", handed_back=set())
        else:
            w.vitals.disconnected = True
            self._assess(w)

    def worker_process_exited(self, pid: int, status: int | None) -> None:
        """`mlxd serve`'s supervisor saw the worker process end."""
        if self.worker is not None and self.worker.hello.pid == pid:
            self._lose_worker(f"its process exited with status {status}", handed_back=set())

    def _on_error(self, error: Error) -> None:
        if error.request_id is None:
            log.warning("the worker could not read a message: %s", error.message)
            return
        self.outputs.fail(error.request_id, f"the worker rejected the request: {error.message}", 500)

    def _lose_worker(self, why: str, handed_back: set[str]) -> None:
        w = self.worker
        if w is None:
            return
        log.warning("worker pid %d lost: %s", w.hello.pid, why)
        self.worker = None
        self._ready.clear()
        self.stats.workers_lost += 1
        deadline = time.monotonic() + self.worker_wait_s
        for state in self.outputs:
            request_id = state.request_id
            if request_id in self._resume_by:
                continue  # already waiting: it never reached this worker
            if request_id not in handed_back:
                state.worker_losses += 1
            if state.worker_losses > MAX_WORKER_LOSSES:
                self._fail_after_loss(request_id, f"the worker was lost twice during this request: {why}")
            else:
                self._resume_by[request_id] = deadline

    def _fail_after_loss(self, request_id: str, why: str) -> None:
        """End a request that a lost worker left without a way on (a 503, counted)."""
        if self.outputs.fail(request_id, why, 503):
            self.stats.requests_failed_by_loss += 1

    async def _watchdog(self) -> None:
        while True:
            await asyncio.sleep(WATCHDOG_INTERVAL_S)
            if self.worker is not None:
                self._assess(self.worker)
            now = time.monotonic()
            for request_id, deadline in list(self._resume_by.items()):
                if now > deadline:
                    del self._resume_by[request_id]
                    self._fail_after_loss(request_id, f"no worker came back within {self.worker_wait_s:g}s")
