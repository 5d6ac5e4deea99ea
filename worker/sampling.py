"""Per-request samplers for mlx-lm's BatchGenerator."""

from __future__ import annotations

import random

import mlx.core as mx
from mlx_lm.sample_utils import Sampler, apply_min_p, apply_top_k, apply_top_p

from protocol import Sampling

# Temperatures below this are greedy: smaller ones send every logit to -inf in
# float32 (1/T overflows, or the scaled logits do), and the draw is then uniform.
GREEDY_BELOW = 1e-5


def make_sampler(params: Sampling, vocab_size: int, drawn: int = 0) -> Sampler | None:
    """None for greedy, so every greedy request shares the generator's batched
    argmax; otherwise a sampler with its own random stream.

    Each step's key comes from the request's own Python RNG, seeded by
    `seed`: the same seed gives the same tokens whatever else is in the batch,
    and no chain of lazy MLX key arrays grows across steps. `drawn`: the
    tokens a request resumed on this worker had generated, whose keys were
    drawn on the worker before (its next token takes the key it would have).
    """
    if params.temperature < GREEDY_BELOW:
        return None
    filters = []
    if 0 < params.top_p < 1:
        filters.append(lambda x: apply_top_p(x, params.top_p))
    if params.min_p > 0:
        filters.append(lambda x: apply_min_p(x, params.min_p))
    if 0 < params.top_k < vocab_size:  # a top_k of the whole vocabulary keeps every token
        filters.append(lambda x: apply_top_k(x, params.top_k))
    keys = random.Random(params.seed)
    for _ in range(drawn):
        keys.getrandbits(64)
    inverse_temperature = 1.0 / params.temperature

    def sample(logprobs: mx.array) -> mx.array:
        for f in filters:
            logprobs = f(logprobs)
        key = mx.random.key(keys.getrandbits(64))
        return mx.random.categorical(logprobs * inverse_temperature, key=key)

    return sample
