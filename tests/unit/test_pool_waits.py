"""Requests waiting for room for their KV state: one that does not fit beside
the running requests waits for them to end (first come, first served among
its model's requests), within its wait; a drain or its own end stops the wait.

The pool's workers are stand-in processes (tests/unit/test_pool_stops.py):
what is under test is the pool's ledger and its waits."""

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import pytest

from gateway.pool import Lease, ModelPool, Unavailable
from protocol import KVFootprint
from tests.unit.test_pool_stops import pool_of, run_deaf_worker

# Each model's weights are 400 bytes of the 900 budget: one model alone leaves 500 for KV state.


@asynccontextmanager
async def running_pool(tmp_path, names: list[str]) -> AsyncIterator[tuple[ModelPool, Callable[[str], Lease]]]:
    """A pool whose models' workers run, and `hold(name)`, which takes a lease on one; the leases
    are given back and the pool stopped when the block ends."""
    pool = pool_of(tmp_path, names)
    for name in names:
        await run_deaf_worker(pool, name, deaf=False)
    leases: list[Lease] = []

    def hold(name: str) -> Lease:
        pool.models[name].users += 1  # the lease's hold, as ModelPool.lease takes it
        leases.append(Lease(pool, pool.models[name], None))
        return leases[-1]

    try:
        yield pool, hold
    finally:
        for lease in leases:
            lease.release()
        await pool.stop()
        await pool.link.close()


def reserving(lease: Lease, other: int, wait_s: float = 5.0) -> asyncio.Task:
    return asyncio.create_task(lease.reserve(KVFootprint(), other=other, wait_s=wait_s))


def test_a_request_that_does_not_fit_waits_for_the_running_ones_first_come_first_served(tmp_path):
    async def run() -> None:
        async with running_pool(tmp_path, ["a"]) as (pool, hold):
            a = pool.models["a"]
            running, large, small = hold("a"), hold("a"), hold("a")
            await running.reserve(KVFootprint(), other=300)
            waiting_large = reserving(large, 300)  # 300 + 300 is over the 500 left
            await asyncio.sleep(0.05)
            waiting_small = reserving(small, 100)  # would fit now, but the large one came first
            await asyncio.sleep(0.1)
            assert not waiting_large.done() and not waiting_small.done()
            assert pool.ledger()["models"]["a"]["waiting_for_memory"] == 2
            running.release()
            await asyncio.wait_for(waiting_large, 1)
            await asyncio.wait_for(waiting_small, 1)  # 300 + 100 fits beside the large one
            assert a.charge.kv_other == 400 and pool.ledger()["models"]["a"]["waiting_for_memory"] == 0

    asyncio.run(run())


def test_a_request_that_does_not_fit_within_its_wait_gets_the_retryable_refusal(tmp_path):
    async def run() -> None:
        async with running_pool(tmp_path, ["a"]) as (pool, hold):
            a = pool.models["a"]
            running, late = hold("a"), hold("a")
            await running.reserve(KVFootprint(), other=300)
            began = time.monotonic()
            with pytest.raises(Unavailable, match="within 0.3s; retry when running requests have finished") as e:
                await late.reserve(KVFootprint(), other=300, wait_s=0.3)
            assert time.monotonic() - began >= 0.3 and not e.value.never
            assert e.value.code == "memory_budget_exceeded" and late.other == 0 and a.charge.kv_other == 300
            # One that could never fit is told so at once, however long it may wait.
            began = time.monotonic()
            with pytest.raises(Unavailable, match="shorten its inputs") as e:  # reserved beside the batch: an embedding
                await late.reserve(KVFootprint(), other=600, wait_s=5)
            assert e.value.never and time.monotonic() - began < 1

    asyncio.run(run())


def test_a_request_that_leaves_the_line_takes_only_its_own_place(tmp_path):
    """Two requests alike (one model, no keep_alive, nothing reserved yet) are still two: the one
    that leaves took the other's place in the line, which then waited behind a request long gone."""
    async def run() -> None:
        async with running_pool(tmp_path, ["a"]) as (pool, hold):
            a = pool.models["a"]
            running, first, second = hold("a"), hold("a"), hold("a")
            await running.reserve(KVFootprint(), other=300)
            waiting_first = reserving(first, 300)
            await asyncio.sleep(0.05)
            waiting_second = reserving(second, 300)
            await asyncio.sleep(0.05)
            waiting_second.cancel()  # its client left
            await asyncio.gather(waiting_second, return_exceptions=True)
            running.release()
            await asyncio.wait_for(waiting_first, 1)
            assert a.charge.kv_other == 300 and pool.ledger()["models"]["a"]["waiting_for_memory"] == 0

    asyncio.run(run())


def test_a_drain_or_the_requests_own_end_stops_its_wait_at_once_and_one_that_fits_goes_on(tmp_path):
    async def run() -> None:
        async with running_pool(tmp_path, ["a"]) as (pool, hold):
            a = pool.models["a"]
            running, cancelled, drained = hold("a"), hold("a"), hold("a")
            await running.reserve(KVFootprint(), other=300)
            waits = reserving(cancelled, 300), reserving(drained, 300)
            await asyncio.sleep(0.1)
            cancelled.release()  # a cancel: Serving's stop gives the lease back
            with pytest.raises(Unavailable, match="ended before its memory was reserved"):
                await asyncio.wait_for(waits[0], 1)
            pool.stop_restarting()
            with pytest.raises(Unavailable, match="shutting down"):
                await asyncio.wait_for(waits[1], 1)
            # One that fits goes on while the server drains: it came in before the drain began.
            late = hold("a")
            await late.reserve(KVFootprint(), other=100, wait_s=5)
            late.release()
            assert a.charge.kv_other == 300

    asyncio.run(run())


def test_a_request_waiting_for_room_an_idle_model_would_give_holds_up_none_of_that_models_requests(tmp_path):
    """b's request needs a unloaded; a's own requests (which keep it busy meanwhile) go on
    past it, else each would wait for the other until their waits ran out."""
    async def run() -> None:
        async with running_pool(tmp_path, ["a", "b"]) as (pool, hold):
            a, b = pool.models["a"], pool.models["b"]
            on_a, on_b = hold("a"), hold("b")
            waiting_b = reserving(on_b, 200)  # the two models' weights leave 100: a must go, and a is busy
            await asyncio.sleep(0.1)
            assert not waiting_b.done()
            await asyncio.wait_for(on_a.reserve(KVFootprint(), other=50, wait_s=5), 1)
            on_a.release()  # a is idle: it is unloaded for b's request
            await asyncio.wait_for(waiting_b, 5)
            assert not a.holds_memory and b.charge.kv_other == 200

    asyncio.run(run())
