"""The pool's stops and loads around workers that are slow to go: a draining
server loads nothing (a request that got past the door before the drain
began is refused, and no worker starts beside the ones finishing their
streams); a stop that a request asked for goes on when that request is
cancelled, its model's memory charged until the worker has exited; requests
that make room at once unload one model, not one each.

Each model's worker here is a stand-in process that ignores SIGTERM, as a
worker stuck in a step does, set up as its supervisor would have started it."""

import asyncio
import signal
import time

import pytest

from gateway.ledger import batch_kv
from gateway.pool import Lease, ModelPool, Unavailable
from gateway.worker_link import WorkerLink
from protocol import KVFootprint
from protocol.worker_settings import WorkerSettings

WEIGHTS = 400  # bytes charged per model; the budget holds two
DEAF = ["sh", "-c", "trap '' TERM; echo deaf; exec sleep 60"]  # SIGTERM stays ignored across the exec


def pool_of(tmp_path, names: list[str], max_loaded: int = 3, stop_timeout_s: float = 0.5,
            pinned: tuple[str, ...] = ()) -> ModelPool:
    link = WorkerLink(f"ipc://{tmp_path}/gw.sock", worker_timeout_s=30, hung_worker_s=30, worker_wait_s=5)
    settings = [WorkerSettings(model=f"{name}={tmp_path}/{name}", prefix_cache_bytes=0) for name in names]
    pool = ModelPool(link, settings, budget=2 * WEIGHTS + 100, max_loaded=max_loaded, keep_alive_s=60,
                     stop_timeout_s=stop_timeout_s, pinned=pinned)
    for m in pool.models.values():
        m.charge.weights = WEIGHTS
    return pool


async def run_deaf_worker(pool: ModelPool, name: str, deaf: bool = True) -> asyncio.subprocess.Process:
    """deaf=False: one that exits on SIGTERM, as an idle worker does."""
    supervisor = pool.models[name].supervisor
    command = DEAF if deaf else ["sh", "-c", "echo ready; exec sleep 60"]
    process = await asyncio.create_subprocess_exec(*command, process_group=0, stdout=asyncio.subprocess.PIPE)
    assert process.stdout is not None
    await process.stdout.readline()  # deaf from here on: a SIGTERM sent sooner would end it
    supervisor.process = process
    supervisor._task = asyncio.create_task(process.wait())
    return process


def test_a_draining_pool_starts_no_worker(tmp_path):
    async def run() -> None:
        pool = pool_of(tmp_path, ["alpha"])
        alpha = pool.models["alpha"]
        try:
            pool.stop_restarting()
            with pytest.raises(Unavailable, match="shutting down"):
                await pool.lease("alpha", None, wait_s=1)
            assert alpha.supervisor.process is None and alpha.users == 0
        finally:
            await pool.stop()
            await pool.link.close()

    asyncio.run(run())


def test_a_stop_goes_on_when_the_request_that_asked_for_it_is_cancelled(tmp_path):
    async def run() -> None:
        pool = pool_of(tmp_path, ["a", "b"])
        a_worker = await run_deaf_worker(pool, "a")
        await run_deaf_worker(pool, "b")
        a, b = pool.models["a"], pool.models["b"]
        b.last_used = time.monotonic()  # a is the one to go
        try:
            lease = Lease(pool, b, None)
            reserving = asyncio.create_task(lease.reserve(KVFootprint(), other=200))  # does not fit beside a: a is unloaded
            await asyncio.sleep(0.1)
            assert a.stopping and not reserving.done()
            stop = a.stop_task
            reserving.cancel()
            await asyncio.gather(reserving, return_exceptions=True)
            assert lease.other == 200 and b.charge.kv_reserved == 200  # given back with the lease
            assert pool.used == 2 * WEIGHTS + 200  # a's memory counts until its worker has exited
            assert await asyncio.wait_for(a_worker.wait(), 5) == -signal.SIGKILL  # killed past stop_timeout_s
            await stop  # the stop's own end: the supervisor has seen the exit
            assert not a.holds_memory and pool.used == WEIGHTS + 200
            lease.release()
            assert b.charge.kv_reserved == 0
        finally:
            await pool.stop()
            await pool.link.close()

    asyncio.run(run())


