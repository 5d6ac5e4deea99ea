"""The models `mlxd serve` runs: which are loaded, within what memory, for how long.

Each configured model has a supervisor (gateway/supervisor.py) that the pool
starts when a request needs the model (or at start: --preload, --pin) and
stops when it has been idle past its keep-alive (--keep-alive, or the
`keep_alive` of the request that used it last), or to make room for another.
Room is two limits: --max-loaded-models, and the memory ledger
(gateway/ledger.py) of --memory-budget. Making room unloads idle, unpinned
models, least recently used first; while none can go, a request for an
unloaded model waits (within --worker-wait-s) for one to become idle.

A model's worker stops without holding the pool's lock (a draining worker
may take --drain-s): meanwhile its memory stays charged, so nothing starts
into room it has not given back, and requests for other models go on.

Every request holds a Lease on its model while it runs, so its model is not
unloaded under it, and reserves its KV state in the ledger before anything is
sent to a worker: a request that does not fit beside the running ones waits
for them (first come, first served, within --worker-wait-s), and one that
still cannot fit is refused with a 503 and Retry-After before its 200, never
discovered by an out-of-memory crash.

Workers that connect on their own (`mlxd gateway`, replicas, other Macs) are
not the pool's: a request for one of their models (one the pool has not
loaded) takes a Lease that loads nothing and reserves nothing.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import msgspec

from gateway.ledger import Charge, batch_kv, weights_on_disk
from gateway.liveness import UNHEALTHY
from gateway.supervisor import WorkerSupervisor, local_pids
from gateway.worker_link import WorkerLink
from protocol import KVFootprint
from protocol.units import format_size
from protocol.worker_settings import WorkerSettings, announced_name, group_hosts, model_source

log = logging.getLogger("mlxd.gateway.pool")

REAP_INTERVAL_S = 0.25
# What a client is told to wait before retrying a request the pool cannot serve now.
RETRY_AFTER_S = 5
# How long a model that could not load answers its requests with the reason
# before a request tries to load it again (an admin load tries at once).
FAILED_LOAD_HOLD_S = 30.0
ASKED = "unloaded by an admin request"  # why a model unloads, in the log and the ops page's tail


class Unavailable(Exception):
    """The pool cannot serve this now: the message says why, and the code what for, in the 503.
    `never`: nor later, the request itself being too large (its client's 400: SDKs retry a 503)."""

    def __init__(self, message: str, code: str = "no_room", never: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.never = never


@dataclass
class PooledModel:
    name: str
    supervisor: WorkerSupervisor
    charge: Charge
    pinned: bool = False
    users: int = 0  # Leases held: requests running on it (or waiting for it)
    last_used: float = 0.0
    idle_until: float = math.inf  # when it is unloaded, once idle
    failure: str | None = None  # why its last load failed, until the next
    failed_at: float = 0.0
    unload_requested: bool = False  # by an admin, while requests ran: it unloads when they end
    # Its keep-alive, whose clock starts once its worker is ready: loaded at start and asked for by no
    # request yet, or left by its last request while still loading (a load longer than --worker-wait-s
    # is not stopped for being idle, to start over at the next request).
    idle_once_ready: float | None = None
    # While its worker is being stopped: ends once it has exited (until then its memory is not free).
    stop_task: asyncio.Task | None = None

    @property
    def stopping(self) -> bool:
        return self.stop_task is not None

    @property
    def running(self) -> bool:
        """Loaded or loading, and not being stopped."""
        return self.supervisor.running and not self.stopping

    @property
    def holds_memory(self) -> bool:
        """Its worker runs (serving, loading, draining with the server) or is being stopped."""
        return self.supervisor.alive or self.stopping

    def load_error(self) -> str | None:
        """Why its last load failed, while it is not running."""
        return self.failure if not self.running else None


@dataclass(eq=False)  # two alike are still two requests: the line for room finds each by identity
class Lease:
    """A request's hold on its model, and its KV reservation; released once."""

    pool: ModelPool
    model: PooledModel | None  # None: a model of workers the pool did not start
    keep_alive_s: float | None  # the request's keep_alive (None: the server's)
    rows: list[int] = field(default_factory=list)  # the most tokens each of its sequences may reach
    other: int = 0  # KV bytes reserved beside the decode batch
    released: bool = field(default=False)

    async def reserve(self, footprint: KVFootprint, rows: Sequence[int] = (), other: int = 0,
                      wait_s: float = 0.0) -> None:
        """Reserve KV memory for the request: sequences of up to `rows` tokens in
        the model's batch, and `other` bytes beside it, waiting up to wait_s for
        room (Unavailable if it does not fit by then)."""
        if self.model is not None:
            await self.pool.reserve(self, footprint, list(rows), other, wait_s)

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.pool.release(self)


class ModelPool:
    def __init__(
        self,
        link: WorkerLink,
        worker_settings: Sequence[WorkerSettings],
        *,
        budget: int,
        max_loaded: int,
        keep_alive_s: float,
        pinned: Sequence[str] = (),
        preload: bool = False,
        served_model_name: Sequence[str] = (),
        stop_timeout_s: float,
    ) -> None:
        """served_model_name: the one model's names (--served-model-name), the first its own."""
        self.link = link
        self.budget = budget
        self.max_loaded = max_loaded
        self.keep_alive_s = keep_alive_s
        self.preload = preload
        self.models: dict[str, PooledModel] = {}
        self.aliases = {alias: served_model_name[0] for alias in served_model_name[1:]}
        for ws in worker_settings:
            name = served_model_name[0] if served_model_name else announced_name(ws)
            hosts = group_hosts(ws)  # a group's ranks each keep a prefix cache about as large as rank 0's
            self.models[name] = PooledModel(
                name, WorkerSupervisor(ws, link, stop_timeout_s),
                Charge(weights_on_disk(model_source(ws)), ws.prefix_cache_bytes * hosts, hosts=hosts),
                pinned=name in pinned)
        unknown = set(pinned) - set(self.models)
        if unknown:
            raise ValueError(f"--pin {', '.join(sorted(unknown))}: not a served model ({', '.join(self.models)})")
        if len(set(pinned)) > max_loaded:
            raise ValueError(f"--pin names {len(set(pinned))} models; --max-loaded-models is {max_loaded}")
        self._lock = asyncio.Lock()  # one decision about loading and unloading at a time
        self._changed = asyncio.Event()  # set, and replaced, when a model becomes idle or unloads
        # Models whose loads wait for busy ones to become idle, first come first: new requests to the
        # busy ones wait behind them (else a model in steady use kept another out for good).
        self._waiting_loads: list[PooledModel] = []
        # Requests waiting for KV room, first come first served among a model's requests: a large one
        # is not passed for good by small ones. (Not across models: one waiting for room that an idle
        # model would give must not hold up that model's own requests, which keep it busy meanwhile.)
        self._waiting_room: list[Lease] = []
        self._reaper: asyncio.Task | None = None
        self._starting: set[str] = set()  # loaded at start, not yet ready
        self._unloading: set[asyncio.Task] = set()
        self._closing = False  # the server is stopping: nothing loads any more
        self._closed = asyncio.Event()  # set with _closing, for the waits it must end
        self.on_fatal: Callable[[str], None] | None = None  # a model that must load at start cannot

    def find(self, name: str) -> PooledModel | None:
        """The model a served name (or one of its --served-model-name aliases) names."""
        return self.models.get(self.aliases.get(name, name))

    @property
    def supervisors(self) -> list[WorkerSupervisor]:
        return [m.supervisor for m in self.models.values()]

    # ---- lifetime ------------------------------------------------------------

    async def start(self) -> None:
        """Load the pinned models (and with --preload, every model that fits,
        in order, after them: a preloaded model never takes a pinned one's room)."""
        for m in sorted(self.models.values(), key=lambda m: not m.pinned):
            if m.pinned or self.preload:
                async with self._lock:
                    if self._room_for(m, m.charge.fixed_here, idle_only=True) != []:
                        if m.pinned:
                            raise Unavailable(f"the pinned model {m.name} does not fit: {self._why_no_room(m)}")
                        log.warning("--preload: %s is left unloaded: %s", m.name, self._why_no_room(m))
                        continue
                    await self._start(m, at_start=True)
                    m.idle_once_ready = None if m.pinned else self.keep_alive_s
                    self._starting.add(m.name)
        self._reaper = asyncio.create_task(self._reap(), name="mlxd-pool-reaper")

    async def stop(self) -> None:
        self._closing = True
        self._closed.set()
        self._notify()
        if self._reaper is not None:
            self._reaper.cancel()
        stopping = [m.stop_task for m in self.models.values() if m.stop_task is not None]
        await asyncio.gather(*self._unloading, *stopping, *(m.supervisor.stop() for m in self.models.values()),
                             return_exceptions=True)

    def stop_restarting(self) -> None:
        """The server drains: running workers stay for the open requests, none starts."""
        self._closing = True
        self._closed.set()  # requests waiting for workers to stop hear it now
        self._notify()  # requests waiting for room hear it now
        self.link.refuse_waiting("the server is shutting down")  # and those waiting for a load
        for m in self.models.values():
            m.supervisor.stop_restarting()

    # ---- what requests use ---------------------------------------------------

    async def lease(self, name: str, keep_alive_s: float | None, wait_s: float, retry_failed: bool = False) -> Lease:
        """Hold `name` for a request, starting it if it is not loaded (making
        room first). Unavailable if no room is made within wait_s, or while
        its last load's failure holds (unless retry_failed)."""
        m = self.find(name)
        if m is None or not m.running and self._served_elsewhere(name):
            return Lease(self, None, keep_alive_s)
        lease = Lease(self, m, keep_alive_s)
        if (m.load_error() is not None and not retry_failed
                and time.monotonic() - m.failed_at < FAILED_LOAD_HOLD_S):
            raise Unavailable(f"the model {name}: {m.failure}", "model_load_failed")
        deadline = time.monotonic() + wait_s
        while m.running and not m.pinned and any(o is not m for o in self._waiting_loads):
            if not await _set_within(self._changed, deadline - time.monotonic()):
                break  # the loads it waited behind give up before it would
        m.users += 1
        m.idle_once_ready = None
        m.last_used = time.monotonic()
        try:
            await self._load(m, deadline)
        except BaseException:
            lease.release()
            raise
        return lease

    async def reserve(self, lease: Lease, footprint: KVFootprint, rows: list[int], other: int,
                      wait_s: float) -> None:
        """Charge a request's KV state to its model (and its lease, which gives
        it back), unloading idle models to make room (returning once they have
        exited). Where the budget cannot hold it beside the running requests,
        it waits up to wait_s for them to end, behind the requests that began
        waiting before it; Unavailable if it does not fit by then, or never could."""
        m = lease.model
        assert m is not None
        deadline = time.monotonic() + wait_s
        self._waiting_room.append(lease)
        try:
            while True:
                async with self._lock:
                    if lease.released:  # its request ended (a cancel, a drain) while it waited
                        raise Unavailable("the request ended before its memory was reserved", "request_ended")
                    self._measure(m)  # its weights as its worker measured them: not on disk before a download
                    charge = m.charge
                    needed = batch_kv(footprint, charge.rows + rows) + charge.kv_other + other - charge.kv_reserved
                    victims = self._room_for(m, charge.here(charge.fixed + charge.kv_reserved + needed),
                                             idle_only=True)
                    ahead = [w for w in self._waiting_room[:self._waiting_room.index(lease)] if w.model is m]
                    if victims is not None and not ahead:
                        charge.footprint = footprint
                        charge.rows += rows
                        charge.kv_other += other
                        lease.rows += rows
                        lease.other += other
                        stops = self._make_room(victims, f"making room for a request to {m.name}")
                        break
                    if victims is None:
                        self._refuse_never(m, footprint, rows, other, needed)
                    # A request let in before the drain finishes if it fits; one that would wait is refused.
                    if self._closing:
                        raise Unavailable("the server is shutting down", "shutting_down")
                    changed = self._changed
                if not await _set_within(changed, deadline - time.monotonic()):
                    why = (f"did not fit in the memory budget ({format_size(self.budget)}, {format_size(self.used)} "
                           "in use)" if victims is None else
                           f"waited behind {len(ahead)} earlier request(s) to {m.name} that did not fit")
                    raise Unavailable(f"{_reservation(needed, rows)} {why} within {wait_s:g}s; retry when running "
                                      "requests have finished", "memory_budget_exceeded")
        finally:
            self._waiting_room.remove(lease)
            if self._waiting_room:
                self._notify()  # the next in line looks again
        if stops:
            await self._stopped(stops)

    def _refuse_never(self, m: PooledModel, footprint: KVFootprint, rows: list[int], other: int,
                      needed: int) -> None:
        """A 400 for a reservation that would not fit however long it waited: too
        large alone, or beside the pinned models' weights, which stay while their pins do."""
        alone = m.charge.here(batch_kv(footprint, rows) + other + m.charge.fixed)
        pinned = self._pinned_besides(m)
        if alone + sum(o.charge.fixed_here for o in pinned) <= self.budget:
            return
        why = (("lower max_tokens (or n)" if rows else "shorten its inputs") if alone > self.budget else
               f"the pinned models ({', '.join(o.name for o in pinned)}) hold the rest")
        raise Unavailable(
            f"{_reservation(needed, rows)} does not fit in the memory budget ({format_size(self.budget)}, "
            f"{format_size(self.used)} in use); {why}",
            "memory_budget_exceeded", never=True)

    def release(self, lease: Lease) -> None:
        m = lease.model
        if m is None:
            return
        for tokens in lease.rows:
            m.charge.rows.remove(tokens)
        m.charge.kv_other -= lease.other
        m.users -= 1
        m.last_used = time.monotonic()
        if m.users == 0:
            keep = self.keep_alive_s if lease.keep_alive_s is None else lease.keep_alive_s
            m.unload_requested &= m.holds_memory  # asked of a model that never started: nothing left to unload
            if m.unload_requested:
                keep = 0.0
            m.idle_until = math.inf if m.pinned else m.last_used + keep
            if not m.pinned and not m.unload_requested and m.running and self.status(m.name) != "loaded":
                m.idle_once_ready, m.idle_until = keep, math.inf
            elif keep == 0 and (not m.pinned or m.unload_requested):
                self._unload_soon(m)
        self._notify()

    # ---- what operators use (the admin endpoints) ---------------------------

    async def unload(self, name: str) -> bool:
        """Unload a model now if it is idle (True); else once its running requests end (False)."""
        m = self.find(name)
        assert m is not None
        async with self._lock:
            if m.users > 0:
                m.unload_requested = True
                return False
            stops = self._make_room([m] if m.holds_memory else [], ASKED)
        if stops:
            await asyncio.wait(stops)
        return True

    def pin(self, name: str, pinned: bool) -> None:
        """Keep the model loaded however long it is idle (it still loads on
        demand; an unload asked for meanwhile is called off), or let it unload
        after its keep-alive again. ValueError when pinning it would pin more
        models than may be loaded, or than the budget holds together (pinned
        models are never unloaded for room: the others would be refused for good)."""
        m = self.find(name)
        assert m is not None
        if pinned and not m.pinned:
            pinned_ones = [o for o in self.models.values() if o.pinned] + [m]
            if len(pinned_ones) > self.max_loaded:
                raise ValueError(f"pinning {name} would pin more models than --max-loaded-models ({self.max_loaded})")
            if (needed := sum(o.charge.fixed_here for o in pinned_ones)) > self.budget:
                raise ValueError(f"pinning {name} would pin models needing {format_size(needed)} together, more "
                                 f"than the memory budget of {format_size(self.budget)}")
        m.pinned = pinned
        self._notify()  # unpinned and idle, it may now go for a request waiting for room
        if pinned:
            m.idle_once_ready, m.idle_until, m.unload_requested = None, math.inf, False
        elif m.users == 0 and m.running and self.status(name) != "loaded":
            m.idle_once_ready, m.idle_until = self.keep_alive_s, math.inf  # from when it is ready, as release() has it
        elif m.users == 0:
            m.idle_until = time.monotonic() + self.keep_alive_s

    def call_off_unload(self, name: str) -> None:
        """An operator loads or pins a model it asked to unload while requests ran: it stays."""
        m = self.find(name)
        assert m is not None
        m.unload_requested = False

    # ---- what /ready, /health, /metrics and /v1/models show -----------------

    @property
    def ready(self) -> bool:
        return not self.not_ready()

    def not_ready(self) -> list[str]:
        """The models that keep the server from being ready: those loaded at
        start (the pinned ones among them) that have not been ready yet, and
        those whose worker exited or stopped answering, without a ready one (a
        crash, a restart, a worker frozen). A model unloaded by an operator,
        pinned or not, or loading on demand is no reason to send clients elsewhere."""
        # One unloaded before it was ready (room for another model) is no longer awaited.
        self._starting = {name for name in self._starting if self.status(name) == "loading"}
        unhealthy = {name for w in self.link.workers.values() if w.vitals.state in UNHEALTHY for name in w.names}
        ailing = {m.name for m in self.models.values() if m.running and (m.supervisor.restarted or m.name in unhealthy)
                  and self.status(m.name) != "loaded"}
        return sorted(self._starting | ailing)

    def status(self, name: str) -> str:
        """"loaded" (a ready worker serves it), "loading" (started, not ready yet), "unloading" (its
        worker is being stopped: its memory is not free yet) or "unloaded"."""
        m = self.find(name)
        if m is not None and m.stopping:
            return "unloading"
        if any(w.ready and name in w.names for w in self.link.workers.values()):
            return "loaded"
        return "loading" if m is not None and m.running else "unloaded"

    def charge(self, name: str) -> Charge | None:
        """The ledger's entry of a model that holds memory (None for one that is
        not the pool's, or neither running nor stopping)."""
        m = self.find(name)
        if m is None or not m.holds_memory:
            return None
        self._measure(m)
        return m.charge

    @property
    def used(self) -> int:
        return sum(charge.total_here for m in self.models.values() if (charge := self.charge(m.name)) is not None)

    def ledger(self) -> dict:
        """The budget, what is used, and each model's state and charge (/health's `pool`)."""
        now = time.monotonic()
        return {"budget": self.budget, "used": self.used, "max_loaded_models": self.max_loaded,
                "models": {m.name: self._ledger_entry(m, now) for m in self.models.values()}}

    def _ledger_entry(self, m: PooledModel, now: float) -> dict:
        idle = m.running and not m.users and m.idle_once_ready is None
        entry: dict = {"status": self.status(m.name), "pinned": m.pinned, "users": m.users,
                       # Its requests waiting for running ones to leave room for their KV state.
                       "waiting_for_memory": sum(lease.model is m for lease in self._waiting_room),
                       "unloads_in_s": round(max(0.0, m.idle_until - now), 1)
                       if idle and m.idle_until != math.inf else None,
                       # Idle, and loaded for good: pinned, or its last request's keep_alive was -1.
                       "stays_loaded": m.pinned or idle and m.idle_until == math.inf,
                       # An operator asked it unloaded while requests ran: it unloads once none runs.
                       "unload_requested": m.unload_requested and m.running,
                       # Its worker keeps exiting: the supervisor starts it again after a pause.
                       "crash_loop": m.supervisor.running and m.supervisor.crash_loop}
        if (charge := self.charge(m.name)) is not None:
            entry["memory"] = charge.as_dict()
        if (error := m.load_error()) is not None:
            entry["load_error"] = error
        return entry

    # ---- inside ----------------------------------------------------------------

    def _measure(self, m: PooledModel) -> None:
        """Take the weights' size from the model's own worker once it has measured them."""
        pid = m.supervisor.process.pid if m.supervisor.process else None
        measured = next((w.hello.weights_bytes for w in self.link.workers.values()
                         if w.hello.pid == pid and w.hello.weights_bytes), None)
        if measured is not None:
            m.charge.weights = measured

    def _served_elsewhere(self, name: str) -> bool:
        """A ready worker the pool did not start (a replica, another Mac) serves the name."""
        local = local_pids(self.supervisors)
        return any(w.ready and name in w.names and w.hello.pid not in local for w in self.link.workers.values())

    def _used_without(self, m: PooledModel) -> int:
        return sum(o.charge.total_here for o in self.models.values() if o.holds_memory and o is not m)

    async def _load(self, m: PooledModel, deadline: float) -> None:
        try:
            while True:
                async with self._lock:
                    if self._closing:
                        raise Unavailable("the server is shutting down", "shutting_down")
                    if m.running:
                        return
                    victims = self._room_for(m, m.charge.fixed_here, idle_only=True)
                    if victims is None and self._room_for(m, m.charge.fixed_here, idle_only=False) is None:
                        pinned = self._pinned_besides(m)
                        if (m.charge.fixed_here + sum(o.charge.fixed_here for o in pinned) > self.budget
                                or len(pinned) >= self.max_loaded):  # nor later, while the pins stand
                            raise Unavailable(f"the model {m.name} cannot load: {self._why_no_room(m)}", never=True)
                    stops = self._make_room(victims or [], f"making room for {m.name}")
                    if m.stop_task is not None:
                        stops.append(m.stop_task)  # its own worker exits before another starts
                    if victims is not None and not stops:
                        await self._start(m)
                        return
                    if victims is None and m not in self._waiting_loads:
                        self._waiting_loads.append(m)
                    changed = self._changed
                remaining = max(0.0, deadline - time.monotonic())
                if stops:  # then look again: another request may have started it meanwhile
                    in_time = await self._stopped(stops, remaining)
                else:
                    in_time = await _set_within(changed, remaining)
                if not in_time:
                    raise Unavailable(f"no room to load {m.name} within the wait: {self._why_no_room(m)}; "
                                      "the models in the way are busy")
        finally:
            if m in self._waiting_loads:
                self._waiting_loads.remove(m)
                self._notify()  # the requests held behind it go on

    def _room_for(self, m: PooledModel, need: int, idle_only: bool) -> list[PooledModel] | None:
        """The models to unload, so that `m`, charged `need` bytes, runs
        beside the rest: those already stopping first (they are going anyway:
        concurrent requests wait for the same ones rather than each unloading
        another), then the least recently used; None if unloading every model
        that may go (idle ones only, or busy ones too) is not enough. Not
        idle_only asks whether it will ever fit: once the running requests
        end, their KV state is gone too (a pinned model's among them)."""
        others = [o for o in self.models.values() if o.holds_memory and o is not m]
        for o in others:
            self._measure(o)
        candidates = sorted((o for o in others if o.stopping
                             or o.running and not o.pinned and (o.users == 0 or not idle_only)),
                            key=lambda o: (not o.stopping, o.last_used))

        def held(o: PooledModel) -> int:
            return o.charge.total_here if idle_only else o.charge.fixed_here

        victims: list[PooledModel] = []
        loaded, used = len(others) + 1, sum(map(held, others))
        while loaded > self.max_loaded or used + need > self.budget:
            if not candidates:
                return None
            victim = candidates.pop(0)
            victims.append(victim)
            loaded -= 1
            used -= held(victim)
        return victims

    def _pinned_besides(self, m: PooledModel) -> list[PooledModel]:
        return [o for o in self.models.values() if o.pinned and o.holds_memory and o is not m]

    def _why_no_room(self, m: PooledModel) -> str:
        if m.charge.fixed_here > self.budget:
            return (f"it needs {format_size(m.charge.fixed_here)} (weights and prefix cache), more than the "
                    f"memory budget of {format_size(self.budget)}")
        running = [o.name + (" (pinned)" if o.pinned else "") for o in self.models.values()
                   if o.holds_memory and o is not m]
        return (f"{len(running)} of at most {self.max_loaded} models loaded ({', '.join(running) or 'none'}), "
                f"{format_size(self._used_without(m))} of the {format_size(self.budget)} budget in use; "
                f"it needs {format_size(m.charge.fixed_here)}")

    async def _start(self, m: PooledModel, at_start: bool = False) -> None:
        """Start the model's worker, its MLX memory limit set to what the budget
        leaves it. A model that cannot load at start ends the server; later, it
        fails the requests waiting for it."""
        share = max(self.budget - self._used_without(m), m.charge.fixed_here)
        m.supervisor.settings = msgspec.structs.replace(m.supervisor.settings, memory_limit_bytes=share)
        m.supervisor.on_fatal = self.on_fatal if at_start else (lambda reason: self._load_failed(m, reason))
        m.failure = None
        m.idle_until = math.inf
        log.info("loading %s (%s of the %s budget in use)", m.name, format_size(self._used_without(m)),
                 format_size(self.budget))
        await m.supervisor.start()

    def _load_failed(self, m: PooledModel, reason: str) -> None:
        log.error("%s could not load: %s", m.name, reason)
        m.failure, m.failed_at = reason, time.monotonic()
        m.unload_requested = False
        self.link.notify()  # its waiting requests learn it now
        self._notify()

    def _make_room(self, victims: list[PooledModel], why: str) -> list[asyncio.Task]:
        """Begin stopping the victims' workers (under the lock); the tasks end
        once each has exited (one already stopping: its task). They are awaited
        without the lock, and never cancelled by a waiter: a worker draining
        for --drain-s must not hold up every other model's requests."""
        for m in victims:
            if m.stop_task is None:
                log.info("unloading %s: %s", m.name, why)
                m.stop_task = asyncio.get_running_loop().create_task(self._stop(m))
        return [m.stop_task for m in victims if m.stop_task is not None]

    async def _stop(self, m: PooledModel) -> None:
        try:
            await m.supervisor.stop()
        finally:
            # An unload asked for is done (one asked for before the model started is kept
            # till then: the requests waiting for it start it, and it unloads after them).
            m.stop_task, m.unload_requested = None, False
            self._notify()

    def _unload_soon(self, m: PooledModel | None) -> None:
        """Unload `m` if it is idle (None: idle models until the pool is back within its budget)."""
        task = asyncio.get_running_loop().create_task(self._unload_if_idle(m) if m else self._unload_excess())
        self._unloading.add(task)  # held until done: the loop keeps only a weak reference
        task.add_done_callback(self._unloading.discard)

    async def _unload_excess(self) -> None:
        """A worker measured its weights as more than its files said (dequantized,
        or a download not made yet, counted as nothing): the pool is over its
        budget. Idle models go, least recently used first, until it is not;
        busy ones finish their requests first."""
        async with self._lock:
            going = sum(m.charge.total_here for m in self.models.values() if m.stopping)  # stopping already
            over = self.used - going - self.budget
            idle = sorted((m for m in self.models.values() if m.running and not m.pinned and m.users == 0
                           and self.status(m.name) == "loaded"), key=lambda m: m.last_used)
            victims = []
            for m in idle:
                if over <= 0:
                    break
                victims.append(m)
                over -= m.charge.total_here
            stops = self._make_room(victims, "the pool is over its memory budget (a model measured larger "
                                             "than its files)")
        if stops:
            await asyncio.wait(stops)

    async def _unload_if_idle(self, m: PooledModel) -> None:
        async with self._lock:
            if not (m.users == 0 and m.running
                    and (m.unload_requested or not m.pinned and time.monotonic() >= m.idle_until)):
                return
            stops = self._make_room([m], ASKED if m.unload_requested else "idle past its keep-alive")
        await asyncio.wait(stops)

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(REAP_INTERVAL_S)
            now = time.monotonic()
            for m in list(self.models.values()):
                if (keep := m.idle_once_ready) is not None and self.status(m.name) == "loaded":
                    m.idle_once_ready, m.idle_until = None, now + keep
                if m.running and m.users == 0 and now >= m.idle_until:
                    self._unload_soon(m)  # not awaited: one worker slow to stop holds up no other model's unload
            if self.used > self.budget and not self._unloading:
                self._unload_soon(None)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _stopped(self, stops: list[asyncio.Task], timeout: float | None = None) -> bool:
        """Whether the workers' stops end within `timeout` seconds. Unavailable
        as soon as the server begins to stop: a request waiting for room would
        otherwise wait past the drain, to be cut off with a 500. The stops are
        never cancelled with a request: other requests may count on them."""
        all_stopped = asyncio.ensure_future(asyncio.wait(stops))
        closing = asyncio.ensure_future(self._closed.wait())
        try:
            await asyncio.wait([all_stopped, closing], timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            all_stopped.cancel()
            closing.cancel()
        if self._closed.is_set():
            raise Unavailable("the server is shutting down", "shutting_down")
        return all(stop.done() for stop in stops)


def _reservation(needed: int, rows: list[int]) -> str:
    """A refused reservation, as its message names it: its size, and what it is made of (a
    generation's sequences in the batch, or an embedding's forward pass)."""
    made_of = ("its prompt plus max_tokens, every sequence of the model's batch as long as its longest" if rows
               else "its largest input's KV state in a forward pass")
    return f"the request's KV reservation ({format_size(needed)}: {made_of})"


async def _set_within(event: asyncio.Event, timeout: float) -> bool:
    """Whether the event is set within `timeout` seconds."""
    try:
        await asyncio.wait_for(event.wait(), timeout)
    except TimeoutError:
        return False
    return True
