"""When `mlxd serve` starts a worker again, and when it calls it a crash loop."""

from gateway.supervisor import CRASH_LOOP_EXITS, INITIAL_BACKOFF_S, MAX_BACKOFF_S, STABLE_AFTER_S, Restarts


def crash(restarts: Restarts, now: float) -> tuple[float, float]:
    """A worker started at `now` that exits at once: (the wait before the next, when that one starts)."""
    wait = restarts.exited(now, now)
    return wait, now + wait


def test_the_pace_doubles_then_a_crash_loop_holds_the_slowest_until_a_worker_stays_up():
    restarts, now, waits = Restarts(), 0.0, []
    for _ in range(CRASH_LOOP_EXITS - 1):
        wait, now = crash(restarts, now)
        waits.append(wait)
    assert waits == [INITIAL_BACKOFF_S * 2 ** i for i in range(CRASH_LOOP_EXITS - 1)]
    assert not restarts.in_loop(None, now)
    wait, now = crash(restarts, now)
    assert wait == MAX_BACKOFF_S and restarts.in_loop(None, now)
    # At the slowest pace the window soon holds fewer than CRASH_LOOP_EXITS exits: still a loop.
    for _ in range(10):
        wait, now = crash(restarts, now)
        assert wait == MAX_BACKOFF_S and restarts.in_loop(now, now + 1)
    # A worker that has stayed up long enough ends it, before it ever exits...
    assert not restarts.in_loop(now, now + STABLE_AFTER_S)
    # ...and its exit, however late, starts the pace over.
    assert restarts.exited(now, now + STABLE_AFTER_S) == INITIAL_BACKOFF_S
    assert not restarts.in_loop(None, now + STABLE_AFTER_S)


def test_a_restart_on_request_starts_the_pace_over():
    restarts, now = Restarts(), 0.0
    for _ in range(3):
        _, now = crash(restarts, now)
    restarts.asked()
    assert crash(restarts, now)[0] == INITIAL_BACKOFF_S
