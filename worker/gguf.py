"""Import a llama-architecture GGUF file into an mlx-lm model directory.

`mx.load(path, return_metadata=True)` already reads GGUF tensors, turning
Q4_0/Q4_1/Q8_0 blocks into MLX quantized triplets (weight, scales, biases).
What is left is ours: mapping llama.cpp's tensor names onto mlx-lm's llama
layout, working out each tensor's bits from its packed shape, writing
config.json, and rebuilding the tokenizer from the metadata.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import struct
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any, NamedTuple, cast

import mlx.core as mx
import numpy as np
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

log = logging.getLogger("mlxd.worker.gguf")

GGUF_MAGIC = b"GGUF"
GROUP_SIZE = 32  # every GGUF block quantization mx.load reads packs 32 weights a block

# llama.cpp's per-layer tensor names -> mlx-lm's llama module paths.
LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

# llama.cpp's token types
CONTROL, USER_DEFINED = 3, 4

# llama.cpp's pre-tokenizer names -> the HF pre-tokenizer that splits the same way.
_BYTE_LEVEL = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZERS = {
    "default": lambda: _BYTE_LEVEL,
    "gpt2": lambda: _BYTE_LEVEL,
    "smollm": lambda: pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), _BYTE_LEVEL]
    ),
    "llama-bpe": lambda: pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(pattern=_tokenizers_regex(_LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    ),
}


def _tokenizers_regex(pattern: str):
    from tokenizers import Regex

    return Regex(pattern)


class GGUFError(ValueError):
    """A GGUF file mlxd cannot import; the message says why."""


def _scalar(metadata: dict, key: str, default=None):
    value = metadata.get(key, default)
    if isinstance(value, mx.array):
        return value.item()
    return value


# Written into an import's config.json; an import of an older mlxd (lower, or
# none) is done again: 2 refuses the tensor types below (older ones took
# K-quants with wrong scales) and stops at the end-of-turn token too; 3 keeps
# BF16 tensors bfloat16 (older ones turned them into float16 by value).
IMPORT_VERSION = 3


def is_current_import(out_dir: Path) -> bool:
    """An import of a GGUF at `out_dir`, by this mlxd's importer."""
    try:
        version = json.loads((out_dir / "config.json").read_text()).get("mlxd_gguf_import", 0)
    except (OSError, ValueError, AttributeError):  # unreadable, not JSON, or JSON but no object
        return False
    return isinstance(version, int) and version >= IMPORT_VERSION


def drop_stale_import(out_dir: Path) -> None:
    """Remove an older mlxd's import at `out_dir` (if any), to be done again."""
    if (out_dir / "config.json").is_file() and not is_current_import(out_dir):
        log.info("%s was imported by an older mlxd; importing it again", out_dir)
        shutil.rmtree(out_dir)


# The tensor types (ggml_type) mlxd imports: floats, and the 32-weight block
# quantizations MLX turns into its own. MLX turns others into float16 (the
# K-quants, with wrong scales for half their sub-blocks) or fails on them.
READABLE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 8: "Q8_0", 30: "BF16"}
# MLX reads BF16 tensors as float16 by value (past 65504 an inf, below 6e-5
# precision lost), so mlxd reads their bytes itself.
BF16 = 30
OTHER_TYPES = {6: "Q5_0", 7: "Q5_1", 9: "Q8_1", 10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K",
               15: "Q8_K", 16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S",
               22: "IQ2_S", 23: "IQ4_XS", 29: "IQ1_M"}
# GGUF metadata value types: the fixed sizes (8: a string, 9: an array).
_VALUE_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


class Header(NamedTuple):
    architecture: str | None  # general.architecture
    types: dict[str, int]  # each tensor's ggml type
    offsets: dict[str, int]  # where each tensor's data starts in the file


