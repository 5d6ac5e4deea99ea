"""Where the gateway and worker meet when nobody says otherwise."""

from __future__ import annotations

import os
from pathlib import Path


def runtime_dir() -> Path:
    """A per-user directory for the ipc socket; the gateway creates it 0700."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    return Path(base) / "mlxd" if base else Path.home() / ".mlxd" / "run"


def default_worker_endpoint() -> str:
    return f"ipc://{runtime_dir() / 'worker.sock'}"
