"""A random-weight model shaped like Qwen2.5-0.5B (or 7B) (bf16), for GPU serving benchmarks.

    python -m tests.bench.qwen_shaped OUT_DIR [7b]

Same layer sizes, heads and vocabulary size as Qwen2.5-0.5B-Instruct (or
Qwen2.5-7B-Instruct), random weights, and the test suite's trained tokenizer padded with placeholder tokens
to the full vocabulary size (so that every sampled id decodes).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models import qwen2

from tests.tiny_model import CHAT_TEMPLATE, train_tokenizer

CONFIG = {
    "model_type": "qwen2", "hidden_size": 896, "num_hidden_layers": 24, "intermediate_size": 4864,
    "num_attention_heads": 14, "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "vocab_size": 151936,
    "max_position_embeddings": 32768, "rope_theta": 1000000.0, "tie_word_embeddings": True,
}
SEVEN_B = {**CONFIG, "hidden_size": 3584, "num_hidden_layers": 28, "intermediate_size": 18944,
           "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064, "tie_word_embeddings": False}


def make(path: Path, config: dict = CONFIG) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    tok = json.loads(train_tokenizer().to_str())
    vocab = tok["model"]["vocab"]
    taken = len(vocab) + len(tok["added_tokens"])
    for i in range(taken, config["vocab_size"]):
        vocab[f"<x{i}>"] = i
    (path / "tokenizer.json").write_text(json.dumps(tok))
    eos = next(t["id"] for t in tok["added_tokens"] if t["content"] == "<|im_end|>")
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "bos_token": None, "chat_template": CHAT_TEMPLATE, "clean_up_tokenization_spaces": False,
    }))
    (path / "config.json").write_text(json.dumps({**config, "eos_token_id": eos}))
    model = qwen2.Model(qwen2.ModelArgs.from_dict(config))
    # Cast layer by layer: a 7B model in float32 at once would need twice its bf16 memory.
    model.set_dtype(mx.bfloat16)
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    return path


if __name__ == "__main__":
    print(make(Path(sys.argv[1]), SEVEN_B if sys.argv[2:] == ["7b"] else CONFIG))