def read_header(path: Path) -> Header:
    """The file's architecture, and each tensor's type and place, read from
    its header; the rest of the metadata is skipped. A length past the file's
    end is a GGUFError, never a read of it."""
    corrupt = f"{path} cannot be read (truncated or corrupt?)"
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size

        def take(fmt: str) -> int:
            data = f.read(struct.calcsize(fmt))
            if len(data) != struct.calcsize(fmt):
                raise GGUFError(f"{corrupt}: its header ends early")
            return struct.unpack(fmt, data)[0]

        def skip(length: int) -> None:
            if length > size - f.tell():
                raise GGUFError(f"{corrupt}: its header runs past the file's end")
            f.seek(length, 1)

        def text() -> str:
            length = take("<Q")
            if length > size - f.tell():
                raise GGUFError(f"{corrupt}: its header runs past the file's end")
            return f.read(length).decode("utf-8", "replace")

        def skip_value(kind: int, depth: int = 0) -> None:
            if kind == 8:
                skip(take("<Q"))
            elif kind == 9:
                item, count = take("<I"), take("<Q")
                if depth > 8:  # arrays of arrays this deep are no model's metadata (and would overflow the stack)
                    raise GGUFError(f"{corrupt}: its metadata nests arrays more than 8 deep")
                if item in _VALUE_SIZES:
                    skip(_VALUE_SIZES[item] * count)
                elif count > size - f.tell():  # every item takes a byte at least
                    raise GGUFError(f"{corrupt}: its header runs past the file's end")
                else:
                    for _ in range(count):
                        skip_value(item, depth + 1)
            elif kind in _VALUE_SIZES:
                skip(_VALUE_SIZES[kind])
            else:
                raise GGUFError(f"{corrupt}: metadata of unknown type {kind}")

        if f.read(4) != GGUF_MAGIC:
            raise GGUFError(f"{path} is not a GGUF file (no GGUF magic number)")
        take("<I")  # version
        tensors, entries = take("<Q"), take("<Q")
        architecture, alignment = None, 32
        for _ in range(entries):
            key, kind = text(), take("<I")
            if key == "general.architecture" and kind == 8:
                architecture = text()
            elif key == "general.alignment" and kind == 4:
                alignment = take("<I")
                if alignment <= 0 or alignment & (alignment - 1):  # MLX's own reader divides by it (0: SIGFPE)
                    raise GGUFError(f"{path}: general.alignment is {alignment}, not a power of two")
            else:
                skip_value(kind)
        types, offsets = {}, {}
        for _ in range(tensors):
            name = text()
            skip(8 * take("<I"))  # its dimensions
            types[name] = take("<I")
            offsets[name] = take("<Q")
        # The tensors' data starts at the first multiple of the alignment after the header.
        data_start = -(-f.tell() // alignment) * alignment
        return Header(architecture, types, {name: data_start + offset for name, offset in offsets.items()})


def read_gguf(path: Path) -> tuple[dict[str, mx.array], dict]:
    architecture, types, offsets = read_header(path)
    if architecture != "llama":
        raise GGUFError(
            f"{path.name}: architecture {architecture!r} is not supported; mlxd imports llama-architecture GGUFs"
        )
    unreadable = {name: kind for name, kind in types.items() if kind not in READABLE_TYPES}
    if unreadable:
        name, kind = next(iter(unreadable.items()))
        more = f", and {len(unreadable) - 1} more" if len(unreadable) > 1 else ""
        raise GGUFError(
            f"{path.name} holds tensors of type {OTHER_TYPES.get(kind, f'ggml type {kind}')} ({name}{more}); "
            f"mlxd imports GGUFs of {', '.join(sorted(READABLE_TYPES.values()))} "
            "(for a Q4_K_M or other K-quant file, take the Q4_0 or Q8_0 one, or the model's MLX conversion)")
    try:
        # With return_metadata, mx.load returns (arrays, metadata), which its stub does not say.
        weights, metadata = cast(tuple[dict[str, mx.array], dict[str, Any]], mx.load(str(path), return_metadata=True))
    except Exception as e:  # mlx raises plain RuntimeError/ValueError for broken files
        raise GGUFError(f"{path} cannot be read (truncated or corrupt?): {e}") from None
    for name in (name for name, kind in types.items() if kind == BF16):
        shape = weights[name].shape
        raw = np.fromfile(path, dtype="<u2", count=weights[name].size, offset=offsets[name])
        if raw.size != weights[name].size:
            raise GGUFError(f"{path} cannot be read (truncated or corrupt?): tensor {name} ends early")
        weights[name] = mx.array(raw.reshape(shape)).view(mx.bfloat16)
    return weights, metadata


def _mlx_name(gguf_name: str) -> str:
    stem, _, suffix = gguf_name.rpartition(".")
    parts = stem.split(".")
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{LAYER_TENSORS[parts[2]]}.{suffix}"
    if stem in GLOBAL_TENSORS:
        return f"{GLOBAL_TENSORS[stem]}.{suffix}"
    if stem == "rope_freqs":
        raise GGUFError("the file holds rope_freqs, Llama 3.1's scaled rotary frequencies, which mlxd's import does "
                        "not carry over; serve the model's MLX conversion instead (for Llama 3.1 and 3.2)")
    raise GGUFError(f"unexpected tensor {gguf_name!r} in a llama GGUF")


def convert_weights(weights: dict[str, mx.array]) -> tuple[dict[str, mx.array], dict[str, int]]:
    """mlx-lm names for every tensor, and the bits of each quantized module."""
    converted = {_mlx_name(name): w for name, w in weights.items()}
    bits = {}
    for name, scales in converted.items():
        if name.endswith(".scales"):
            module = name[: -len(".scales")]
            packed = converted[f"{module}.weight"]
            # A row of n weights at b bits packs into n*b/32 uint32 words, and
            # has n/GROUP_SIZE scales.
            bits[module] = packed.shape[-1] * 32 // (scales.shape[-1] * GROUP_SIZE)
    return converted, bits


def model_config(metadata: dict, vocab_size: int, bits: dict[str, int], tied: bool) -> dict:
    def need(key: str):
        value = _scalar(metadata, f"llama.{key}")
        if value is None:
            raise GGUFError(f"metadata key llama.{key} is missing")
        return value

    heads = need("attention.head_count")
    hidden = need("embedding_length")
    config = {
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": need("block_count"),
        "intermediate_size": need("feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": _scalar(metadata, "llama.attention.head_count_kv", heads),
        "head_dim": _scalar(metadata, "llama.attention.key_length", hidden // heads),
        "rms_norm_eps": _scalar(metadata, "llama.attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": _scalar(metadata, "llama.rope.freq_base", 10000.0),
        "max_position_embeddings": _scalar(metadata, "llama.context_length", 4096),
        "vocab_size": vocab_size,
        "tie_word_embeddings": tied,
        # llama.cpp stores Q and K permuted for interleaved ("traditional")
        # rotary embeddings; quantized rows cannot be un-permuted, so the
        # model rotates the same way instead.
        "rope_traditional": True,
    }
    if bits:
        default_bits = Counter(bits.values()).most_common(1)[0][0]
        quantization: dict = {"group_size": GROUP_SIZE, "bits": default_bits}
        for module, b in sorted(bits.items()):
            if b != default_bits:
                quantization[module] = {"group_size": GROUP_SIZE, "bits": b}
        config["quantization"] = quantization
    return config


def build_tokenizer(metadata: dict) -> tuple[Tokenizer, dict]:
    """An HF fast tokenizer and its tokenizer_config.json, from GGUF metadata."""
    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFError(
            f"tokenizer model {kind!r} is not supported; mlxd rebuilds BPE ('gpt2') tokenizers from GGUF"
        )
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise GGUFError(f"pre-tokenizer {pre!r} is not supported (known: {', '.join(sorted(PRE_TOKENIZERS))})")
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges", [])]
    raw_types = metadata.get("tokenizer.ggml.token_type")
    types = raw_types.tolist() if isinstance(raw_types, mx.array) else list(raw_types or [])
    assert isinstance(types, list)

    tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tokenizer.pre_tokenizer = PRE_TOKENIZERS[pre]()
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(
        [
            AddedToken(tokens[i], special=True, normalized=False)
            for i, t in enumerate(types)
            if t in (CONTROL, USER_DEFINED)
        ]
    )

    def token(key: str) -> str | None:
        i = _scalar(metadata, f"tokenizer.ggml.{key}_token_id")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    bos = token("bos")
    add_bos = bos is not None and bool(_scalar(metadata, "tokenizer.ggml.add_bos_token", False))
    if add_bos:
        assert bos is not None
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokens.index(bos))]
        )
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos"),
        "eos_token": token("eos"),
        "pad_token": token("padding"),
        "unk_token": token("unknown"),
        "add_bos_token": add_bos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": _scalar(metadata, "llama.context_length", 4096),
    }
    if template := metadata.get("tokenizer.chat_template"):
        config["chat_template"] = template
    return tokenizer, config


