"""The worker's heartbeat thread.

It reads plain Python counters and sends them on a ZeroMQ socket of its own;
it never imports or calls MLX (invariant 1). Beating from here rather than
from the main loop keeps the heartbeat regular while the main thread is inside
a long step, so the gateway can tell a busy worker (beats, steps advance) from
a hung one (beats, steps stall) and from a dead or frozen one (no beats).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import zmq

from protocol import Heartbeat, encode


class HeartbeatThread(threading.Thread):
    def __init__(self, socket: zmq.Socket, interval_s: float, snapshot: Callable[[], Heartbeat]) -> None:
        """socket: connected, and used by this thread alone from now on."""
        super().__init__(name="mlxd-heartbeat", daemon=True)
        self._socket = socket
        self._socket.setsockopt(zmq.LINGER, 0)
        self._interval_s = interval_s
        self._snapshot = snapshot
        self._stopped = threading.Event()

    def run(self) -> None:
        try:
            while not self._stopped.wait(self._interval_s):
                try:
                    self._socket.send(encode(self._snapshot()), zmq.NOBLOCK)
                except zmq.Again:
                    pass  # no gateway connected right now; the next beat will try again
        finally:
            self._socket.close()

    def stop(self) -> None:
        self._stopped.set()
        self.join()
