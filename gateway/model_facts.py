"""What model listings say of a model (/v1/models, Ollama's /api/tags and
/api/show): format, family, quantization, size, context length, from its
files where the gateway can see them and from its worker's Hello."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from gateway.ledger import local_model, weights_on_disk

# A config's dtype, as listings name it.
DTYPES = {"bfloat16": ("BF16", 16), "float16": ("F16", 16), "float32": ("F32", 32)}


@dataclass
class ModelFacts:
    format: str = ""  # "safetensors" or "gguf"; "" when its files are not on this machine
    family: str = ""  # the config's model_type
    quantization: str = ""  # "Q4", "Q8", "BF16", ...
    bits_per_weight: int = 0
    size: int = 0  # bytes of weights
    context_length: int | None = None
    modified: float | None = None  # its files' mtime
    chat_template: str = ""  # its default chat template, from its files ("" for a GGUF file, or none)
    takes_tools: bool = False  # one of its chat templates (a named `tool_use` one too) renders tools
    vision: bool = False  # its config has a vision tower

    @property
    def parameter_size(self) -> str:
        """An estimate from the size and the bits per weight, as Ollama writes it ("135M", "7.6B")."""
        if not self.size or not self.bits_per_weight:
            return ""
        params = self.size * 8 / self.bits_per_weight
        return f"{params / 1e9:.1f}B" if params >= 1e9 else f"{params / 1e6:.0f}M"


def model_facts(source: str) -> ModelFacts:
    """What the files of `source` (a directory, a .gguf file, a Hugging Face repo in the local cache) say."""
    path = local_model(source)
    if path is None:
        return ModelFacts()
    facts = ModelFacts(size=weights_on_disk(source), modified=path.stat().st_mtime)
    if path.is_file():
        facts.format = "gguf" if path.suffix == ".gguf" else ""
        return facts
    facts.format = "gguf" if any(path.glob("*.gguf")) else "safetensors"
    config = _json(path, "config.json")
    facts.family = str(config.get("model_type", ""))
    facts.vision = isinstance(config.get("vision_config"), dict)
    templates = _chat_templates(path)
    facts.chat_template = templates.get("default", "")
    facts.takes_tools = any("tools" in template for template in templates.values())
    text: dict = config["text_config"] if isinstance(config.get("text_config"), dict) else {}
    context = config.get("max_position_embeddings") or text.get("max_position_embeddings")
    facts.context_length = context if isinstance(context, int) else None
    quantization = config.get("quantization") or config.get("quantization_config") or {}
    bits = quantization.get("bits") if isinstance(quantization, dict) else None
    if isinstance(bits, int):
        facts.quantization, facts.bits_per_weight = f"Q{bits}", bits
    else:
        dtype = str(config.get("torch_dtype") or config.get("dtype") or text.get("torch_dtype") or "")
        facts.quantization, facts.bits_per_weight = DTYPES.get(dtype, ("", 0))
    return facts


def _chat_templates(directory: Path) -> dict[str, str]:
    """Its chat templates by name ("default" for the one a model without
    names has): tokenizer_config.json's (a text, or named templates), the
    default else from chat_template.jinja, else chat_template.json (vision
    models' processors keep it there)."""
    template = _json(directory, "tokenizer_config.json").get("chat_template")
    templates: dict[str, str] = {}
    if isinstance(template, str):
        templates["default"] = template
    elif isinstance(template, list):
        templates = {t["name"]: t["template"] for t in template
                     if isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)}
    if "default" not in templates:
        try:
            templates["default"] = (directory / "chat_template.jinja").read_text()
        except (OSError, ValueError):  # none, or not UTF-8 (which the worker refuses at load, with its reason)
            if isinstance(template := _json(directory, "chat_template.json").get("chat_template"), str):
                templates["default"] = template
    return templates


def _json(directory: Path, name: str) -> dict:
    """A JSON object file of the model's; {} when it is missing, unreadable or not an object."""
    try:
        content = json.loads((directory / name).read_text())
    except (OSError, ValueError):
        return {}
    return content if isinstance(content, dict) else {}