def import_gguf(gguf_path: Path, out_dir: Path, generation_config: dict | None = None) -> Path:
    """Write an mlx-lm model directory for `gguf_path` at `out_dir` (atomically).

    generation_config: the model's recommended sampling (temperature, top_p...),
    written as generation_config.json, which the gateway applies to requests
    that leave them out."""
    gguf_path = Path(gguf_path)
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise GGUFError(f"{out_dir} exists and is not empty")
    weights, metadata = read_gguf(gguf_path)
    try:
        tokenizer, tokenizer_config = build_tokenizer(metadata)
        converted, bits = convert_weights(weights)
        config = model_config(
            metadata, len(metadata["tokenizer.ggml.tokens"]), bits, tied="lm_head.weight" not in converted
        )
    except GGUFError:
        raise
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as error:  # metadata or tensors it cannot use
        raise GGUFError(f"{gguf_path} cannot be imported: {type(error).__name__}: {error}") from None
    # A chat model's turn may end with its end-of-turn (or Llama 3.1's end-of-message) token rather than
    # its EOS (older Llama 3 GGUFs): generation stops at any, as llama.cpp's does.
    ends = [e for key in ("eos_token_id", "eot_token_id", "eom_token_id")
            if (e := _scalar(metadata, f"tokenizer.ggml.{key}")) is not None]
    if ends:
        config["eos_token_id"] = ends[0] if len(set(ends)) == 1 else list(dict.fromkeys(ends))
    config["mlxd_gguf_import"] = IMPORT_VERSION

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    staging.chmod(0o755)
    try:
        mx.save_safetensors(str(staging / "model.safetensors"), converted, metadata={"format": "mlx"})
        (staging / "config.json").write_text(json.dumps(config, indent=2))
        tokenizer.save(str(staging / "tokenizer.json"))
        (staging / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
        if generation_config:
            (staging / "generation_config.json").write_text(json.dumps(generation_config, indent=2))
        if out_dir.exists():
            out_dir.rmdir()
        staging.rename(out_dir)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not (out_dir / "config.json").is_file():
            raise
        # Another import of the same file (a second worker of the model) finished first: its copy serves.
        log.info("%s was imported into %s meanwhile", gguf_path.name, out_dir)
        return out_dir
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    log.info("imported %s into %s", gguf_path.name, out_dir)
    return out_dir
