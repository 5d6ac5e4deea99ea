"""Whether a worker is alive and making progress: one state machine over an enum.

  ready         heartbeats arrive and its step counter moves when it has work
  draining      it announced it is stopping (and still beats); new requests wait for the next one
  unresponsive  no heartbeat for --worker-timeout-s (frozen, or gone silently),
                or its tcp connection dropped (until it beats again)
  hung          heartbeats arrive but the step counter has not moved for
                --hung-worker-s while requests are running or waiting to be
                prefilled (a prefill runs a chunk a step: it moves too), and
                the worker has not kept half a core busy meanwhile (on
                average, from its CPU time in the heartbeats): one step
                can take minutes on MLX's CPU backend (a long prompt's chunk).
                Busy with a still counter, it is hung after ten times as long
                (a loop that never ends). A group (mx.distributed) is judged
                by its counter alone: its rank 0 spins while it waits for a
                stuck rank.

An unresponsive or hung worker that recovers is ready again. One that stays
unresponsive or hung for a further --hung-worker-s is given up on.

Pure: the caller passes the time in and acts on the Verdict (logs, readiness,
killing, losing the worker), so every transition is unit-tested without a
socket or a clock.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

# A worker whose CPU time grew by this share of a core, on average since its counter last moved, is
# working, whatever its counter says.
BUSY_CORES = 0.5
# How much longer than --hung-worker-s a busy worker's counter may stand still.
BUSY_STALL_FACTOR = 10.0


class Liveness(enum.Enum):
    READY = "ready"
    DRAINING = "draining"
    UNRESPONSIVE = "unresponsive"
    HUNG = "hung"


UNHEALTHY = (Liveness.UNRESPONSIVE, Liveness.HUNG)


@dataclass(frozen=True, slots=True)
class Verdict:
    """What one assessment found, and what is to be done about it."""

    state: Liveness
    previous: Liveness  # differs from state on a transition
    kill: bool = False  # first found hung, or given up on: stop its process if we can (once)
    give_up: bool = False  # unhealthy too long: the worker is to be treated as lost
    unhealthy_for: float = 0.0

    @property
    def changed(self) -> bool:
        return self.state != self.previous


@dataclass(slots=True)
class Vitals:
    """What the gateway knows of one worker's liveness."""

    worker_timeout_s: float
    hung_worker_s: float
    last_beat: float
    last_progress: float  # when the step counter last moved (or the worker was idle)
    steps: int = 0
    running: int = 0
    waiting: int = 0
    cpu_s: float | None = None  # its CPU time at the last beat (None: not reported)
    draining: bool = False
    disconnected: bool = False
    state: Liveness = Liveness.READY
    _bad_since: float | None = None
    _reported: bool = False
    _cpu_at_progress: float | None = None  # its CPU time when the counter last moved (or first reported since)

    def beat(self, now: float, steps: int, running: int, waiting: int = 0, cpu_s: float | None = None) -> None:
        """A heartbeat with the worker's step counter, its running requests and
        those waiting to be prefilled, and its process's CPU time (None: not to be judged by)."""
        self.last_beat = now
        self.disconnected = False
        moved = steps != self.steps or running + waiting == 0
        if moved:
            self.last_progress = now
        if moved or self._cpu_at_progress is None:
            self._cpu_at_progress = cpu_s
        self.steps, self.running, self.waiting, self.cpu_s = steps, running, waiting, cpu_s

    def excuse(self, before: float, away_s: float) -> None:
        """The gateway itself stood still for about `away_s`, ending after
        `before` (a frozen event loop, a stopped process): what it heard
        before then is taken as heard that much later, since the worker's
        beats meanwhile could not be read."""
        if self.last_beat < before:
            self.last_beat += away_s
        if self.last_progress < before:
            self.last_progress += away_s
        if self._bad_since is not None and self._bad_since < before:
            self._bad_since += away_s

    def busy(self) -> bool:
        """Whether it kept BUSY_CORES busy on average since its counter last moved, as of its
        last beat: an average over the whole stall, which beats bunched up by a late event loop
        or one burst of CPU (a writer thread's) cannot fake."""
        if self.cpu_s is None or self._cpu_at_progress is None:
            return False
        window_s = self.last_beat - self.last_progress
        return window_s > 0 and self.cpu_s - self._cpu_at_progress >= BUSY_CORES * window_s

    def assess(self, now: float) -> Verdict:
        silent = self.disconnected or now - self.last_beat > self.worker_timeout_s
        if self.draining and not silent:
            state = Liveness.DRAINING
        elif silent:  # draining or not: one that died mid-drain (over tcp no exit is seen) is given up on too
            state = Liveness.UNRESPONSIVE
        elif self.running + self.waiting > 0 and now - self.last_progress > self.hung_worker_s and (
                not self.busy() or now - self.last_progress > BUSY_STALL_FACTOR * self.hung_worker_s):
            state = Liveness.HUNG
        else:
            state = Liveness.READY
        previous = self.state
        if state != previous:
            self.state = state
            # Only a ready worker stops the clock: between unhealthy states (hung, then silent, then
            # hung...), or in and out of a drain, it runs on.
            if state == Liveness.READY:
                self._bad_since = None
            elif state in UNHEALTHY and self._bad_since is None:
                self._bad_since = now
            self._reported = False
        unhealthy_for = now - self._bad_since if state in UNHEALTHY and self._bad_since is not None else 0.0
        give_up = unhealthy_for > self.hung_worker_s
        kill = (state == Liveness.HUNG or give_up) and not self._reported
        self._reported = self._reported or kill
        return Verdict(state, previous, kill, give_up, unhealthy_for)