def test_requests_that_make_room_together_unload_one_model(tmp_path):
    async def run() -> None:
        pool = pool_of(tmp_path, ["a", "b", "c"], max_loaded=2)
        workers = {name: await run_deaf_worker(pool, name) for name in ("a", "b")}
        a, b, c = (pool.models[name] for name in "abc")
        b.last_used = time.monotonic()  # a is the least recently used
        try:
            # Two requests for c at once, and one that reserves KV for b: a's going makes room for each.
            loads = [asyncio.create_task(pool._load(c, time.monotonic() + 0.2)) for _ in range(2)]
            lease = Lease(pool, b, None)
            reserving = asyncio.create_task(lease.reserve(KVFootprint(), other=50))
            await asyncio.sleep(0.1)
            assert a.stopping and not b.stopping and b.running
            await asyncio.wait_for(workers["a"].wait(), 5)
            assert await reserving is None
            for load in loads:  # a took longer to go than they would wait
                with pytest.raises(Unavailable, match="within the wait"):
                    await load
            assert b.running and workers["b"].returncode is None and not c.running
            lease.release()
        finally:
            await pool.stop()
            await pool.link.close()

    asyncio.run(run())


def test_the_kv_charge_is_the_batch_mlx_lm_holds():
    """mlx-lm pads every row of the batch to its longest, in 256-token steps: one long request
    beside seven short ones holds eight long rows (the sum of their lengths was charged)."""
    footprint = KVFootprint(per_token=4096)
    assert batch_kv(footprint, []) == 0
    assert batch_kv(footprint, [2016]) == 2048 * 4096
    assert batch_kv(footprint, [2016] + [24] * 7) == 8 * 2048 * 4096
    assert batch_kv(KVFootprint(per_token=10, windowed=((3, 100),), fixed=7), [300, 10]) == 2 * (512 * 10 + 3 * 100 + 7)


def test_a_request_that_ends_while_its_reservation_waits_for_the_lock_is_never_charged(tmp_path):
    """A cancel or a drain releases the lease at once now; a reservation still waiting for the pool's
    lock (another model loading holds it) was charged after that release, for good."""
    async def run() -> None:
        pool = pool_of(tmp_path, ["a"])
        await run_deaf_worker(pool, "a")
        a = pool.models["a"]
        a.users += 1  # the lease's hold, as ModelPool.lease takes it
        lease = Lease(pool, a, None)
        try:
            async with pool._lock:
                reserving = asyncio.create_task(lease.reserve(KVFootprint(per_token=1), [100]))
                await asyncio.sleep(0.05)
                lease.release()
            with pytest.raises(Unavailable, match="ended"):
                await reserving
            assert a.charge.rows == [] and a.charge.kv_reserved == 0
        finally:
            await pool.stop()
            await pool.link.close()

    asyncio.run(run())


def test_a_model_that_fits_once_a_pinned_models_requests_end_waits_for_room(tmp_path):
    """The running requests' KV state of a pinned model (never unloaded to make room) was counted as if it
    stayed: a model that fits once they end was refused at once ("cannot load"), not given the wait."""
    async def run() -> None:
        pool = pool_of(tmp_path, ["p", "b"])
        await run_deaf_worker(pool, "p")
        p, b = pool.models["p"], pool.models["b"]
        p.pinned = True
        p.users += 1  # the lease's hold, as ModelPool.lease takes it
        lease = Lease(pool, p, None)
        try:
            await lease.reserve(KVFootprint(), other=300)  # weights 400 + 300 of KV: b's 400 is over the 900
            began = time.monotonic()
            with pytest.raises(Unavailable, match="within the wait"):
                await pool._load(b, time.monotonic() + 0.3)
            assert time.monotonic() - began >= 0.3 and not b.running
        finally:
            lease.release()
            await pool.stop()
            await pool.link.close()

    asyncio.run(run())


