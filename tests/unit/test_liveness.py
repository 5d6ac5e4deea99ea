from gateway.liveness import Liveness, Vitals

TIMEOUT, HUNG = 5.0, 60.0


def vitals(now: float = 0.0) -> Vitals:
    return Vitals(worker_timeout_s=TIMEOUT, hung_worker_s=HUNG, last_beat=now, last_progress=now)


def test_beating_and_stepping_is_ready():
    v = vitals()
    for t in range(1, 100):
        v.beat(float(t), steps=t, running=3)
        verdict = v.assess(float(t))
        assert verdict.state == Liveness.READY and not verdict.changed and not verdict.kill


def test_no_heartbeat_past_the_timeout_is_unresponsive_then_ready_again():
    v = vitals()
    assert v.assess(TIMEOUT + 0.1).state == Liveness.UNRESPONSIVE
    v.beat(TIMEOUT + 1, steps=0, running=0)
    verdict = v.assess(TIMEOUT + 1)
    assert verdict.state == Liveness.READY and verdict.changed and verdict.previous == Liveness.UNRESPONSIVE


def test_an_idle_worker_with_a_still_counter_is_not_hung():
    v = vitals()
    for t in range(1, 200):
        v.beat(float(t), steps=0, running=0)
    assert v.assess(199.0).state == Liveness.READY


def test_a_still_counter_with_requests_running_is_hung_and_killed_once():
    v = vitals()
    v.beat(1.0, steps=5, running=2)
    for t in range(2, 62):
        v.beat(float(t), steps=5, running=2)
        assert v.assess(float(t)).state == Liveness.READY
    v.beat(62.0, steps=5, running=2)
    verdict = v.assess(62.0)
    assert verdict.state == Liveness.HUNG and verdict.changed and verdict.kill and not verdict.give_up
    v.beat(63.0, steps=5, running=2)
    assert not v.assess(63.0).kill  # reported once


def test_a_still_counter_while_the_worker_keeps_a_core_busy_is_a_long_step():
    """A prompt's chunk taking minutes on MLX's CPU backend: the counter stands
    still, the CPU time climbs. Hung only past ten times --hung-worker-s."""
    v = vitals()
    for t in range(1, int(10 * HUNG) + 1):
        v.beat(float(t), steps=5, running=2, cpu_s=0.9 * t)
        assert v.assess(float(t)).state == Liveness.READY
    v.beat(10 * HUNG + 2, steps=5, running=2, cpu_s=0.9 * (10 * HUNG + 2))  # the counter last moved at 1
    assert v.assess(10 * HUNG + 2).state == Liveness.HUNG


def test_a_still_counter_with_a_trickle_of_cpu_is_hung():
    """Stuck (a lock, a GPU that never answers): its threads use next to nothing."""
    v = vitals()
    for t in range(1, 63):
        v.beat(float(t), steps=5, running=2, cpu_s=0.01 * t)
    assert v.assess(62.0).state == Liveness.HUNG


def test_beats_bunched_up_or_a_burst_of_cpu_do_not_make_a_stuck_worker_busy():
    """Two beats handled a microsecond apart after the event loop was late, and
    one thread's 0.3 s of CPU in the stall: next to nothing on average."""
    v = vitals()
    cpu = 0.0
    for t in range(1, 63):
        cpu += 0.0003 + (0.3 if t == 30 else 0.0)
        v.beat(float(t), steps=5, running=2, cpu_s=cpu)
        if t % 20 == 0:
            v.beat(t + 1e-6, steps=5, running=2, cpu_s=cpu)
    assert not v.busy() and v.assess(62.0).state == Liveness.HUNG


def test_a_still_counter_with_requests_waiting_to_prefill_is_hung_too():
    """Stuck in a first prefill chunk (or an image's tower) with nothing decoding yet."""
    v = vitals()
    v.beat(1.0, steps=5, running=0, waiting=1)
    v.beat(62.0, steps=5, running=0, waiting=1)
    assert v.assess(62.0).state == Liveness.HUNG


def test_unhealthy_for_too_long_is_given_up_on():
    v = vitals()
    v.assess(TIMEOUT + 1)
    verdict = v.assess(TIMEOUT + 1 + HUNG + 0.5)
    assert verdict.state == Liveness.UNRESPONSIVE and verdict.give_up and verdict.kill
    assert verdict.unhealthy_for > HUNG


def test_switching_between_hung_and_silent_is_still_given_up_on():
    """A stuck worker whose heartbeats come with gaps past the timeout: hung, unresponsive, hung...
    The clock runs from the first of them; restarted at each switch, it would never give up."""
    v = vitals()
    v.beat(0.0, steps=5, running=2)
    t, verdict = 0.0, None
    while t < 10 * HUNG and not (verdict and verdict.give_up):
        t += 1.0
        if int(t) % 20 < 14:  # beats, then six seconds of silence in every twenty
            v.beat(t, steps=5, running=2)
        verdict = v.assess(t)
    assert verdict is not None and verdict.give_up and t < 2 * HUNG + 2 * TIMEOUT


def test_a_dropped_connection_is_unresponsive_until_the_next_beat():
    v = vitals()
    v.disconnected = True
    assert v.assess(0.1).state == Liveness.UNRESPONSIVE
    v.beat(0.2, steps=0, running=0)
    assert v.assess(0.2).state == Liveness.READY


def test_draining_wins_while_it_beats_and_a_silent_drain_is_given_up_on():
    """A worker on another Mac killed mid-drain: no process exit is seen here, only the silence."""
    v = vitals()
    v.draining = True
    v.beat(1.0, steps=5, running=2)
    v.beat(TIMEOUT + HUNG, steps=5, running=2)  # its streams' steps stalled, but it beats: draining
    assert v.assess(TIMEOUT + HUNG).state == Liveness.DRAINING
    silent_at = 2 * TIMEOUT + HUNG + 1
    assert v.assess(silent_at).state == Liveness.UNRESPONSIVE and not v.assess(silent_at).give_up
    assert v.assess(silent_at + HUNG + 1).give_up


def test_a_drain_broken_by_silences_is_still_given_up_on():
    """Draining, with heartbeats that stop past the timeout now and then: the clock runs from the first
    silence through the drains between them (a drain that beats on for good is the worker's own to end)."""
    v = vitals()
    v.draining = True
    t, verdict = 0.0, None
    while t < 10 * HUNG and not (verdict and verdict.give_up):
        t += 1.0
        if int(t) % 20 < 14:
            v.beat(t, steps=5, running=2)
        verdict = v.assess(t)
        if verdict.state == Liveness.DRAINING:
            assert not verdict.give_up
    assert verdict is not None and verdict.give_up and t < 2 * HUNG + 2 * TIMEOUT


def test_the_gateways_own_stall_is_excused_and_what_came_after_it_is_not():
    """A gateway that stood still from 1 to 20 could not read the beats meanwhile; a beat read after it counts
    as it is, and a worker silent since the stall is unresponsive once the timeout has passed after it."""
    v = vitals()
    v.beat(1.0, steps=5, running=2)
    v.excuse(before=10.0, away_s=19.0)
    assert v.assess(20.0).state == Liveness.READY
    assert v.assess(20.0 + TIMEOUT + 0.1).state == Liveness.UNRESPONSIVE
    fresh = vitals()
    fresh.beat(21.0, steps=6, running=2)  # read before the stall was noticed: not moved
    fresh.excuse(before=10.0, away_s=19.0)
    assert fresh.last_beat == 21.0 and fresh.assess(21.0 + TIMEOUT + 0.1).state == Liveness.UNRESPONSIVE
