"""The KV footprint a worker announces, measured on its own cache layers, against
the textbook count from the model's configuration: 2 (keys and values) x KV
heads x head dim x bytes per value, per layer and token; a sliding-window
layer stops at its window."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models import gemma3_text, llama

from worker.footprint import kv_footprint, probe_cache

mx.random.seed(0)


def by_the_book(kv_heads: int, head_dim: int, dtype: mx.Dtype) -> int:
    return 2 * kv_heads * head_dim * dtype.size


def test_full_attention_layers_grow_with_every_token():
    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=3, intermediate_size=128,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=100)
    footprint = kv_footprint(probe_cache(llama.Model(args)))
    per_layer = by_the_book(2, 16, mx.float32)
    assert (footprint.per_token, footprint.windowed, footprint.fixed) == (3 * per_layer, (), 0)
    assert footprint.bytes_for(1000) == 1000 * 3 * per_layer


@pytest.mark.parametrize("tokens", [5, 8, 300])
def test_sliding_window_layers_stop_at_their_window(tokens):
    # Gemma 3: five sliding-window layers (window 8) to one global one.
    args = gemma3_text.ModelArgs(model_type="gemma3_text", hidden_size=64, num_hidden_layers=6, intermediate_size=128,
                                 num_attention_heads=4, head_dim=16, rms_norm_eps=1e-6, vocab_size=100,
                                 num_key_value_heads=1, sliding_window=8, sliding_window_pattern=6)
    footprint = kv_footprint(probe_cache(gemma3_text.Model(args)))
    per_layer = by_the_book(1, 16, mx.float32)
    assert footprint.per_token == per_layer and footprint.windowed == ((per_layer, 8),) * 5
    assert footprint.bytes_for(tokens) == tokens * per_layer + 5 * min(tokens, 8) * per_layer