def test_a_pin_after_an_unload_asked_while_requests_ran_keeps_the_model(tmp_path):
    """Both answered as done (202 unloading, then 200 pinned), and the pending
    unload won: the pinned model went once its requests ended. An admin load
    calls it off too."""
    async def run() -> None:
        pool = pool_of(tmp_path, ["a"])
        worker = await run_deaf_worker(pool, "a")
        a = pool.models["a"]
        a.users += 1  # the lease's hold, as ModelPool.lease takes it
        lease = Lease(pool, a, None)
        try:
            assert not await pool.unload("a")  # a request runs: it unloads once that ends
            pool.pin("a", True)
            lease.release()
            await asyncio.sleep(0.3)
            assert not a.stopping and worker.returncode is None
        finally:
            await pool.stop()
            await pool.link.close()

    asyncio.run(run())


def test_pins_the_budget_cannot_hold_together_are_refused(tmp_path):
    """Pinned models are never unloaded for room: pinned past the budget, a
    model that fits alone was refused ("cannot load") until someone unpinned."""
    pool = pool_of(tmp_path, ["a", "b", "c"])  # the budget holds two
    pool.pin("a", True)
    pool.pin("b", True)
    with pytest.raises(ValueError, match="more than the memory budget"):
        pool.pin("c", True)
    assert not pool.models["c"].pinned


def test_a_model_unpinned_while_it_loads_keeps_loading(tmp_path):
    """Its keep-alive counts from when it is ready, as a request's does: counted
    from the unpin, the reaper stopped it mid-load."""
    async def run() -> None:
        pool = pool_of(tmp_path, ["a"])
        pool.keep_alive_s = 0.1
        worker = await run_deaf_worker(pool, "a")  # started, not ready (no worker said Hello)
        a = pool.models["a"]
        try:
            await pool.start()  # the reaper (nothing pinned yet: nothing started)
            a.pinned = True
            pool.pin("a", False)
            await asyncio.sleep(1.0)
            assert not a.stopping and worker.returncode is None
        finally:
            await pool.stop()
            await pool.link.close()

    asyncio.run(run())


def test_one_worker_slow_to_stop_holds_up_no_other_models_keep_alive(tmp_path):
    """The reaper waited for each unload in turn: b, idle past its keep-alive, stayed until a's deaf worker
    was killed (with --drain-s 10, 15 s)."""
    async def run() -> None:
        pool = pool_of(tmp_path, ["a", "b"], stop_timeout_s=30)
        a_worker = await run_deaf_worker(pool, "a")
        b_worker = await run_deaf_worker(pool, "b", deaf=False)
        a, b = pool.models["a"], pool.models["b"]
        a.idle_until = time.monotonic()
        b.idle_until = time.monotonic() + 0.3  # the later: a's stop has begun by then
        try:
            await pool.start()
            assert await asyncio.wait_for(b_worker.wait(), 3) == -signal.SIGTERM
            assert a.stopping and a_worker.returncode is None
        finally:
            a_worker.kill()
            await pool.stop()
            await pool.link.close()

    asyncio.run(run())


def test_a_model_pinned_twice_is_one_pin(tmp_path):
    pool = pool_of(tmp_path, ["a", "b"], max_loaded=1, pinned=("a", "a"))
    assert pool.models["a"].pinned and not pool.models["b"].pinned


def test_a_request_only_a_pinned_model_keeps_out_is_told_so_and_not_to_retry(tmp_path):
    """It was a 503 saying to retry once running requests end, while nothing ran: a client retries for good."""
    async def run() -> None:
        pool = pool_of(tmp_path, ["p", "b"], pinned=("p",))
        await run_deaf_worker(pool, "p")
        await run_deaf_worker(pool, "b", deaf=False)
        b = pool.models["b"]
        b.users += 1  # the lease's hold, as ModelPool.lease takes it
        lease = Lease(pool, b, None)
        try:
            with pytest.raises(Unavailable, match=r"the pinned models \(p\) hold the rest") as refused:
                await lease.reserve(KVFootprint(), other=300)  # b's 400 + 300 fit the 900 without p's 400
            assert refused.value.never
            pool.models["p"].pinned = False  # unpinned, p is unloaded to make room instead
            await lease.reserve(KVFootprint(), other=300)
            assert not pool.models["p"].holds_memory
        finally:
            lease.release()
            await pool.stop()
            await pool.link.close()

    asyncio.run(run())
