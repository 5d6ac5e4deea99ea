"""Loading a model on the worker's main thread, and what the gateway must learn of it."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map, tree_unflatten
from mlx_lm.utils import load as mlx_lm_load
from mlx_lm.utils import load_tokenizer, sharded_load

from worker.model_source import cache_dir, resolve_model
from worker.vision import PROCESSOR_FILE_NAMES, load_vision_model

log = logging.getLogger("mlxd.worker.model")

# Tokenizer files travel to the gateway in the Hello; weights never do.
# A tokenizer's vocabulary is in one of these (the rest of TOKENIZER_FILE_NAMES only configure it).
VOCABULARY_FILES = {"tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt"}
TOKENIZER_FILE_NAMES = {
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.json",
    "chat_template.jinja",
    "generation_config.json",
    "config.json",
}
DEFAULT_CONTEXT_LENGTH = 4096


@dataclass
class LoadedModel:
    model: nn.Module
    name: str
    path: Path
    hf_tokenizer: object
    eos_token_ids: list[int]
    vocab_size: int
    context_length: int
    tokenizer_files: dict[str, bytes]
    # A vision-language model (mlx-vlm): `model` is the whole of it.
    image_token_id: int | None = None
    dequantized: bool = False  # quantized layers run as float32 (dequantize_for_cpu)
    # What the worker serves, as weights: see model_digest.
    digest: str = ""
    tool_parser: str = ""  # the mlx_lm.tool_parsers module mlx-lm chose from the chat template, if any
    reasoning_markers: list[str] = field(default_factory=list)  # [start, end] of mlx-lm's thinking block, if any


def _text_config(config: dict) -> dict:
    return config.get("text_config", config)


def dequantize_for_cpu(model: nn.Module) -> int:
    """Replace quantized layers with float32 ones; return how many.

    MLX's CPU backend has no fast quantized matmul, while float32 matmuls go to
    BLAS (OpenBLAS on Linux): SmolLM2-135M-Q4_1 decodes about 2x faster alone
    and 10x faster at 8 concurrent requests once dequantized. On the GPU the
    quantized kernels are the fast path and nothing changes.
    """
    replaced = []
    for name, module in model.named_modules():
        if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            if module.biases is not None:  # affine (GGUF's, most of mlx-lm's): float32 scales dequantize faster here
                weight = mx.dequantize(module.weight, module.scales.astype(mx.float32),
                                       module.biases.astype(mx.float32), module.group_size, module.bits)
            else:  # mxfp4, nvfp4 (gpt-oss): scales of their own format, no biases
                weight = mx.dequantize(module.weight, module.scales, None, module.group_size, module.bits,
                                       mode=module.mode)
            plain: nn.Module
            if isinstance(module, nn.QuantizedEmbedding):
                plain = nn.Embedding(*weight.shape)
            else:
                plain = nn.Linear(weight.shape[1], weight.shape[0], bias="bias" in module)
                if "bias" in module:
                    plain.bias = module.bias.astype(mx.float32)
            plain.weight = weight
            replaced.append((name, plain))
    if replaced:
        model.update_modules(tree_unflatten(replaced))
        model.update(tree_map(lambda a: a.astype(mx.float32) if mx.issubdtype(a.dtype, mx.floating) else a,
                              model.parameters()))
        mx.eval(model.parameters())
    return len(replaced)


WEIGHT_SUFFIXES = (".safetensors", ".npz")


def model_digest(path: Path) -> str:
    """SHA-256 over config.json and the bytes of every weight file.

    Two models may share a tokenizer (a fine-tune, another size of a family)
    and still be different models: a request resumes only on a worker with
    the same digest. Hashing gigabytes takes seconds, so the digest is kept
    in the cache, keyed by each file's path, size and modification time.
    """
    files = sorted(f for f in path.iterdir() if f.name == "config.json" or f.suffix in WEIGHT_SUFFIXES)
    key = hashlib.sha256()
    for f in files:
        st = f.stat()
        key.update(f"{f.resolve()}:{st.st_size}:{st.st_mtime_ns}\0".encode())
    cached = cache_dir() / "digests" / key.hexdigest()
    if cached.is_file():
        return cached.read_text().strip()
    digest = hashlib.sha256()
    for f in files:
        with open(f, "rb") as data:
            digest.update(f.name.encode() + b"\0" + hashlib.file_digest(data, "sha256").digest())
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        # Written aside and moved into place: workers starting together (a group's ranks on one
        # host, replicas) read the file as soon as it exists, and one half written is another digest.
        writing = cached.with_name(f"{cached.name}.{os.getpid()}.{threading.get_ident()}")
        writing.write_text(digest.hexdigest())
        os.replace(writing, cached)
    except OSError as e:  # a read-only cache costs the next start a rehash, nothing more
        log.warning("could not keep the model digest in %s: %s", cached.parent, e)
    return digest.hexdigest()


@dataclass
class Sharding:
    """This process's part of a model split across an mx.distributed group."""

    group: mx.distributed.Group
    pipeline: bool  # a run of layers per rank; else every layer split across the ranks (tensor parallel)
    # Set once this rank's shard is loaded. mlx-lm's sharded_load ends on a barrier of the whole group:
    # a rank that failed before it must still meet the others there (RankChannel.meet_load_barrier).
    loaded: bool = False


