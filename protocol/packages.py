"""The installed versions of the packages both halves name: the gateway says
them (`mlxd --version`), the worker files its KV state on disk under them."""

from __future__ import annotations

import importlib.metadata

# Pinned and upgraded as a set (the Makefile): a model's KV state is theirs.
MLX_PACKAGES = ("mlx", "mlx-lm", "mlx-vlm")


def installed_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"
