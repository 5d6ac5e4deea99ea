"""Vision-language models (mlx-vlm) in the continuous batch. Main thread only.

A request with images is prefilled here, in pieces the engine interleaves
with decode steps: first the vision tower encodes its images, a few blocks
per piece (worker.tower), or the feature cache has them; their features
replace the image placeholder tokens' embeddings; then the language model reads the prompt into a fresh (or
prefix-cached) KV cache a chunk at a time. All but the prompt's last token,
that is: the request then joins mlx-lm's BatchGenerator with that cache and
its last token, like any text request that hit the prefix cache, and decodes
beside text requests with its own sampler and stop conditions. Text-only
requests never touch the vision tower: the batch runs the language model alone.

Families with multimodal rotary positions (mRoPE: Qwen2-VL, Qwen2.5-VL,
Qwen3-VL) give an image's tokens positions on a grid, so a prompt with images
runs its positions behind its length by a delta of its own. mlx-vlm keeps that
delta on the model object, which every request in a batch shares; here each
request's cache carries it (RopeKVCache) and the batch applies it row by row.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import OrderedDict, deque
from collections.abc import Generator, Sequence
from pathlib import Path
from time import perf_counter
from typing import NamedTuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache

from worker.tower import evaluate_in_pieces, recording, tower_blocks

# The processor's files travel to the gateway, which runs the processor.
PROCESSOR_FILE_NAMES = {"preprocessor_config.json", "processor_config.json"}


# The vision families mlxd serves (mlx-vlm's model_type), each with a tiny
# model in the tests whose answers through HTTP equal mlx-vlm's. Others are
# refused at load: a family's position scheme or processor untested here
# could answer wrongly rather than fail.
VISION_FAMILIES = {"llava", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "idefics3", "smolvlm", "gemma3", "mistral3"}
MROPE_FAMILIES = {"qwen2_vl", "qwen2_5_vl", "qwen3_vl"}
# The fewest prompt tokens a chunk holds however small its time budget.
MIN_CHUNK = 32
# How many of the latest prompt chunks (their sizes and times) size the next.
TIMED_CHUNKS = 16


class UnsupportedVisionModel(ValueError):
    pass


def load_vision_model(path: Path) -> tuple[nn.Module, int]:
    """The mlx-vlm model at `path` and its image placeholder token id."""
    try:
        from mlx_vlm.utils import get_model_type, load_model
    except ImportError:
        raise UnsupportedVisionModel(f"{path} is a vision model, which needs mlx-vlm (`make install` installs it)") from None
    config = json.loads((path / "config.json").read_text())
    if "model_file" in config:  # mlx-vlm would run that file's code, with no trust asked (mlx-lm asks)
        raise UnsupportedVisionModel(f"{path / 'config.json'} names a model_file of Python code to run; "
                                     "mlxd does not run a model directory's own code")
    model_type = get_model_type(config)  # as mlx-vlm reads it: its architectures may name another family
    if model_type not in VISION_FAMILIES:
        raise UnsupportedVisionModel(
            f"{path} is a {model_type!r} vision model; mlxd serves the vision families "
            f"{', '.join(sorted(VISION_FAMILIES))} (the README's Images section says why others are refused)"
        )
    model = load_model(path)
    image_token_id = getattr(model.config, "image_token_index", None)
    if image_token_id is None:
        image_token_id = getattr(model.config, "image_token_id", None)
    if image_token_id is None:
        raise UnsupportedVisionModel(f"{path / 'config.json'} names no image token (image_token_index)")
    return model, image_token_id


class RopeKVCache(KVCache):
    """A request's KV cache on an mRoPE model, with `rope_delta`: how far its
    rotary positions run from its length. Merged into a batch, the delta goes
    into BatchKVCache.offset, which mlx-lm reads for rotary positions only
    (masks follow the cache's own index), so each row keeps its own through
    the batch's filter and extend."""

    def __init__(self, rope_delta: int = 0) -> None:
        super().__init__()
        self.rope_delta = rope_delta

    @classmethod
    def of(cls, cache: KVCache, rope_delta: int = 0) -> RopeKVCache:
        own = cls(rope_delta)
        own.keys, own.values, own.offset = cache.keys, cache.values, cache.offset
        return own

    @classmethod
    def merge(cls, caches: list) -> BatchKVCache:
        batch = BatchKVCache.merge(caches)
        batch.offset = batch.offset + mx.array([getattr(c, "rope_delta", 0) for c in caches])
        return batch


def text_positions(offset: int | mx.array, batch: int, length: int) -> mx.array:
    """mRoPE positions of text tokens, (3, batch, length): the same position on
    every axis, counting from the cache's offset (an int, or one per row)."""
    start = offset.reshape(-1, 1) if isinstance(offset, mx.array) else mx.array([[offset]])
    return mx.broadcast_to(start + mx.arange(length), (3, batch, length))


class LanguageModel(nn.Module):
    """A VLM's language model as mlx-lm's BatchGenerator expects a model:
    token ids (or embeddings) and a cache in, logits out."""

    def __init__(self, vlm: nn.Module, mrope: bool) -> None:
        super().__init__()
        self.lm = vlm.language_model
        self.mrope = mrope
        scaling = getattr(self.lm.config, "rope_parameters", None) or {}
        if vlm.config.model_type == "mistral3" and "llama_4_scaling_beta" in scaling:
            for layer in self.layers:
                layer.self_attn = RowScaledAttention(layer.self_attn, scaling["llama_4_scaling_beta"],
                                                     scaling["original_max_position_embeddings"])

    @property
    def layers(self):
        return getattr(self.lm, "model", self.lm).layers

    def make_cache(self) -> list:
        cache = make_prompt_cache(self.lm)
        return [RopeKVCache.of(c) for c in cache] if self.mrope else cache

    def __call__(self, inputs: mx.array, cache=None, **kwargs) -> mx.array:
        if self.mrope and "position_ids" not in kwargs:
            # Given, so that the model never falls back on its shared state.
            kwargs["position_ids"] = text_positions(cache[0].offset, *inputs.shape)
        out = self.lm(inputs, cache=cache, **kwargs)
        return getattr(out, "logits", out)


class RowScaledAttention(nn.Module):
    """An attention layer of Mistral 3's Ministral 3 or Mistral 4 text model,
    which scales its queries by 1 + beta * log(1 + floor(position / original
    context)) (Llama 4's scaling). mlx-vlm works the position out once a pass,
    from the batch's first row, and hands every layer that scale: in mlx-lm's
    batch another request's position scaled each row. Here each row's own,
    from its cache (positions before a row's start, its left padding, as 0)."""

    def __init__(self, attention: nn.Module, beta: float, original_context: int) -> None:
        super().__init__()
        self.attention = attention
        self.beta = beta
        self.original_context = original_context

    def __call__(self, x: mx.array, attn_scale: mx.array, mask=None, cache=None) -> mx.array:
        offset = cache.offset if cache is not None else 0
        starts = mx.array(offset).reshape(-1, 1)  # one row per request (one for a cache of one)
        positions = mx.maximum(starts + mx.arange(x.shape[1]), 0)
        scale = 1 + self.beta * mx.log1p(mx.floor(positions / self.original_context))
        return self.attention(x, scale[:, None, :, None].astype(x.dtype), mask, cache)


class FeatureCache:
    """What the vision tower made of a request's images (their embeddings at
    the prompt's image positions, and any features of theirs that enter the
    first layers), by the images' key, LRU within a byte
    budget: images seen again skip the tower even where the prefix cache
    cannot help (other text before them, or their KV state evicted). The key
    hashes the processor's output, so its settings count too."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget = budget_bytes
        self.nbytes = 0
        self.hits = 0
        self._entries: OrderedDict[int, tuple[list[mx.array], int]] = OrderedDict()

    def get(self, key: int) -> list[mx.array] | None:
        """The arrays kept for these images: their embedding rows, then any
        per-layer features (deepstack)."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return entry[0]

    def put(self, key: int, arrays: list[mx.array]) -> None:
        size = sum(a.nbytes for a in arrays)
        if size > self.budget or key in self._entries:
            return
        self._entries[key] = (arrays, size)
        self.nbytes += size
        while self.nbytes > self.budget:
            self.nbytes -= self._entries.popitem(last=False)[1][1]


class Embedded(NamedTuple):
    """A prompt's input embeddings, with what the vision model worked out beside
    them; lazy: built, not computed."""

    embeddings: mx.array | None
    # Features that also enter the first layers (Qwen3-VL's "deepstack"): the
    # prompt's image positions, and each layer's features of its image tokens.
    deepstack: tuple[np.ndarray, list[mx.array]] | None
    rope: tuple[mx.array, mx.array] | None  # mRoPE positions and delta, where the model computed them
    tower: list[list[mx.array]]  # the tower's blocks' outputs, in order; empty when the feature cache had the images
    features: list[mx.array]  # what the feature cache is to keep of them once computed


def deepstack_chunk(visual: np.ndarray, layers: list[mx.array], start: int, end: int) -> dict:
    """The deepstack arguments of prompt[start:end]: its image positions, and
    each layer's features of the image tokens among them."""
    first, count = int(visual[:start].sum()), int(visual[start:end].sum())
    if not count:
        return {}
    return {"visual_pos_masks": mx.array(visual[None, start:end]),
            "deepstack_visual_embeds": [features[first:first + count] for features in layers]}


class VisionPrefill:
    def __init__(self, vlm: nn.Module, image_token_id: int, step_size: int, features: FeatureCache | None) -> None:
        self.vlm = vlm
        self.mrope = vlm.config.model_type in MROPE_FAMILIES
        self.language_model = LanguageModel(vlm, self.mrope)
        self.blocks = tower_blocks(vlm)
        self.image_token_id = image_token_id
        self.step_size = step_size
        self.features = features
        self._chunks: deque[tuple[int, float]] = deque(maxlen=TIMED_CHUNKS)  # (tokens, seconds), any request's

    def cache_key(self, prompt: list[int], media_end: int, images: int) -> list[int]:
        """The prefix-cache key of a prompt whose images' key is `images`."""
        return [images if t == self.image_token_id and i < media_end else t for i, t in enumerate(prompt)]

    def batch_cache(self, cache: list | None) -> list | None:
        """A text request's cache (from the prefix cache) as the batch takes it."""
        if cache is None or not self.mrope:
            return cache
        return [RopeKVCache.of(c) for c in cache]

    def prefill(self, prompt: list[int], media_end: int, images: int, tensors: dict[str, np.ndarray],
                cache: list | None, reused: int) -> Generator[None, float, list]:
        """The KV cache after prompt[:-1], continuing `cache` (which holds
        prompt[:reused]) or a fresh one, in bounded pieces so that the engine
        can decode the running requests between them. The first `next` builds
        the work (where inputs this model cannot take show) and runs none of
        it; then each `send(budget)` runs one piece of about `budget` seconds:
        vision tower blocks, then the tower's end, then prompt chunks, each
        sized at the pace of the one before. The cache is the generator's return value. Image
        positions lie before `media_end`; what follows is text the request
        generated (resumed); `images` is the key of the images `tensors` hold."""
        ids = mx.array([prompt])
        media = ids[:, :media_end]
        if cache is None:
            cache, reused = self.language_model.make_cache(), 0
        arrays = {name: mx.array(a) for name, a in tensors.items()}
        pixel_values = arrays.pop("pixel_values", None)
        # Nothing when every image position is in the reused cache: text alone.
        embedded = self._embeddings(media, np.array(prompt[:media_end]) == self.image_token_id, images,
                                    pixel_values, arrays) \
            if self.image_token_id in prompt[reused:media_end] else Embedded(None, None, None, [], [])
        embeddings, deepstack = embedded.embeddings, embedded.deepstack
        positions, rope_delta = None, 0
        if self.mrope:
            positions, deltas = embedded.rope or self.vlm.language_model.get_rope_index(
                media, arrays.get("image_grid_thw"), arrays.get("video_grid_thw"))
            rope_delta = int(np.asarray(deltas).reshape(-1)[0])
            generated = text_positions(media_end + rope_delta, 1, len(prompt) - media_end)
            positions = mx.concatenate([positions, generated.astype(positions.dtype)], axis=-1)
        budget = yield
        ran = bool(embedded.tower)
        if ran:
            # The last block's output may go unused (LLaVA takes the one before
            # it): whatever of it is needed runs with the tower's end.
            yield from evaluate_in_pieces(embedded.tower[:-1], budget)
            yield
            mx.eval(embeddings, embedded.features)
            if self.features is not None:
                self.features.put(images, embedded.features)
        last = len(prompt) - 1
        for start, end in ((reused, min(media_end, last)), (max(reused, media_end), last)):
            while start < end:
                if ran:
                    budget = yield
                ran = True
                stop = start + chunk_size(budget, self._chunks, self.step_size, end - start)
                began = perf_counter()
                chunk = {} if embeddings is None or start >= media_end else {"inputs_embeds": embeddings[:, start:stop]}
                if positions is not None:
                    chunk["position_ids"] = positions[..., start:stop]
                if deepstack is not None and start < media_end:
                    chunk |= deepstack_chunk(*deepstack, start, stop)
                self.language_model(ids[:, start:stop], cache=cache, **chunk)
                mx.eval([c.state for c in cache])
                self._chunks.append((stop - start, perf_counter() - began))
                start = stop
        return [RopeKVCache.of(c, rope_delta) for c in cache] if self.mrope else cache

    def _embeddings(self, media: mx.array, visual: np.ndarray, images: int, pixel_values: mx.array | None,
                    arrays: dict[str, mx.array]) -> Embedded:
        """The prompt's input embeddings: the vision tower's features at its
        image positions (`visual`; from the feature cache when these images
        were seen), the family's own text embeddings elsewhere."""
        positions = mx.array(np.flatnonzero(visual))
        cached = self.features.get(images) if self.features is not None else None
        if cached is not None:
            rows, *layers = cached
            embeddings = self.vlm.get_input_embeddings(media, None, **arrays).inputs_embeds
            embeddings[0, positions] = rows
            return Embedded(embeddings, (visual, layers) if layers else None, None, [], [])
        with recording(self.blocks) as tower:
            # The mask says every position is the prompt's (Gemma 3 needs one).
            features = self.vlm.get_input_embeddings(media, pixel_values, mask=mx.ones_like(media), **arrays)
        embeddings = features.inputs_embeds
        layers = list(getattr(features, "deepstack_visual_embeds", None) or [])
        # mRoPE positions, already worked out
        rope = (features.position_ids, features.rope_deltas) if getattr(features, "rope_deltas", None) is not None \
            else None
        kept = [embeddings[0, positions], *layers] if self.features is not None else []
        return Embedded(embeddings, (visual, layers) if layers else None, rope, tower, kept)


def chunk_size(budget: float, timed: Sequence[tuple[int, float]], step_size: int, left: int) -> int:
    """Tokens in the next prompt chunk of `left`: as many as `budget` seconds
    take at what a token adds to a chunk (`timed`: the latest chunks' sizes
    and seconds; MIN_CHUNK until one is timed), at most twice the largest of
    those (a size not tried yet is tried step by step), step_size at most,
    and never fewer than MIN_CHUNK, which keeps chunks efficient: a tail of
    fewer than that goes with the chunk before it (within step_size) rather
    than cost a step of its own, where a forward pass of a few tokens costs
    about as much as one of MIN_CHUNK."""
    size = step_size
    if budget != math.inf:
        seconds = token_seconds(timed)
        wanted = MIN_CHUNK if seconds is None else int(min(budget / seconds, size))
        largest = max((n for n, _ in timed), default=MIN_CHUNK)
        size = min(size, max(MIN_CHUNK, min(wanted, 2 * largest)))
    return left if left - size < MIN_CHUNK and left <= step_size else min(size, left)


def token_seconds(timed: Sequence[tuple[int, float]]) -> float | None:
    """What one more token adds to a chunk's time: the slope of the chunks'
    times over their sizes. A forward pass costs a part that no chunk size
    changes (on a GPU, reading the weights, about a decode step); dividing a
    chunk's whole time by its tokens, right where compute dominates (a CPU),
    would cut a GPU's prefill into many small chunks that each cost a decode
    step."""
    cost = fitted_cost(timed)
    return None if cost is None else cost[1]


def fitted_cost(timed: Sequence[tuple[int, float]]) -> tuple[float, float] | None:
    """Work timed as (tokens, seconds), fitted as (seconds whatever the tokens,
    seconds a token): a line through the latest times, or with one size timed
    its time a token alone; None while nothing is timed."""
    if not timed:
        return None
    sizes, times = zip(*timed)
    if len(set(sizes)) < 2:
        return 0.0, times[-1] / sizes[-1]
    slope, intercept = statistics.linear_regression(sizes, times)
    return max(intercept, 0.0), max(slope, 1e-9)
