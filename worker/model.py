"""Loading a model on the worker's main thread, and what the gateway must learn of it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import mlx.nn as nn
from mlx_lm.utils import load as mlx_lm_load

from worker.model_source import resolve_model

# Tokenizer files travel to the gateway in the Hello; weights never do.
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
    eos_token_ids: list[int]
    vocab_size: int
    context_length: int
    tokenizer_files: dict[str, bytes]


def _text_config(config: dict) -> dict:
    return config.get("text_config", config)


def load_model(spec: str, context_length: int | None = None) -> LoadedModel:
    """Resolve `spec` (see worker.model_source) and load it. Main thread only."""
    path, name = resolve_model(spec)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"model {spec!r}: {path / 'config.json'} is missing")
    model, tokenizer = mlx_lm_load(str(path))
    config = _text_config(json.loads((path / "config.json").read_text()))
    model_context = config.get("max_position_embeddings", DEFAULT_CONTEXT_LENGTH)
    return LoadedModel(
        model=model,
        name=name,
        path=path,
        eos_token_ids=sorted(tokenizer.eos_token_ids),
        vocab_size=config["vocab_size"],
        context_length=min(context_length, model_context) if context_length else model_context,
        tokenizer_files={
            f.name: f.read_bytes() for f in sorted(path.iterdir()) if f.name in TOKENIZER_FILE_NAMES
        },
    )
