"""What the loaded model costs in memory, for the gateway's ledger, and the
MLX limits that keep this worker inside the share the ledger gives it."""

from __future__ import annotations

import logging

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from protocol import KVFootprint, MemoryStats

log = logging.getLogger("mlxd.worker.footprint")


def _arrays(tree) -> list[mx.array]:
    leaves: dict = {}
    tree_flatten(tree, destination=leaves)
    return [leaf for leaf in leaves.values() if isinstance(leaf, mx.array)]


def weights_bytes(model: nn.Module) -> int:
    """Every parameter array's bytes, as loaded (dequantized ones at their float32 size)."""
    return sum(array.nbytes for array in _arrays(model.parameters()))


def probe_cache(model: nn.Module) -> list:
    """The model's own cache after one token. What it holds is read off it
    (kv_footprint, and the disk tier's block layout): counting the layers
    that exist, rather than reading the config, gets sliding windows,
    shared-KV and recurrent layers right for every architecture mlx-lm builds."""
    cache = make_prompt_cache(model)
    model(mx.array([[0]]), cache=cache)
    return cache


def kv_footprint(cache: list) -> KVFootprint:
    """The model's KV bytes per token, from its probe_cache."""
    per_token, fixed = 0, 0
    windowed: list[tuple[int, int]] = []
    for layer in _leaves(cache):
        arrays = _arrays(layer.state)
        mx.eval(arrays)
        if getattr(layer, "keys", None) is None:  # a recurrent state: the same size at any length
            fixed += sum(a.nbytes for a in arrays)
            continue
        # (batch, heads, allocated tokens, dim) arrays (a quantized cache's scales and biases too).
        token_bytes = sum(a.nbytes // a.shape[-2] for a in _arrays((layer.keys, layer.values)))
        if (window := getattr(layer, "max_size", None)) is not None:
            windowed.append((token_bytes, window))
        else:
            per_token += token_bytes
    return KVFootprint(per_token=per_token, windowed=tuple(windowed), fixed=fixed)


def _leaves(cache) -> list:
    leaves = []
    for layer in cache:
        leaves += _leaves(layer.caches) if hasattr(layer, "caches") else [layer]
    return leaves


def set_limits(memory_limit: int | None, weights: int) -> None:
    """Hold MLX to this worker's share of the budget (MLX frees cached buffers
    and waits on running work before it grows past the limit; the buffers it
    keeps for reuse never exceed what the share leaves beside the weights), and
    on Metal keep the share wired, so the weights are not paged out between requests."""
    if memory_limit is None:
        return
    mx.set_memory_limit(memory_limit)
    mx.set_cache_limit(max(memory_limit - weights, 0))
    if mx.metal.is_available():
        mx.set_wired_limit(min(memory_limit, int(mx.metal.device_info()["max_recommended_working_set_size"])))
    log.info("MLX memory limit: %d MiB", memory_limit >> 20)


def memory_stats() -> MemoryStats:
    return MemoryStats(active=mx.get_active_memory(), peak=mx.get_peak_memory(), cache=mx.get_cache_memory())
