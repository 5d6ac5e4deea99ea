"""Embeddings on the worker's main thread: a text model's final hidden states,
pooled and normalized as the model's sentence-transformers files say.

mlx-lm's own model classes run it (`model.model` is the transformer without
its head), rather than mlx-embeddings: the embedding models people serve next
to chat models on a Mac are mostly decoder models (Qwen3-Embedding), which
mlx-lm already loads, quantized or not, and it adds no dependency with its own
pins on MLX. Encoder-only models (BERT, nomic) are not served, and a decoder
trained to attend both ways (gte-Qwen2, whose own code turns the causal mask
off) runs here causally, as mlx-lm's model does: other vectors than its own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

POOLING_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "first"}


@dataclass(frozen=True)
class Pooling:
    mode: str = "last"  # "last", "mean" or "first" token's hidden state
    normalize: bool = True


def pooling_of(path: Path) -> Pooling:
    """The model's sentence-transformers pooling (modules.json and its Pooling
    module's config.json); without them, the last token normalized, as
    decoder embedding models pool."""
    modules_file = path / "modules.json"
    if not modules_file.is_file():
        return Pooling()
    modules = json.loads(modules_file.read_text())
    normalize = any(m.get("type", "").endswith("Normalize") for m in modules)
    mode = "last"
    for m in modules:
        config = path / m.get("path", "") / "config.json"
        if m.get("type", "").endswith("Pooling") and config.is_file():
            settings = json.loads(config.read_text())
            mode = next((name for key, name in POOLING_MODES.items() if settings.get(key)), mode)
    return Pooling(mode, normalize)


class Embedder:
    def __init__(self, model: nn.Module, pooling: Pooling) -> None:
        self.transformer = model.model  # mlx-lm's: hidden states after the final norm
        self.pooling = pooling

    def __call__(self, inputs: list[list[int]]) -> np.ndarray:
        """One float32 vector per input, each run on its own (no padding: the
        same numbers as embedding it alone)."""
        vectors = []
        for token_ids in inputs:
            hidden = self.transformer(mx.array([token_ids]))[0]
            if self.pooling.mode == "mean":
                vector = hidden.astype(mx.float32).mean(axis=0)
            else:
                vector = hidden[-1 if self.pooling.mode == "last" else 0].astype(mx.float32)
            if self.pooling.normalize:
                vector = vector / mx.maximum(mx.linalg.norm(vector), 1e-12)
            mx.eval(vector)
            vectors.append(np.array(vector))
        return np.stack(vectors)


def embedder_for(model: nn.Module, path: Path) -> Embedder | None:
    """An Embedder for an mlx-lm text model; None for a model without one (a vision model's)."""
    return Embedder(model, pooling_of(path)) if isinstance(getattr(model, "model", None), nn.Module) else None
