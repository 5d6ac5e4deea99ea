"""Embeddings on the worker's main thread: a text model's final hidden states,
pooled and normalized as the model's sentence-transformers files say.

mlx-lm's own model classes run it (`model.model` is the transformer without
its head), rather than mlx-embeddings: the embedding models people serve next
to chat models on a Mac are mostly decoder models (Qwen3-Embedding), which
mlx-lm already loads, quantized or not, and it adds no dependency with its own
pins on MLX. Encoder-only models (BERT, nomic) are not served, and a decoder
trained to attend both ways (gte-Qwen2, whose own code turns the causal mask
off) runs here causally, as mlx-lm's model does: other vectors than its own.

Causal attention also lets a long input be read in parts, each continuing the
KV state of the parts before it, as a prompt is prefilled in chunks: the
worker embeds an input of a whole context a part per turn, between decode
steps, instead of in one forward pass that every stream waits for.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import mlx.core as mx
import mlx.nn as nn
import msgspec
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

log = logging.getLogger("mlxd.worker.embed")

POOLING_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "first"}


class UnsupportedPooling(ValueError):
    """The model's sentence-transformers files ask for what mlxd does not do
    (another pooling, a Dense layer after it): its vectors would be others."""


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
    if dense := [m.get("path", "") for m in modules if m.get("type", "").endswith("Dense")]:
        raise UnsupportedPooling(f"its sentence-transformers files project the pooled vector ({dense[0]}), "
                                 "which mlxd does not")
    mode = "last"
    for m in modules:
        config = path / m.get("path", "") / "config.json"
        if m.get("type", "").endswith("Pooling") and config.is_file():
            settings = json.loads(config.read_text())
            asked = [key for key, value in settings.items() if key.startswith("pooling_mode_") and value is True]
            if len(asked) > 1 or any(key not in POOLING_MODES for key in asked):  # several: concatenated
                raise UnsupportedPooling(f"its sentence-transformers pooling ({', '.join(asked)}) is not one mlxd "
                                         "does (one of last token, mean, first token)")
            mode = next((name for key, name in POOLING_MODES.items() if settings.get(key)), mode)
    return Pooling(mode, normalize)


class EmbedPiece(msgspec.Struct, kw_only=True):
    """A turn's embedding work, sized by rank 0 and run by every rank: whole
    inputs, or one part of an input too long for the turn."""

    request_id: str
    inputs: list[list[int]]
    continues: bool = False  # its one input goes on from the part the turn before read
    ends: bool = True  # its last input ends here; else more of it comes next turn


class _Open(NamedTuple):
    """An input read in part: its KV state and its pooled hidden states so far."""

    cache: list
    pooled: mx.array  # the sum (mean pooling), the first token's or the last token's hidden state
    tokens: int


class Embedder:
    def __init__(self, model: nn.Module, pooling: Pooling) -> None:
        self.model = model
        self.transformer = model.model  # mlx-lm's: hidden states after the final norm
        self.pooling = pooling
        self._open: _Open | None = None

    def read(self, token_ids: list[int], continues: bool = False, ends: bool = True) -> np.ndarray | None:
        """One input, run on its own (no padding: the same numbers as embedding
        it alone), or a part of one: `continues` goes on from the part read
        last, and unless `ends` more of the input follows. Its float32 vector
        once it ends, else None."""
        opened, self._open = (self._open if continues else None), None
        assert opened is not None or not continues, "a part continues an input no earlier part opened"
        cache = opened.cache if opened is not None else None if ends else make_prompt_cache(self.model)
        mode = self.pooling.mode
        if mode == "first" and opened is not None:
            # The model is causal: what follows the first token cannot change its hidden state.
            pooled = opened.pooled
        else:
            hidden = self.transformer(mx.array([token_ids]), cache=cache)[0]
            if mode == "mean":
                pooled = hidden.astype(mx.float32).sum(axis=0)
                if opened is not None:
                    pooled = pooled + opened.pooled
            else:
                pooled = hidden[0 if mode == "first" else -1].astype(mx.float32)
        tokens = len(token_ids) + (opened.tokens if opened is not None else 0)
        if not ends:
            assert cache is not None
            mx.eval(pooled, [c.state for c in cache])  # this turn's work, not the next part's
            self._open = _Open(cache, pooled, tokens)
            return None
        vector = pooled / tokens if mode == "mean" else pooled
        if self.pooling.normalize:
            vector = vector / mx.maximum(mx.linalg.norm(vector), 1e-12)
        mx.eval(vector)
        return np.array(vector)

    def close(self) -> None:
        """Let go of an input read in part whose request went (aborted, failed)."""
        self._open = None


def embedder_for(model: nn.Module, path: Path) -> Embedder | None:
    """An Embedder for an mlx-lm text model; None for a model without one (a
    vision model's) or whose files ask for pooling mlxd does not do."""
    if not isinstance(getattr(model, "model", None), nn.Module):
        return None
    try:
        return Embedder(model, pooling_of(path))
    except UnsupportedPooling as e:
        log.warning("this model will not embed: %s", e)
        return None
