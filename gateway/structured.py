"""Grammars for structured output and forced tool calls (llguidance's format).

Built and validated here, so an unsupported schema is a 400 before the
worker sees anything; the worker only follows them.
"""

from __future__ import annotations

import json
from collections.abc import Collection

import llguidance

from gateway.errors import APIError


def _validated(grammar: str, param: str) -> str:
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise APIError(400, f"unsupported schema or grammar: {error}", param=param, code="unsupported_schema")
    return grammar


# Compact JSON: a free choice of whitespace lets small models wander into
# endless newlines instead of finishing the value.
COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _compact(schema: dict) -> dict:
    return {**schema, "x-guidance": {**COMPACT, **schema.get("x-guidance", {})}}


def json_schema_grammar(schema: dict | None, param: str = "response_format") -> str:
    """Output that is one JSON value following `schema` (any JSON object without one)."""
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(_compact(schema or {"type": "object"}))
    except (ValueError, TypeError) as e:
        raise APIError(400, f"unsupported schema: {e}", param=param, code="unsupported_schema") from None
    return _validated(grammar, param)


def _call_schema(tool: dict, arguments_key: str) -> dict:
    function = tool["function"]
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]},
                       arguments_key: function.get("parameters") or {"type": "object"}},
        "required": ["name", arguments_key],
        "additionalProperties": False,
    }


def named_tool(tools: list[dict], name: str) -> list[dict]:
    """The tool a named tool_choice asks for (400 when it is not among the tools)."""
    chosen = [t for t in tools if t["function"]["name"] == name]
    if not chosen:
        raise APIError(400, f"tool_choice names {name!r}, which is not among the tools", param="tool_choice")
    return chosen


def _marker(text: str, tokens: Collection[str]) -> str:
    """A format marker in lark: the model's own token when it has one (llguidance
    matches an added token only as itself, never by its text), else the text."""
    return text if text in tokens else json.dumps(text)


def _harmony_call_grammar(tools: list[dict], tokens: Collection[str]) -> str:
    """One Harmony message to one of the tools: its name in the header, its arguments as the body."""
    channel, constrain, message = (_marker(m, tokens) for m in ("<|channel|>", "<|constrain|>", "<|message|>"))
    calls = [f'{channel} "commentary to=functions.{tool["function"]["name"]} " {constrain} "json" {message} '
             f'%json {json.dumps(_compact(tool["function"].get("parameters") or {"type": "object"}))}'
             for tool in tools]
    return "start: " + " | ".join(f"call{i}" for i in range(len(calls))) + "\n" + "".join(
        f"call{i}: {call}\n" for i, call in enumerate(calls))


# Each family's call: the markers before and after its JSON.
AROUND = {"hermes": (["<tool_call>", "\n"], ["\n", "</tool_call>"]), "mistral": (["[TOOL_CALLS]"], []),
          "llama3": ([], [])}


def forced_tool_call_grammar(tools: list[dict], family: str, tokens: Collection[str] = (),
                             param: str = "tool_choice") -> str:
    """Output that is exactly one call of one of `tools`, in the model's own
    tool-call format; `tokens`: the model's added tokens."""
    if family == "harmony":
        return _validated(llguidance.LLMatcher.grammar_from_lark(_harmony_call_grammar(tools, tokens)), param)
    key = "parameters" if family == "llama3" else "arguments"
    calls = [_call_schema(tool, key) for tool in tools]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    if family == "mistral":
        schema = {"type": "array", "items": schema, "minItems": 1, "maxItems": 1}
    before, after = AROUND[family]
    sequence = " ".join([_marker(m, tokens) for m in before] + ["call"] + [_marker(m, tokens) for m in after])
    lark = f"start: {sequence}\ncall: %json {json.dumps(_compact(schema))}\n"
    return _validated(llguidance.LLMatcher.grammar_from_lark(lark), param)