def load_model(spec: str, context_length: int | None = None, cpu_dequantize: bool = True,
               sharding: Sharding | None = None) -> LoadedModel:
    """Resolve `spec` (see worker.model_source) and load it, or this rank's
    shard of it. Main thread only for MLX; the weights are hashed
    (model_digest) in a thread meanwhile."""
    path, name = resolve_model(spec)
    with ThreadPoolExecutor(1, thread_name_prefix="mlxd-digest") as pool:
        hashing = pool.submit(model_digest, path)
        loaded = _load(path, name, context_length, cpu_dequantize, sharding)
        # Run as float32 on a CPU, the same weights give other logits than quantized.
        loaded.digest = hashing.result() + (":float32" if loaded.dequantized else "")
    return loaded


def _load(path: Path, name: str, context_length: int | None, cpu_dequantize: bool,
          sharding: Sharding | None) -> LoadedModel:
    config = json.loads((path / "config.json").read_text())
    if not any((path / file).is_file() for file in VOCABULARY_FILES) and not any(path.glob("*.tiktoken")):
        raise ValueError(f"{path} has no tokenizer files ({', '.join(sorted(VOCABULARY_FILES))} or *.tiktoken); "
                         "copy them from the model's repository beside its weights")
    image_token_id = None
    if "vision_config" in config and sharding is not None:
        raise ValueError("a vision model cannot be split across a distributed group (mlx-vlm models do not shard)")
    if sharding is not None:  # mlx-lm shards the model (shard() or pipeline()) and loads this rank's weights
        groups = (sharding.group, None) if sharding.pipeline else (None, sharding.group)
        # Its tokenizer is otherwise loaded with remote code trusted (mlx-lm's default there): an auto_map
        # in a repo's tokenizer_config would run code from the hub on every Mac of the group.
        model, tokenizer = sharded_load(str(path), *groups, tokenizer_config={"trust_remote_code": False})[:2]
        sharding.loaded = True
    elif "vision_config" in config:  # a vision-language model, for mlx-vlm
        model, image_token_id = load_vision_model(path)
        tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    else:
        model, tokenizer = mlx_lm_load(str(path))[:2]
    shared_files = TOKENIZER_FILE_NAMES | (PROCESSOR_FILE_NAMES if image_token_id is not None else set())
    dequantized = 0
    if cpu_dequantize and mx.default_device() == mx.cpu:
        if dequantized := dequantize_for_cpu(model):
            log.info("CPU backend: dequantized %d quantized layers to float32 for BLAS", dequantized)
    text_config = _text_config(config)
    model_context = text_config.get("max_position_embeddings", DEFAULT_CONTEXT_LENGTH)
    return LoadedModel(
        model=model,
        name=name,
        path=path,
        hf_tokenizer=tokenizer._tokenizer,
        eos_token_ids=sorted(tokenizer.eos_token_ids),
        vocab_size=text_config["vocab_size"],
        context_length=min(context_length, model_context) if context_length else model_context,
        tokenizer_files={
            f.name: f.read_bytes() for f in sorted(path.iterdir()) if f.name in shared_files
        },
        image_token_id=image_token_id,
        dequantized=bool(dequantized),
        tool_parser=tokenizer.tool_parser.__module__.rpartition(".")[2] if tokenizer.has_tool_calling else "",
        reasoning_markers=[tokenizer.think_start, tokenizer.think_end] if tokenizer.has_thinking else [],
    )
