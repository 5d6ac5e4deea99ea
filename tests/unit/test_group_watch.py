"""How the group's launcher (worker/group.py) turns its ranks' exits into
one worker's status, on real processes standing in for the ranks."""

from __future__ import annotations

import subprocess
import time

import worker.group
from worker.group import FOLLOW_S, RankProcess, _watch


def ranks(*scripts: str) -> list[RankProcess]:
    return [RankProcess(rank, "127.0.0.1", subprocess.Popen(["sh", "-c", script]))
            for rank, script in enumerate(scripts)]


def status(group: list[RankProcess]) -> int:
    return _watch(group, None)[0]


def test_a_stop_exits_with_rank_0s_status_even_when_another_rank_left_first():
    # Rank 0 was refused by the gateway (status 2) and told rank 1 to exit, which it did at once.
    assert status(ranks("sleep 0.5; exit 2", "exit 0")) == 2
    assert status(ranks("sleep 0.5; exit 0", "exit 0")) == 0


def test_a_rank_that_dies_takes_the_group_down_at_once():
    group = ranks("sleep 60", "sleep 0.2; kill -9 $$")
    started = time.monotonic()
    exited, first = _watch(group, None)
    assert exited == 128 + 9  # as a shell reports a signal: a crash, to the supervisor
    assert first is group[1]
    assert time.monotonic() - started < FOLLOW_S
    assert all(r.process.poll() is not None for r in group)


def test_a_rank_0_that_does_not_follow_its_own_stop_is_killed(monkeypatch):
    monkeypatch.setattr(worker.group, "FOLLOW_S", 0.5)
    group = ranks("exit 0", "sleep 60")
    assert status(group) == 0  # rank 0's status: it stopped
    group = ranks("sleep 60", "exit 0")
    assert status(group) == 128 + 9  # rank 0 hung after its stop: killed
