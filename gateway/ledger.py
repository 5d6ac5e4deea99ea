"""The memory ledger's arithmetic: what the budget is, what each model is
charged, and what its weights will cost before a worker has measured them.

A model that runs (loading or loaded) is charged its weights, its prefix
cache's budget, and the KV state its admitted requests may reach: mlx-lm's
batch gives every row the longest row's length (rounded up to its 256-token
step), so that is rows x the longest prompt + max_tokens, at the bytes per
token its worker measured (plus an embeddings request's largest input). The pool
(gateway/pool.py) starts a model, and admits a request, only when the charge
fits in the budget: memory is decided before the work starts, because on a
Mac a Metal allocation that fails ends the process.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from protocol import KVFootprint
from protocol.worker_settings import is_repo_id, pulled_model

# What the default budget leaves to the system and the gateway.
HEADROOM_BYTES = 2 << 30
# Metal's recommended working set is about this share of a Mac's memory (as
# mx.metal.device_info reports it); the gateway does not load MLX to ask.
MACOS_GPU_SHARE = 0.75
LINUX_SHARE = 0.5
WEIGHT_SUFFIXES = (".safetensors", ".npz", ".gguf")


def total_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def default_memory_budget() -> int:
    """On macOS, the GPU's working set less headroom; elsewhere, half the RAM."""
    share = MACOS_GPU_SHARE if sys.platform == "darwin" else LINUX_SHARE
    return max(int(total_memory() * share) - (HEADROOM_BYTES if sys.platform == "darwin" else 0), 1 << 30)


# mlx-lm's KV caches grow by this many tokens at a time.
KV_STEP = 256


def batch_kv(footprint: KVFootprint, rows: list[int]) -> int:
    """The KV state of a batch of sequences that reach `rows` tokens: mlx-lm's
    batch pads every row to the longest, which its cache holds in steps."""
    if not rows:
        return 0
    return len(rows) * footprint.bytes_for(-(-max(rows) // KV_STEP) * KV_STEP)


def weights_on_disk(source: str) -> int:
    """The size of a model's weight files, as the estimate of its weights until
    a worker has loaded them: a directory's or a .gguf file's, or a Hugging Face
    repo's in the local hub cache; 0 when they cannot be found from here."""
    path = local_model(source)
    if path is None:
        return 0
    return path.stat().st_size if path.is_file() else _weight_files_size(path)


def local_model(source: str) -> Path | None:
    """Where a model's files are on this machine: the directory or .gguf file
    named, a model pulled into mlxd's cache by that name, or a Hugging Face
    repo's newest snapshot in the local hub cache."""
    path = Path(source).expanduser() if source else None
    if path is not None and path.exists():
        return path
    if (pulled := pulled_model(source)) is not None:
        return pulled
    if is_repo_id(source):
        snapshots = hub_cache() / f"models--{source.replace('/', '--')}" / "snapshots"
        if snapshots.is_dir():
            return max(snapshots.iterdir(), key=lambda s: s.stat().st_mtime, default=None)
    return None


def hub_cache() -> Path:
    """Where huggingface_hub keeps the repos it downloaded, found as it finds it
    (without importing it, a quarter of a second)."""
    def path(value: str | Path) -> Path:
        return Path(os.path.expandvars(value)).expanduser()

    if cache := os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE"):
        return path(cache)
    home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface"
    return path(home) / "hub"


def _weight_files_size(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.iterdir() if f.suffix in WEIGHT_SUFFIXES and f.is_file())


@dataclass
class Charge:
    """One running model's entry in the ledger, in bytes."""

    weights: int  # measured by its worker once loaded, else weights_on_disk
    prefix_cache: int  # its workers' --prefix-cache-bytes
    # The machines its worker's ranks run on (--distributed-hosts): the figures
    # here are the group's, summed over its ranks, and each machine holds a share.
    hosts: int = 1
    rows: list[int] = field(default_factory=list)  # the most tokens each admitted sequence may reach
    footprint: KVFootprint = KVFootprint()  # its worker's KV bytes, per token and per sequence
    kv_other: int = 0  # reservations beside the decode batch (an embeddings request's largest input)

    @property
    def kv_reserved(self) -> int:
        """The KV state the admitted requests may reach together."""
        return self.kv_other + batch_kv(self.footprint, self.rows)

    @property
    def fixed(self) -> int:
        """What the model costs with no request running."""
        return self.weights + self.prefix_cache

    @property
    def total(self) -> int:
        return self.fixed + self.kv_reserved

    def here(self, nbytes: int) -> int:
        """What this machine holds of `nbytes` of the model's memory: all of
        it, or a group's even share (its ranks split the model). The budget
        is this machine's."""
        return -(-nbytes // self.hosts)

    @property
    def fixed_here(self) -> int:
        return self.here(self.fixed)

    @property
    def total_here(self) -> int:
        return self.here(self.total)

    def as_dict(self) -> dict[str, int]:
        """The group's figures, and `here`: this machine's share of the total, which the budget holds."""
        return {"weights": self.weights, "prefix_cache": self.prefix_cache, "kv_reserved": self.kv_reserved,
                "total": self.total, "here": self.total_here}
