"""Logs written into a file that log rotation moves away (newsyslog, under
launchd): the process points its stdout and stderr at the path again as soon
as the path holds another file, or none. (launchd opens a job's log once, at
its start; a job writing on to the file newsyslog renamed and compressed
would lose every line until it restarts.)"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

# How often the path is looked at: what a rotation can send into the old file.
CHECK_EVERY_S = 1.0


class LogSettings(msgspec.Struct, kw_only=True):
    """The logging settings the gateway's and the worker's share."""

    log_level: Annotated[Literal["debug", "info", "warning", "error", "critical"],
                         Meta(description="debug, info, warning, error or critical")] = "info"
    log_file: Annotated[
        str | None, Meta(description="a file for the logs (stdout and stderr), opened again when log rotation moves "
                                     "it (launchd's jobs log so)")
    ] = None


def follow_log_file(path: str) -> None:
    """Stdout and stderr into `path` (appended to), from now on and after each rotation;
    SystemExit saying why when it cannot be opened (before anything goes to it)."""
    try:
        _point_at(path)
    except OSError as e:
        raise SystemExit(f"mlxd: --log-file {path}: {e.strerror}") from None
    threading.Thread(target=_follow, args=(path,), name="log-file", daemon=True).start()


def _point_at(path: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)  # with --log-prompts, the prompts
    try:
        if os.fstat(fd).st_uid == os.geteuid():  # a file that was there keeps its mode otherwise: 0644 is usual
            os.fchmod(fd, 0o600)
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(fd, 1)
        os.dup2(fd, 2)
    finally:
        os.close(fd)


def _moved(path: str) -> bool:
    """Whether `path` is no longer the file stderr writes to."""
    try:
        named = os.stat(path)
    except FileNotFoundError:
        return True
    writing = os.fstat(2)
    return (named.st_dev, named.st_ino) != (writing.st_dev, writing.st_ino)


def _follow(path: str) -> None:
    while True:
        time.sleep(CHECK_EVERY_S)
        try:
            if _moved(path):
                _point_at(path)
        except OSError:  # its directory gone for a moment, say: the next look tries again
            pass
