"""Write a tiny mlx-lm llama model out as a GGUF file the way llama.cpp does.

Used by the import tests to make GGUF files with known contents: the float
path through `mx.save_gguf`, the quantized path through llama.cpp's own
`gguf` Python package (MLX cannot write quantized GGUF).
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np

LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def gguf_name(name: str) -> str:
    module, _, suffix = name.rpartition(".")
    if module in GLOBAL:
        return f"{GLOBAL[module]}.{suffix}"
    _, _, layer, rest = module.split(".", 3)
    return f"blk.{layer}.{LAYER[rest]}.{suffix}"


def permute_for_gguf(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's Q/K row order: rotary pairs interleaved instead of split in halves."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_from_gguf(w: np.ndarray, heads: int) -> np.ndarray:
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def heads_of(name: str, config: dict) -> int | None:
    if name.endswith("attn_q.weight"):
        return config["num_attention_heads"]
    if name.endswith("attn_k.weight"):
        return config["num_key_value_heads"]
    return None


def gguf_weights(model_dir: Path) -> dict[str, np.ndarray]:
    """The model's float weights under llama.cpp names, Q and K permuted."""
    config = json.loads((model_dir / "config.json").read_text())
    out = {}
    for name, w in mx.load(str(model_dir / "model.safetensors")).items():
        name = gguf_name(name)
        array = np.array(w.astype(mx.float32))
        if (heads := heads_of(name, config)) is not None:
            array = permute_for_gguf(array, heads)
        out[name] = array
    return out


def tokenizer_metadata(model_dir: Path) -> dict:
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    tok_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    vocab = tok["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {t["content"] for t in tok["added_tokens"] if t["special"]}
    merges = [" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]]
    return {
        "tokens": tokens,
        "merges": merges,
        "types": [3 if t in special else 1 for t in tokens],
        "eos": vocab[tok_config["eos_token"]],
        "pad": vocab[tok_config["pad_token"]],
        "chat_template": tok_config["chat_template"],
    }


def save_float_gguf(model_dir: Path, path: Path, architecture: str = "llama", extra: dict | None = None) -> Path:
    """With mx.save_gguf and the metadata a llama.cpp conversion carries (and `extra`'s)."""
    config = json.loads((model_dir / "config.json").read_text())
    t = tokenizer_metadata(model_dir)
    u32 = lambda v: mx.array(v, dtype=mx.uint32)  # noqa: E731
    metadata = {
        "general.architecture": architecture,
        "general.name": "tiny",
        f"{architecture}.block_count": u32(config["num_hidden_layers"]),
        f"{architecture}.context_length": u32(config["max_position_embeddings"]),
        f"{architecture}.embedding_length": u32(config["hidden_size"]),
        f"{architecture}.feed_forward_length": u32(config["intermediate_size"]),
        f"{architecture}.attention.head_count": u32(config["num_attention_heads"]),
        f"{architecture}.attention.head_count_kv": u32(config["num_key_value_heads"]),
        f"{architecture}.attention.layer_norm_rms_epsilon": mx.array(config["rms_norm_eps"], dtype=mx.float32),
        f"{architecture}.rope.freq_base": mx.array(config["rope_theta"], dtype=mx.float32),
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt2",
        "tokenizer.ggml.tokens": t["tokens"],
        "tokenizer.ggml.merges": t["merges"],
        "tokenizer.ggml.token_type": mx.array(t["types"], dtype=mx.int32),
        "tokenizer.ggml.eos_token_id": u32(t["eos"]),
        "tokenizer.ggml.padding_token_id": u32(t["pad"]),
        "tokenizer.chat_template": t["chat_template"],
        **(extra or {}),
    }
    weights = {name: mx.array(w) for name, w in gguf_weights(model_dir).items()}
    mx.save_gguf(str(path), weights, metadata)
    return path


# Like llama.cpp's Q4_0 files: 8-bit embeddings, 4-bit linear layers, float norms.
QUANT_TYPES = {"token_embd": gguf.GGMLQuantizationType.Q8_0, "default": gguf.GGMLQuantizationType.Q4_0}


def quant_type(name: str, array: np.ndarray, types: dict):
    if array.ndim != 2:
        return None
    return types.get(name.split(".")[0], types["default"])


def save_quantized_gguf(model_dir: Path, path: Path, types: dict = QUANT_TYPES) -> dict[str, np.ndarray]:
    """Write a quantized GGUF with llama.cpp's writer; return the weights it
    really holds (dequantized, under llama.cpp names), for a reference.
    types: by tensor name's first part, or "default"."""
    config = json.loads((model_dir / "config.json").read_text())
    t = tokenizer_metadata(model_dir)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-q")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(t["tokens"])
    writer.add_token_merges(t["merges"])
    writer.add_token_types(t["types"])
    writer.add_eos_token_id(t["eos"])
    writer.add_pad_token_id(t["pad"])
    writer.add_chat_template(t["chat_template"])
    held = {}
    for name, array in gguf_weights(model_dir).items():
        qtype = quant_type(name, array, types)
        if qtype is None:
            writer.add_tensor(name, array)
            held[name] = array
        else:
            packed = gguf.quants.quantize(array, qtype)
            writer.add_tensor(name, packed, raw_dtype=qtype)
            held[name] = gguf.quants.dequantize(packed, qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return held
