"""mlx-lm's tool-call parsers, loaded into the gateway without importing MLX.

The worker names the parser mlx-lm chose for its model from the chat template
(`Hello.tool_parser`, e.g. "qwen3_coder", "glm47", "minimax_m2"). Each of
mlx-lm's parsers is a pure-Python module (markers and a `parse_tool_call`),
but importing it as `mlx_lm.tool_parsers.<name>` would run `mlx_lm`'s package
init, which imports MLX; so the gateway loads the parser package from its
files under a name of its own.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_PACKAGE = "mlxd_mlx_lm_tool_parsers"


@dataclass(frozen=True)
class ToolFormat:
    """A tool-call format: the text around a call, and the function that reads one."""

    name: str
    start: str
    end: str  # "": a call runs to the end of the message
    parse_one: Callable[[str, Any], Any]

    def parse(self, text: str, tools: list[dict] | None) -> list[tuple[str, str, str]] | None:
        """(name, arguments as JSON text, id or "") of each call the text holds; None when it holds none."""
        try:
            parsed = self.parse_one(text, tools)
            calls = []
            for call in parsed if isinstance(parsed, list) else [parsed]:
                if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                    return None
                arguments = call.get("arguments", {})
                if isinstance(arguments, dict):
                    arguments = _json_values(arguments, tools, call["name"])
                # Some parsers read a value as Python (ast.literal_eval): a set, bytes or an infinity
                # the model wrote is no JSON, and the call stays text.
                calls.append((call["name"], arguments if isinstance(arguments, str) else
                              json.dumps(arguments, allow_nan=False),
                              call["id"] if isinstance(call.get("id"), str) else ""))
        except Exception:  # each parser raises its own kinds: a call that does not parse stays text
            return None
        return calls or None


# Keys that make a schema without a `type` say something other than "any text".
COMPOSITE = ("$ref", "anyOf", "oneOf", "allOf", "const")


def raw_text_value(schema: dict) -> bool:
    """Whether a tag format (Qwen3-Coder's, GLM's, MiniMax's) writes a value of
    `schema` as raw text between its tags: a string, or anything untyped. The
    rest (numbers, objects, a type list, an enum's other values, a schema that
    refers or combines) is JSON text, as forced calls' grammars write it."""
    return schema.get("type") == "string" or ("type" not in schema and not any(k in schema for k in COMPOSITE))


def _json_values(arguments: dict, tools: list[dict] | None, name: str) -> dict:
    """Arguments with each value that the tool's schema has as JSON read as
    JSON: the tag formats' parsers read a value whose schema they do not
    follow as text, so `2` of `{"enum": [1, 2, 3]}` came back as "2", and
    `5` of Pydantic's Optional[int] (anyOf integer, null) as "5"."""
    tool = next((t for t in tools or () if t.get("function", {}).get("name") == name), None)
    properties = (tool["function"].get("parameters") or {}).get("properties") if tool else None
    if not isinstance(properties, dict):
        return arguments
    typed = {}
    for key, value in arguments.items():
        schema = properties.get(key)
        if isinstance(value, str) and isinstance(schema, dict):
            enum = schema.get("enum")
            if isinstance(enum, list) and enum:  # its strings raw, its other values as JSON text
                value = next((e for e in enum if not isinstance(e, str) and json.dumps(e) == value), value)
            elif not raw_text_value(schema):
                try:
                    value = json.loads(value)
                except ValueError:
                    pass  # written as text all the same (a call the grammar did not hold): kept as it came
        typed[key] = value
    return typed


def _package() -> str | None:
    """Register mlx-lm's tool_parsers directory as a package of its own; None without mlx-lm."""
    if _PACKAGE in sys.modules:
        return _PACKAGE
    spec = importlib.util.find_spec("mlx_lm")  # finds the package without running it
    if spec is None or not spec.submodule_search_locations:
        return None
    directory = Path(next(iter(spec.submodule_search_locations))) / "tool_parsers"
    package_spec = importlib.util.spec_from_file_location(
        _PACKAGE, directory / "__init__.py", submodule_search_locations=[str(directory)])
    if package_spec is None or package_spec.loader is None:
        return None
    package = importlib.util.module_from_spec(package_spec)
    sys.modules[_PACKAGE] = package
    package_spec.loader.exec_module(package)
    return _PACKAGE


def load_tool_format(name: str) -> ToolFormat | None:
    """mlx-lm's parser by its module name; None for no name or one mlx-lm does not have."""
    if not name.isidentifier() or (package := _package()) is None:
        return None
    try:
        module = importlib.import_module(f"{package}.{name}")
    except ImportError:
        return None
    return ToolFormat(name, module.tool_call_start, module.tool_call_end, module.parse_tool_call)
