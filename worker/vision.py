"""Vision-language models (mlx-vlm) in the continuous batch. Main thread only.

A request with images is prefilled here: the vision tower encodes its images,
their features replace the image placeholder tokens' embeddings, and the
language model reads the whole prompt into a fresh (or prefix-cached) KV
cache. All but the prompt's last token, that is: the request then joins
mlx-lm's BatchGenerator with that cache and its last token, like any text
request that hit the prefix cache, and decodes beside text requests with its
own sampler and stop conditions. Text-only requests never touch the vision
tower: the batch runs the language model alone.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

# The processor's files travel to the gateway, which runs the processor.
PROCESSOR_FILE_NAMES = {"preprocessor_config.json", "processor_config.json"}


class UnsupportedVisionModel(ValueError):
    pass


def load_vision_model(path: Path) -> tuple[nn.Module, int]:
    """The mlx-vlm model at `path` and its image placeholder token id."""
    try:
        from mlx_vlm.utils import load_model
    except ImportError:
        raise UnsupportedVisionModel(f"{path} is a vision model, which needs mlx-vlm (`make install` installs it)") from None
    model = load_model(path)
    if hasattr(model.language_model, "_rope_deltas"):
        # Qwen2-VL-style models keep the last prompt's multimodal rotary
        # offsets on the model object, which every request in a batch shares.
        raise UnsupportedVisionModel(
            f"{model.config.model_type} models keep per-request position state on the model object; "
            "mlxd's continuous batching cannot serve them"
        )
    config = model.config
    image_token_id = getattr(config, "image_token_index", None)
    if image_token_id is None:
        image_token_id = getattr(config, "image_token_id", None)
    if image_token_id is None:
        raise UnsupportedVisionModel(f"{path / 'config.json'} names no image token (image_token_index)")
    return model, image_token_id


class LanguageModel(nn.Module):
    """A VLM's language model as mlx-lm's BatchGenerator expects a model:
    token ids (or embeddings) and a cache in, logits out."""

    def __init__(self, vlm: nn.Module) -> None:
        super().__init__()
        self.lm = vlm.language_model

    @property
    def layers(self):
        return self.lm.model.layers

    def make_cache(self) -> list:
        return make_prompt_cache(self.lm)

    def __call__(self, inputs: mx.array, cache=None, **kwargs) -> mx.array:
        out = self.lm(inputs, cache=cache, **kwargs)
        return getattr(out, "logits", out)


def images_key(buffers: Sequence[memoryview]) -> int:
    """A stand-in token for every image placeholder position in prefix-cache
    keys: negative (no real token id is), and derived from the bytes of the
    request's tensors, so prompts with the same text but other images never
    share KV state."""
    h = hashlib.sha256()
    for b in buffers:
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return -1 - int.from_bytes(h.digest()[:7], "little")


class VisionPrefill:
    def __init__(self, vlm: nn.Module, image_token_id: int, step_size: int) -> None:
        self.vlm = vlm
        self.language_model = LanguageModel(vlm)
        self.image_token_id = image_token_id
        self.step_size = step_size

    def cache_key(self, prompt: list[int], buffers: Sequence[memoryview]) -> list[int]:
        key = images_key(buffers)
        return [key if t == self.image_token_id else t for t in prompt]

    def prefill(self, prompt: list[int], tensors: dict[str, np.ndarray], cache: list | None, reused: int) -> list:
        """The KV cache after prompt[:-1], continuing `cache` (which holds
        prompt[:reused]) or a fresh one."""
        ids = mx.array([prompt])
        if cache is None:
            cache, reused = self.language_model.make_cache(), 0
        embeddings = None  # when every image position is in the reused cache: text alone
        if self.image_token_id in prompt[reused:-1]:
            arrays = {name: mx.array(a) for name, a in tensors.items()}
            pixel_values = arrays.pop("pixel_values", None)
            embeddings = self.vlm.get_input_embeddings(ids, pixel_values, **arrays).inputs_embeds
        for start in range(reused, len(prompt) - 1, self.step_size):
            end = min(start + self.step_size, len(prompt) - 1)
            chunk = {} if embeddings is None else {"inputs_embeds": embeddings[:, start:end]}
            self.language_model(ids[:, start:end], cache=cache, **chunk)
            mx.eval([c.state for c in cache])
        return cache
