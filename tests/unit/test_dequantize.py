"""Quantized layers made float32 for MLX's CPU backend answer as the quantized ones do."""

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm import load

from worker.model import dequantize_for_cpu


@pytest.mark.parametrize("mode, bits", [("affine", 4), ("mxfp4", 4)])
def test_dequantized_layers_give_the_quantized_models_logits(tiny_model, mode, bits):
    """mxfp4 (gpt-oss's) has no biases and scales of its own format: it failed with a bare AssertionError."""
    model, tokenizer = load(str(tiny_model))
    nn.quantize(model, group_size=32, bits=bits, mode=mode)
    ids = mx.array([tokenizer.encode("Once upon a time")])
    quantized = model(ids).astype(mx.float32)
    assert dequantize_for_cpu(model) > 0
    assert not any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for _, m in model.named_modules())
    assert mx.allclose(model(ids), quantized, atol=1e-3, rtol=1e-3).item()
