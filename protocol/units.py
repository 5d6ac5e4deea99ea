"""Durations and memory sizes as operators and clients write them."""

from __future__ import annotations

import math
import re

_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)")
_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?", re.IGNORECASE)


def parse_duration(value: str | float) -> float:
    """Seconds: a number of seconds, or Go-style text ("5m", "1h30m", "250ms");
    negative means forever (math.inf), as in Ollama's keep_alive.

    Raises ValueError for anything else."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a duration")
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        text = value.strip()
        try:
            seconds = float(text)
        except ValueError:
            sign = -1.0 if text.startswith("-") else 1.0
            body = text.lstrip("-")
            parts = _DURATION_PART.findall(body)
            if not body or "".join(n + u for n, u in parts) != body:
                raise ValueError(f"{value!r} is not a duration (e.g. 30s, 5m, 1h, 0, -1)") from None
            seconds = sign * sum(float(n) * _SECONDS[u] for n, u in parts)
    if math.isnan(seconds):
        raise ValueError(f"{value!r} is not a duration")
    return math.inf if seconds < 0 else seconds


def parse_size(value: str | int) -> int:
    """Bytes: a number of bytes, or with a binary unit ("48G", "512MiB", "1.5GB": K, M, G, T are 1024-based).

    Raises ValueError for anything else."""
    if isinstance(value, int):
        return value
    match = _SIZE.fullmatch(value.strip())
    if match is None:
        raise ValueError(f"{value!r} is not a size (e.g. 48G, 512M, or a number of bytes)")
    number, unit = match.groups()
    return int(float(number) * 1024 ** "_kmgt".index(unit.lower() or "_"))


def format_size(size: int) -> str:
    """A byte count as people read it ("1.5 GiB")."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024  # type: ignore[assignment]
    return f"{size:.1f} TiB"
