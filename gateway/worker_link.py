"""The gateway's side of the worker protocol: handshake, dispatch, resuming.

Over the transport (gateway/transport.py), each worker's identity carries its
epoch, so messages from a worker that has been replaced are recognised and
ignored.

Workers of several models may connect, each serving its names: the gateway's
--served-model-name when set (one model), else the name in its Hello. Several
workers of one model may connect (replicas: more processes, or other Macs over
tcp); each request goes to the ready one that was sent the longest
prefix of its prompt (gateway/affinity.py), unless that one runs
AFFINITY_SLACK more of this gateway's requests than the least loaded, else to
the least loaded. A worker serving other weights under the same name replaces
those there, as does a newcomer for a replica that has stopped answering.

Each worker is ready, draining, unresponsive or hung (gateway/liveness.py);
one given up on is killed under `mlxd serve` and treated as lost.
A worker that is gone (Goodbye, process exit, its ipc connection closed, or
replaced) leaves its unfinished requests to be resumed on another ready
replica, or the next worker, serving the same weights (Hello.model_digest):
the prompt plus the tokens already delivered, so the client sees only a
pause. A request survives one lost worker; one caught in a second, or whose
next worker serves another model, fails cleanly.

A worker that cannot load its model says why (LoadFailed) before it exits:
until a worker is accepted, /health shows the reason and requests get a 503
carrying it at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.affinity import PrefixIndex, prefix_blocks
from gateway.liveness import UNHEALTHY, Liveness, Vitals
from gateway.output_processor import OutputProcessor, RequestState
from gateway.sampling_defaults import SamplingDefaults, sampling_defaults
from gateway.tokenizer import Tokenizer
from gateway.tool_formats import ToolFormat, load_tool_format
from gateway.transport import Transport
from protocol import (
    PROTOCOL_VERSION,
    Abort,
    AffinityReport,
    Draining,
    Embed,
    Embeddings,
    Error,
    Goodbye,
    Heartbeat,
    Hello,
    LoadFailed,
    MemoryStats,
    PrefixCacheStats,
    ProtocolError,
    Refused,
    StepOutput,
    ToWorker,
    Welcome,
    decode_from_worker,
    hello_version,
)
from protocol.codec import files_digest
from protocol.worker_settings import WorkerSettings, announced_name

log = logging.getLogger("mlxd.gateway.link")

# How many lost workers a request survives.
MAX_WORKER_LOSSES = 1
WATCHDOG_INTERVAL_S = 0.1
# A watchdog tick this much later than due: the gateway stood still, not its workers.
GATEWAY_STALL_S = 1.0
# A replica that was sent a request's prefix takes it unless it runs this many
# more requests than the least loaded one: a cached prefix saves one prefill,
# while a longer queue slows every step of the request.
AFFINITY_SLACK = 4
# The workers' latest comings and goings kept for the ops page.
EVENTS_KEPT = 50


class WorkerUnavailable(Exception):
    pass


class WorkerRejected(Exception):
    """The worker could not act on the request: its message says why;
    `internal`: it failed at it, rather than found the request wrong."""

    def __init__(self, message: str, internal: bool = False) -> None:
        super().__init__(message)
        self.internal = internal


@dataclass
class WorkerState:
    identity: bytes
    hello: Hello
    names: list[str]  # what clients ask for to reach it
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
    memory: MemoryStats | None = None  # MLX's allocator, from its heartbeats
    ready: bool = True  # its liveness says so: requests may go to it
    prefixes: PrefixIndex = field(default_factory=PrefixIndex)  # the prompts sent to it
    dropped: bool = False  # its tcp connection closed since its requests were last taken back


@dataclass
class WorkerEvent:
    """A change in a worker's life, as the ops page lists it."""

    at: float  # time.time()
    pid: int
    model: str  # its served names
    event: str  # "ready", a liveness change ("unresponsive", "hung", "draining", "ready again"), "lost", "stopped", "load failed"
    detail: str = ""


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
        served_model_name: Sequence[str] = (),
        on_tokenizer: Callable[[], None] = lambda: None,
    ) -> None:
        self.transport = Transport(endpoint, curve_secret_key, curve_authorized_keys)
        self.worker_timeout_s = worker_timeout_s
        self.hung_worker_s = hung_worker_s
        self.worker_wait_s = worker_wait_s
        # Called with the pid of a worker hung or unresponsive for
        # --hung-worker-s; `mlxd serve` kills it there and starts another.
        self.on_unhealthy = on_unhealthy
        self.on_tokenizer = on_tokenizer  # called on the event loop when a tokenizer has loaded
        self.workers: dict[bytes, WorkerState] = {}  # by identity, oldest first
        self._given_up: set[bytes] = set()  # workers lost to liveness, refused should they speak again
        self.served_model_name = list(served_model_name)
        # The last worker that could not load its model, until one is accepted.
        self.load_failure: LoadFailed | None = None
        # Every model's last failure to load, by its --model value (a supervisor's own look-up).
        self.load_failures: dict[str, LoadFailed] = {}
        self.refusing: str | None = None  # why no request may wait for a worker any more (the server stops)
        self.stats = LinkStats()
        self.events: deque[WorkerEvent] = deque(maxlen=EVENTS_KEPT)  # the latest, oldest first
        self.outputs = OutputProcessor()  # every unfinished request
        self._resume_by: dict[str, float] = {}  # request id -> deadline to get a worker
        # Embed requests sent, by id -> (the worker's identity, the future of its answer).
        self._embeds: dict[str, tuple[bytes, asyncio.Future[Embeddings]]] = {}
        self._ready = asyncio.Event()  # some worker is ready
        self._changed = asyncio.Event()  # set, and replaced, whenever a worker comes, goes or changes state
        self._tasks: list[asyncio.Task] = []
        # Hellos being answered, by identity: loading a tokenizer takes a
        # while, and the worker says Hello again until it is welcomed.
        self._accepting: dict[bytes, asyncio.Task] = {}
        self._tokenizer_loads: dict[bytes, asyncio.Future[Tokenizer]] = {}  # by the files' digest

    def bind(self) -> None:
        """Take the endpoint (see Transport.bind)."""
        self.transport.bind()

    async def start(self) -> None:
        self.transport.listen(self._on_message)
        self._tasks = [
            asyncio.create_task(self._watchdog(), name="mlxd-link-watchdog"),
            asyncio.create_task(self._watch_connections(), name="mlxd-link-connections"),
        ]
        log.info("waiting for a worker on %s", self.transport.endpoint)

    async def close(self) -> None:
        self.transport.stop_listening()  # no Hello may start an answer now
        tasks = [*self._tasks, *self._accepting.values(), *self._tokenizer_loads.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        # Streams still open past the server's own shutdown end here; nothing more goes to the worker.
        for state in self.outputs:
            self.outputs.fail(state.request_id, "the gateway is shutting down", 503)
        self.workers.clear()
        self.transport.close()

    # ---- used by the HTTP handlers -----------------------------------------

    @property
    def worker(self) -> WorkerState | None:
        """The oldest worker here (what /health's `worker` describes)."""
        return next(iter(self.workers.values()), None)

    @property
    def ready(self) -> bool:
        return self._ready.is_set()


    async def ready_worker(self, deadline: float, waited_s: float, model: str | None,
                           failure: Callable[[], str | None] | None = None) -> WorkerState:
        """A ready worker serving `model` (None: any), for preparing a request's
        prompt (submit picks where it runs). WorkerUnavailable when none is
        ready by `deadline` (time.monotonic(); the request will then have waited
        `waited_s`), or as soon as `failure` gives a reason (its model could not
        load; by default, the last LoadFailed while no worker is ready)."""
        if failure is None:
            failure = lambda: self.load_error if not self.ready else None  # noqa: E731
        while (worker := self._least_loaded(model)) is None:
            if (why := self.refusing or failure()) is not None:
                raise WorkerUnavailable(why)
            changed = self._changed
            try:
                await asyncio.wait_for(changed.wait(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                raise WorkerUnavailable(f"no worker became ready within {waited_s:g}s") from None
        return worker

    def worker_of(self, name: str) -> WorkerState | None:
        """The oldest connected worker serving the model `name`, ready or not."""
        return next((w for w in self.workers.values() if name in w.names), None)

    def notify(self) -> None:
        """Wake what waits for a worker: something it depends on changed."""
        self._changed.set()
        self._changed = asyncio.Event()

    def refuse_waiting(self, why: str) -> None:
        """The server is stopping: what waits for a worker to be ready gets `why` now, instead of a worker."""
        self.refusing = why
        self.notify()

    def submit(self, state: RequestState, prepared_by: WorkerState) -> None:
        """Send a request, its prompt prepared for `prepared_by`'s weights, to a
        ready worker serving them (chosen now, as load changes while prompts
        are prepared)."""
        state.model_digest, state.model_names = prepared_by.hello.model_digest, prepared_by.names
        if not any(_serves(w, state.model_digest, state.model_names) for w in self.workers.values()):
            raise WorkerUnavailable("the worker went away")
        self.outputs.add(state)
        self._dispatch(state)

    async def embed(self, request_id: str, inputs: list[list[int]], prepared_by: WorkerState) -> Embeddings:
        """Embed the inputs on the least loaded ready worker serving
        `prepared_by`'s weights. WorkerUnavailable if there is none or it is
        lost meanwhile (embedding again is cheap: the client may retry);
        WorkerRejected if the worker cannot embed them."""
        ready = [w for w in self.workers.values() if _serves(w, prepared_by.hello.model_digest, prepared_by.names)]
        if not ready:
            raise WorkerUnavailable("the worker went away")
        # Embeddings requests count as load too: each worker reads its own in turn.
        load = self._running_by_worker() + Counter(identity for identity, _ in self._embeds.values())
        worker = min(ready, key=lambda w: load[w.identity])
        answer: asyncio.Future[Embeddings] = asyncio.get_running_loop().create_future()
        self._embeds[request_id] = (worker.identity, answer)
        try:
            if not self._send(worker.identity, Embed(request_id, inputs)):
                raise WorkerUnavailable("the worker's connection is gone")
            return await answer
        finally:
            self._embeds.pop(request_id, None)
            # Given up on here (cancelled, which cancels the awaited answer too): not worth its steps.
            if (answer.cancelled() or not answer.done()) and worker.identity in self.workers:
                self._send(worker.identity, Abort([request_id]))

    def abort(self, request_ids: list[str]) -> None:
        """Drop requests whose client is done with them, and tell their workers
        to drop those still running. Only `Serving.generate`'s stop calls this
        (at the request's end, or at once for a timeout, a cancel, a drain)."""
        dropped: dict[bytes, list[str]] = {}
        for request_id in request_ids:
            self._resume_by.pop(request_id, None)
            state = self.outputs.get(request_id)
            if state is not None and self.outputs.abort(request_id) and state.worker in self.workers:
                dropped.setdefault(state.worker, []).append(state.wire_id)
        for identity, ids in dropped.items():
            self._send(identity, Abort(ids))

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

    def _names_of(self, model: str) -> list[str]:
        """What clients ask for to reach a worker of `model` (its --model, as its Hello says)."""
        return self.served_model_name or [model]

    def _running_by_worker(self) -> Counter[bytes | None]:
        """Our running requests (choices) on each worker: what balancing counts."""
        return Counter(state.worker for state in self.outputs)

    def _least_loaded(self, model: str | None) -> WorkerState | None:
        """The ready worker serving `model` (None: any) running the fewest of our requests."""
        ready = [w for w in self.workers.values() if w.ready and (model is None or model in w.names)]
        if not ready:
            return None
        load = self._running_by_worker()
        return min(ready, key=lambda w: load[w.identity])

    def _dispatch(self, state: RequestState) -> WorkerState | None:
        """Send the request (or its continuation) to the ready worker serving its
        weights that the module's docstring says; None if there is none, or
        the send failed (the request then waits for one)."""
        ready = [w for w in self.workers.values() if _serves(w, state.model_digest, state.model_names)]
        if not ready:
            return None
        load = self._running_by_worker()
        least = min(load[w.identity] for w in ready)
        message = state.add_request()
        blocks = prefix_blocks(message.prompt_token_ids, message.cache_scope)
        worker = max((w for w in ready if load[w.identity] < least + AFFINITY_SLACK),
                     key=lambda w: (w.prefixes.matched(blocks), -load[w.identity]))
        if not self._send(worker.identity, message, state.buffers):
            # Its connection is gone: over tcp perhaps a blip the worker comes
            # back from. The request waits for a worker as a lost one's do.
            self._resume_by[state.request_id] = time.monotonic() + self.worker_wait_s
            return None
        worker.prefixes.add(blocks)
        state.worker = worker.identity
        return worker

    def _send(self, identity: bytes, message: ToWorker, buffers: Sequence[Any] = ()) -> bool:
        """False when the peer's connection is gone."""
        if self.transport.send(identity, message, buffers):
            return True
        # Acted on after the caller is done with its own bookkeeping.
        asyncio.get_running_loop().call_soon(self._on_disconnect, identity)
        return False

    async def _watch_connections(self) -> None:
        """When a connection closes, find out whether it was the worker's by
        sending it a Welcome it already has (ignored by a live worker)."""
        while True:
            await self.transport.closed_connection()
            for delay in (0.0, 0.05):  # the socket may learn of the closed pipe a moment after the event
                await asyncio.sleep(delay)
                for w in list(self.workers.values()):
                    self._send(w.identity, Welcome(w.hello.epoch))

    def _on_message(self, identity: bytes, frame: bytes) -> None:
        """A message from a worker, as the transport hands it over (on the loop)."""
        try:
            message = decode_from_worker(frame)
        except ProtocolError as e:
            self._reject(identity, frame, e)
            return
        if isinstance(message, Hello):
            if identity in self._given_up:
                # Back from a partition it was given up on, its engine may still run
                # requests that moved on: it restarts afresh rather than answer twice.
                self._send(identity, Refused("the gateway gave up on this worker while it was unreachable; "
                                             "its requests went on elsewhere"))
            elif identity in self.workers:
                # Our Welcome crossed its retry, or (over tcp) its connection dropped
                # and came back: answered now, so that a Goodbye right behind it
                # finds no answer still to come. Over tcp which of the two it was
                # cannot be told here, and taking back costs only work redone after a
                # crossed Welcome. Over ipc the connection lives as long as the
                # process: it is a crossed Welcome, and its requests stay where they run.
                self._send(identity, Welcome(message.epoch))
                if not self.transport.ipc:
                    self._take_back(self.workers[identity])
            elif identity not in self._accepting:  # else the first Hello's answer welcomes it
                task = asyncio.create_task(self._accept(identity, message))
                self._accepting[identity] = task
                task.add_done_callback(lambda _: self._accepting.pop(identity, None))
            return
        if isinstance(message, LoadFailed):
            log.error("worker pid %d cannot load its model %r: %s", message.pid, message.model, message.reason)
            named = announced_name(WorkerSettings(model=message.model))  # as its Hello would have named it
            self._event(message.pid, self._names_of(named), "load failed", message.reason)
            self.load_failure = self.load_failures[message.model] = message
            self.notify()
            return
        if isinstance(message, Heartbeat):  # from the worker's own heartbeat socket: known by its epoch
            beating = next((w for w in self.workers.values() if w.hello.epoch == message.epoch), None)
            if beating is not None:
                self._on_heartbeat(beating, message)
            return
        w = self.workers.get(identity)
        if w is None:  # a lost or replaced worker's leftovers, or one not welcomed yet
            if isinstance(message, Goodbye) and identity in self._accepting:
                self._accepting[identity].cancel()  # gone before its Hello was answered
            elif isinstance(message, StepOutput):
                # Requests nobody here reads (resumed elsewhere, or a gateway's before a
                # restart): the worker stops spending steps on them.
                self.transport.send(identity, Abort([o.request_id for o in message.outputs]))
            return
        if isinstance(message, StepOutput):
            aborts = self.outputs.process(message, identity)
            if aborts:
                self._send(w.identity, Abort(aborts))
        elif isinstance(message, Error):
            self._on_error(message, identity)
        elif isinstance(message, Embeddings):
            pending = self._embeds.get(message.request_id)
            if pending is not None and pending[0] == identity and not pending[1].done():
                pending[1].set_result(message)
        elif isinstance(message, Draining):
            w.vitals.draining = True
            self._assess(w)
        elif isinstance(message, Goodbye):
            self._lose_worker(w, f"it said goodbye ({message.reason})", handed_back=set(message.handed_back),
                              lost=not message.clean)

    async def _tokenizer_for(self, hello: Hello) -> Tokenizer:
        """The tokenizer of a worker's files: a serving worker's, else one load
        shared by every Hello with the same files meanwhile (replicas starting together)."""
        digest = files_digest(hello.tokenizer_files)
        known = next((w.tokenizer for w in self.workers.values() if w.tokenizer.digest == digest), None)
        if known is not None:
            return known
        loading = self._tokenizer_loads.get(digest)
        if loading is None:
            loading = asyncio.ensure_future(asyncio.to_thread(Tokenizer, hello.tokenizer_files, hello.vision))
            self._tokenizer_loads[digest] = loading

            def loaded(task: asyncio.Future[Tokenizer]) -> None:
                del self._tokenizer_loads[digest]
                # The exception is seen here, whether or not a Hello still waits for it.
                if not task.cancelled() and task.exception() is None:
                    self.on_tokenizer()

            loading.add_done_callback(loaded)
        return await asyncio.shield(loading)  # one Hello's answer cancelled must not cancel the others'

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
        try:
            tokenizer = await self._tokenizer_for(hello)
        except Exception as e:  # files the gateway cannot use: this worker cannot serve through it
            log.exception("refused a worker (pid %d): its tokenizer files cannot be loaded", hello.pid)
            self._send(identity, Refused(f"the gateway cannot load this model's tokenizer: {e}"))
            return
        names = self._names_of(hello.model)
        now = time.monotonic()
        try:
            state = WorkerState(
                identity, hello, names, tokenizer, accepted_at=now,
                vitals=Vitals(self.worker_timeout_s, self.hung_worker_s, last_beat=now, last_progress=now),
                sampling=sampling_defaults(hello.tokenizer_files), tool_format=load_tool_format(hello.tool_parser),
                reasoning_markers=(hello.reasoning_markers[0], hello.reasoning_markers[1])
                if len(hello.reasoning_markers) == 2 else tokenizer.reasoning_markers)
        except Exception as e:  # else the worker would say Hello again forever, never answered
            log.exception("refused a worker (pid %d): its Hello cannot be served", hello.pid)
            self._send(identity, Refused(f"the gateway cannot serve this worker: {e}"))
            return
        if not self._send(identity, Welcome(hello.epoch)):
            # Gone while its tokenizer loaded (killed, crashed): nothing to
            # replace anything with, nor to resume requests on.
            log.warning("worker pid %d left before its Hello was answered", hello.pid)
            return
        for old in list(self.workers.values()):
            if not set(old.names) & set(names):
                continue  # another model's
            # A draining one is finishing its streams (its operator stopped it): it goes by itself.
            if old.hello.model_digest != hello.model_digest or old.vitals.state in UNHEALTHY:
                why = "serving other weights" if old.hello.model_digest != hello.model_digest else "not answering"
                self._lose_worker(old, f"replaced by a newer worker (pid {hello.pid}); it was {why}", set())
                # Should the old one wake up, it must not serve beside the new one.
                self._send(old.identity, Refused(f"replaced by a newer worker; this one was {why}"))
        self.load_failure = None
        self.stats.workers_accepted += 1
        self.workers[identity] = state
        self._update_ready()
        log.info(
            "worker ready: pid %d, epoch %d, model %s, context %d, capacity %d",
            hello.pid, hello.epoch, hello.model, hello.context_length, hello.capacity,
        )
        self._event(hello.pid, names, "ready", f"epoch {hello.epoch}")
        self._resume_waiting()

    def _resume_waiting(self) -> None:
        """Send the requests a lost worker left to a ready worker serving their weights."""
        resumed: Counter[int] = Counter()
        for request_id in list(self._resume_by):
            state = self.outputs.get(request_id)
            if state is None:
                del self._resume_by[request_id]
                continue
            w = self._dispatch(state)
            if w is None:
                other = next((o for o in self.workers.values() if o.ready and o.hello.model_digest != state.model_digest
                              and set(o.names) & set(state.model_names)), None)
                if other is not None:  # its model's name is served by other weights now
                    del self._resume_by[request_id]
                    self._fail_after_loss(request_id, f"the worker came back serving other weights "
                                          f"({other.hello.model}); this request cannot continue on them")
                continue
            del self._resume_by[request_id]
            resumed[w.hello.pid] += 1
        for pid, count in resumed.items():
            self.stats.requests_resumed += count
            log.info("resumed %d requests on worker pid %d", count, pid)

    def _on_heartbeat(self, w: WorkerState, beat: Heartbeat) -> None:
        # Requests sent to it count as work even before it has read them: a worker whose
        # main thread is stuck while idle (a distributed group's rank frozen) never reads them.
        sent = sum(1 for s in self.outputs if s.worker == w.identity)
        w.vitals.beat(time.monotonic(), beat.step, beat.running, beat.waiting + sent, beat.cpu_s)
        w.waiting, w.affinity, w.prefix_cache, w.memory = beat.waiting, beat.affinity, beat.prefix_cache, beat.memory
        self._assess(w)

    def _assess(self, w: WorkerState) -> None:
        """Act on what the worker's vitals say: log a change, set readiness,
        kill a hung worker, give up on one unhealthy too long."""
        verdict = w.vitals.assess(time.monotonic())
        if verdict.changed:
            level = logging.WARNING if verdict.state in UNHEALTHY else logging.INFO
            log.log(level, "worker pid %d: %s -> %s", w.hello.pid, verdict.previous.value, verdict.state.value)
            self._event(w.hello.pid, w.names, verdict.state.value, f"was {verdict.previous.value}")
        was_ready, w.ready = w.ready, verdict.state == Liveness.READY
        if w.ready != was_ready:
            self._update_ready()
        if w.ready and not was_ready:
            self._resume_waiting()
        if verdict.kill and verdict.state == Liveness.HUNG:
            log.error("worker pid %d is hung: no step for %.1fs with requests running%s", w.hello.pid,
                      time.monotonic() - w.vitals.last_progress, " (and its CPU busy)" if w.vitals.busy() else "")
        if verdict.kill and self.on_unhealthy is not None:
            self.on_unhealthy(w.hello.pid)
        if verdict.give_up:
            # Its requests move on to the next worker (or fail after
            # --worker-wait-s) rather than wait for it forever; should it
            # come back (a partition healed), it is refused (see _on_message).
            self._lose_worker(w, f"{verdict.state.value} for {verdict.unhealthy_for:.0f}s", handed_back=set())
            self._given_up.add(w.identity)
            self._send(w.identity, Refused("the gateway gave up on this worker: it was unresponsive"))

    def _update_ready(self) -> None:
        if any(w.ready for w in self.workers.values()):
            self._ready.set()
        else:
            self._ready.clear()
        self.notify()

    def _on_disconnect(self, identity: bytes) -> None:
        """A peer's connection closed. Over ipc the worker process is gone (a
        stopped or busy one keeps its socket); over tcp it may be a network
        blip that ZeroMQ reconnects, so the worker is only unresponsive."""
        w = self.workers.get(identity)
        if w is None:
            return
        if self.transport.ipc:
            self._lose_worker(w, "its connection closed", handed_back=set())
        else:
            w.vitals.disconnected = w.dropped = True
            # An Embed or its answer may be gone with the connection; embedding again is the client's to do.
            self._fail_embeds(w, "the connection to the worker broke while it embedded")
            self._assess(w)

    def worker_process_exited(self, pid: int, status: int | None, asked: bool = False) -> None:
        """`mlxd serve`'s supervisor saw the worker process end; `asked`: it had been told to stop."""
        for w in list(self.workers.values()):
            if w.hello.pid == pid:
                self._lose_worker(w, f"its process exited with status {status}", handed_back=set(),
                                  lost=not (asked and status == 0))

    def _on_error(self, error: Error, identity: bytes) -> None:
        """A worker's error about a request: only the request's own worker's counts."""
        if error.request_id is None:
            log.warning("the worker could not read a message: %s", error.message)
            return
        if (pending := self._embeds.get(error.request_id)) is not None:
            if pending[0] == identity and not pending[1].done():
                pending[1].set_exception(WorkerRejected(error.message, error.internal))
            return
        state = self.outputs.of_wire(error.request_id)
        if state is not None and state.worker == identity:
            self.outputs.fail(state.request_id, f"the worker rejected the request: {error.message}", 500)

    def _lose_worker(self, w: WorkerState, why: str, handed_back: set[str], lost: bool = True) -> None:
        """The worker is gone; `lost`: not as it was asked to (a drain, an unload), which is counted and shown."""
        if self.workers.pop(w.identity, None) is None:
            return
        if lost:
            log.warning("worker pid %d lost: %s", w.hello.pid, why)
            self.stats.workers_lost += 1
        else:
            log.info("worker pid %d stopped: %s", w.hello.pid, why)
        self._event(w.hello.pid, w.names, "lost" if lost else "stopped", why)
        self._update_ready()
        self._fail_embeds(w, f"the worker was lost while embedding: {why}")
        states = [s for s in self.outputs if s.worker == w.identity]
        self._move_on(states, [s.wire_id not in handed_back for s in states], why)

    def _take_back(self, w: WorkerState) -> None:
        """What a worker sent while its tcp connection was down is lost (ZeroMQ
        drops a closed connection's queue, and refuses sends until it is back):
        its requests are taken back, aborted there and resumed from what
        arrived here, as new attempts (whose outputs the old ones' cannot pass for)."""
        states = [s for s in self.outputs if s.worker == w.identity]
        dropped, w.dropped = w.dropped, False
        if not states:
            return
        log.warning("worker pid %d came back over a new connection: resuming its %d requests", w.hello.pid,
                    len(states))
        self._send(w.identity, Abort([s.wire_id for s in states]))
        # A connection seen to drop is a loss (a link that keeps dropping must not resume them for ever);
        # a Hello that crossed its Welcome, or came before the drop was seen here, is not.
        self._move_on(states, [dropped] * len(states), "its connection dropped")

    def _move_on(self, states: list[RequestState], lost: list[bool], why: str) -> None:
        """Requests off their worker wait for the next one (--worker-wait-s), each
        counting a loss where `lost` says so; past MAX_WORKER_LOSSES one fails."""
        deadline = time.monotonic() + self.worker_wait_s
        for state, loss in zip(states, lost, strict=True):
            state.worker = None
            state.worker_losses += loss
            if state.worker_losses > MAX_WORKER_LOSSES:
                self._fail_after_loss(state.request_id, f"the worker was lost twice during this request: {why}")
            else:
                self._resume_by[state.request_id] = deadline
        self._resume_waiting()

    def _fail_embeds(self, w: WorkerState, why: str) -> None:
        for identity, answer in self._embeds.values():
            if identity == w.identity and not answer.done():
                answer.set_exception(WorkerUnavailable(why))

    def _event(self, pid: int, names: list[str], event: str, detail: str) -> None:
        self.events.append(WorkerEvent(time.time(), pid, ", ".join(names), event, detail))

    def _fail_after_loss(self, request_id: str, why: str) -> None:
        """End a request that a lost worker left without a way on (a 503, counted)."""
        if self.outputs.fail(request_id, why, 503):
            self.stats.requests_failed_by_loss += 1

    async def _watchdog(self) -> None:
        ticked = time.monotonic()
        while True:
            await asyncio.sleep(WATCHDOG_INTERVAL_S)
            now = time.monotonic()
            if (away_s := now - ticked - WATCHDOG_INTERVAL_S) > min(GATEWAY_STALL_S, self.worker_timeout_s / 2):
                # The gateway stood still (its loop, or its process): its workers' silence meanwhile is its own.
                log.warning("the gateway's event loop stood still for %.1fs", away_s)
                for w in self.workers.values():  # a beat read since it woke (just now) stands as it is
                    w.vitals.excuse(now - away_s / 2, away_s)
            ticked = now
            for w in list(self.workers.values()):
                self._assess(w)
            for request_id, deadline in list(self._resume_by.items()):
                if now > deadline:
                    del self._resume_by[request_id]
                    self._fail_after_loss(request_id, f"no worker came back within {self.worker_wait_s:g}s")


def _serves(worker: WorkerState, digest: str, names: Sequence[str]) -> bool:
    """A ready replica of a request's model: its weights, under one of its names (two models of the same
    weights, `--model a=X --model b=X`, keep to their own workers: each is charged its own)."""
    return worker.ready and worker.hello.model_digest == digest and not set(worker.names).isdisjoint(names)
