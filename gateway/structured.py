"""Grammars for structured output and forced tool calls (llguidance's format).

Built and validated here, so an unsupported schema is a 400 before the
worker sees anything; the worker only follows them.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import llguidance

from gateway.errors import APIError
from gateway.tool_formats import raw_text_value


def _validated(grammar: str, param: str) -> str:
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise APIError(400, f"unsupported schema or grammar: {error}", param=param, code="unsupported_schema")
    return grammar


# Bounds on a schema, or on the tools of a forced call: its grammar is built on
# the gateway's event loop and again on the worker's main thread, in times that
# grow faster than its size (4,000 properties took 0.2 s and 0.3 s here, 12,000
# took 1.3 s and 1.8 s). Coding agents' tool lists hold a few hundred values.
MAX_SCHEMA_VALUES = 10_000
MAX_SCHEMA_DEPTH = 64


def _bounded(value: object, param: str) -> None:
    """A 400 for a schema of more values (objects, arrays, scalars) or deeper than the bounds."""
    count, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        count += 1
        if count > MAX_SCHEMA_VALUES or depth > MAX_SCHEMA_DEPTH:
            raise APIError(400, f"the schema is too large: this server takes schemas of at most {MAX_SCHEMA_VALUES} "
                                f"values, nested at most {MAX_SCHEMA_DEPTH} deep", param=param,
                           code="unsupported_schema")
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        stack.extend((child, depth + 1) for child in children)


# Compact JSON: a free choice of whitespace lets small models wander into
# endless newlines instead of finishing the value.
COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _compact(schema: dict, strict: bool = False) -> dict:
    """The schema with mlxd's settings for llguidance. Not strict (OpenAI's
    default, and forced tool calls): keywords llguidance does not implement
    (`uniqueItems`, which Pydantic writes for a set, `not`, `if`), string
    formats it does not know and patterns its regular expressions cannot
    hold (look-around, backreferences: a password rule's) are left
    unenforced. Strict: such a keyword or pattern is a 400, as OpenAI's
    strict mode refuses what it cannot guarantee; unknown formats are
    dropped still (JSON Schema makes them annotations)."""
    own = schema.get("x-guidance")
    guidance = {**COMPACT, "lenient": not strict, **(own if isinstance(own, dict) else {})}
    unenforceable = ("format", _format_known) if strict else ("pattern", _pattern_known)
    return {**_without(schema, *unenforceable), "x-guidance": guidance}


def _known(schema: dict) -> bool:
    return not llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_json_schema(schema))


@functools.lru_cache(maxsize=256)
def _format_known(name: str) -> bool:
    """Whether llguidance can hold a string to this JSON Schema format."""
    return _known({"type": "string", "format": name})


@functools.lru_cache(maxsize=256)
def _pattern_known(pattern: str) -> bool:
    """Whether llguidance's regular expressions can hold a string to this pattern."""
    return _known({"type": "string", "pattern": pattern})


# Keywords whose values are data, not schemas: a "format" or "$ref" key in them is the data's.
DATA_KEYS = ("const", "enum", "default", "examples")
# Keywords whose values map names (a property's, a definition's) to schemas.
NAMED_SCHEMAS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def _without(value, keyword: str, known: Callable[[str], bool], named: bool = False):
    """The schema without the string-valued `keyword`s (`format`, `pattern`)
    llguidance cannot hold (`known` says which it can). JSON Schema makes
    `format` an annotation a validator may ignore, and common schemas carry
    many (Pydantic writes `password`, `binary`, `path`; OpenAPI `byte`,
    `int64`): llguidance would refuse the whole schema for one.
    named: `value` maps names to schemas (a property called "format" or "enum" is no keyword)."""
    if isinstance(value, dict):
        if named:
            return {name: _without(schema, keyword, known) for name, schema in value.items()}
        return {key: item if key in DATA_KEYS else _without(item, keyword, known, key in NAMED_SCHEMAS)
                for key, item in value.items()
                if not (key == keyword and isinstance(item, str) and not known(item))}
    if isinstance(value, list):
        return [_without(item, keyword, known) for item in value]
    return value


def json_schema_grammar(schema: dict | None, param: str = "response_format", strict: bool = False) -> str:
    """Output that is one JSON value following `schema` (any JSON object without one)."""
    _bounded(schema, param)
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(_compact(schema or {"type": "object"}, strict))
    except (ValueError, TypeError) as e:
        raise APIError(400, f"unsupported schema: {e}", param=param, code="unsupported_schema") from None
    return _validated(grammar, param)


# Where a schema keeps the definitions its `$ref`s name (`#/$defs/...`), as
# Pydantic's and MCP's tool schemas do: they must stay at the root of the
# schema the grammar is made of, wherever the tool's parameters end up in it.
DEFINITIONS = ("$defs", "definitions")
DEFINITION_REFS = tuple(f"#/{key}/" for key in DEFINITIONS)  # how a `$ref` to one of them starts


def _definitions(schema: dict) -> dict:
    return {key: schema[key] for key in DEFINITIONS if isinstance(schema.get(key), dict)}


def _rebased(schema, at: str):
    """`schema` moved to `at` (a JSON pointer, "#/properties/arguments") inside
    another: its references to its own root or to places in it other than
    its definitions (which go to the new root) point there again. Zod writes
    "#/properties/a" for a type used twice, and "#" for a recursive one."""
    if isinstance(schema, list):
        return [_rebased(item, at) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#") and \
                not value.startswith(DEFINITION_REFS):
            out[key] = at + value[1:]
        else:
            out[key] = value if key in DATA_KEYS else _rebased(value, at)
    return out


def _call_schema(tool: dict, arguments_key: str, at: str = "#") -> dict:
    """A call of `tool` as one JSON object, the schema at `at` within the grammar's."""
    function = tool["function"]
    parameters = function.get("parameters") or {"type": "object"}
    arguments = _rebased({k: v for k, v in parameters.items() if k not in DEFINITIONS},
                         f"{at}/properties/{arguments_key}")
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, arguments_key: arguments},
        "required": ["name", arguments_key],
        "additionalProperties": False,
        **_definitions(parameters),
    }


def named_tool(tools: list[dict], name: str) -> list[dict]:
    """The tool a named tool_choice asks for (400 when it is not among the tools)."""
    chosen = [t for t in tools if t["function"]["name"] == name]
    if not chosen:
        raise APIError(400, f"tool_choice names {name!r}, which is not among the tools", param="tool_choice")
    return chosen


def _pieces(text: str, tokens: Mapping[str, int]) -> list[tuple[str, int | None]]:
    """`text` cut into the model's added tokens it holds (a marker's: longer than
    a character, not whitespace), each with its id, and the text between them (None)."""
    found = sorted((t for t in tokens if len(t) > 1 and not t.isspace() and t in text), key=len, reverse=True)
    parts = re.split("(" + "|".join(map(re.escape, found)) + ")", text) if found else [text]
    return [(part, tokens[part] if part in found else None) for part in parts if part]


def _lark(pieces: list[tuple[str, int | None]]) -> str:
    return " ".join(json.dumps(part) if token is None else f"<[{token}]>" for part, token in pieces)


def _text(text: str, tokens: Mapping[str, int]) -> str:
    """Fixed text in lark, where any of the model's added tokens in it is written
    as that token (`<[id]>`): llguidance matches an added token only as itself,
    never by its text, and a model writes its format's markers as those tokens."""
    return _lark(_pieces(text, tokens))


def _arguments(schema: dict | None) -> str:
    """A JSON value following `schema` (any object without one)."""
    return f"%json {json.dumps(_compact(schema or {'type': 'object'}))}"


# Formats whose call names the tool in a header, then gives its arguments as one JSON object.
# Kimi's header numbers the call among the conversation's ({index}: the model writes the number, which
# is the call's id; always 0, every turn's call had one id).
JSON_BODY = {
    "harmony": ("<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>", ""),
    "kimi_k2": ("<|tool_calls_section_begin|><|tool_call_begin|>functions.{name}:{index}<|tool_call_argument_begin|>",
                "<|tool_call_end|><|tool_calls_section_end|>"),
}
# Formats whose call names the tool, then writes each argument between tags (as mlx-lm's parsers read them):
# (call opening, argument opening, argument closing, call closing).
TAGGED = {
    "qwen3_coder": ("<tool_call>\n<function={name}>\n", "<parameter={key}>\n", "\n</parameter>\n",
                    "</function>\n</tool_call>"),
    "glm47": ("<tool_call>{name}", "<arg_key>{key}</arg_key><arg_value>", "</arg_value>", "</tool_call>"),
    "minimax_m2": ('<minimax:tool_call>\n<invoke name="{name}">\n', '<parameter name="{key}">', "</parameter>\n",
                   "</invoke>\n</minimax:tool_call>"),
}
# Formats whose call is one JSON object naming the tool, between fixed markers.
AROUND = {"hermes": ("<tool_call>\n", "\n</tool_call>"), "mistral": ("[TOOL_CALLS]", ""), "llama3": ("", "")}
# The text that opens every call of a format, as its parser looks for it, where the format has one: text
# before it is the model's prose. (Llama 3's calls are bare JSON; Harmony's answer is all channels.)
OPENING = {"hermes": "<tool_call>", "qwen3_coder": "<tool_call>", "glm47": "<tool_call>",
           "minimax_m2": "<minimax:tool_call>", "kimi_k2": "<|tool_calls_section_begin|>", "mistral": "[TOOL_CALLS]"}
# Mistral's one opening precedes a list of calls, which its grammar holds to one.
ONE_OPENING = {"mistral"}
# mlx-lm's parser names (gateway/tool_formats.py) for the formats above.
FAMILY_OF_PARSER = {"json_tools": "hermes", "mistral": "mistral", **{name: name for name in [*JSON_BODY, *TAGGED]}}


def _raw_text(pattern: str, close: str, tokens: Mapping[str, int], lazy: dict[tuple[str, str], str]) -> str:
    """Text matching `pattern`, then `close`: the text may hold anything but the
    closing tag itself (HTML, `a < b` in a file's contents). A tag that starts
    with an added token ends the text by itself (no text holds the token); one
    of plain text ends a lazy rule of `lazy` (its name, by pattern and the
    tag's text up to any added token)."""
    (first, token), *rest = _pieces(close, tokens)
    if token is not None:
        return f"/{pattern}/ {_text(close, tokens)}"
    name = lazy.setdefault((pattern, first), f"text{len(lazy)}")
    return " ".join([name, *([_lark(rest)] if rest else [])])


def _lazy_rules(lazy: dict[tuple[str, str], str]) -> str:
    """The lazy text rules, each ending at its tag's text (llguidance's `suffix`:
    the text may not hold it, and the tag is matched as any text is, in whatever
    tokens the model writes it)."""
    return "".join(f"{name}[suffix={json.dumps(end)}]: /{pattern}/\n" for (pattern, end), name in lazy.items())


def _tagged_value(schema: dict | bool, close: str, tokens: Mapping[str, int], definitions: dict,
                  lazy: dict[tuple[str, str], str]) -> str:
    """One argument's value and its closing tag. Text is written raw (_raw_text),
    or one of its enum values. A schema of `true` (JSON Schema's "anything") is
    text; one that refers to a definition or combines schemas is JSON, with the
    definitions beside it."""
    if not isinstance(schema, dict):
        schema = {}
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        # Each value as the parser reads it back: a string raw, anything else as its JSON text.
        values = [value if isinstance(value, str) else json.dumps(value) for value in schema["enum"]]
        return "(" + " | ".join(json.dumps(value) for value in values) + ") " + _text(close, tokens)
    if raw_text_value(schema):
        low, high = schema.get("minLength"), schema.get("maxLength")
        low = low if isinstance(low, int) and low > 0 else 0
        high = high if isinstance(high, int) and high >= low else None
        if low or high is not None:  # held to the schema's length, the tag's own newline after it
            return _raw_text(f"(?s:.{{{low},{'' if high is None else high}}})", close, tokens, lazy)
        return _raw_text("(?s:.*)", close.lstrip("\n"), tokens, lazy)  # the newline before the tag is the value's
    return f"{_arguments({**schema, **definitions})} {_text(close, tokens)}"


def _tagged_call(tool: dict, family: str, tokens: Mapping[str, int], lazy: dict[tuple[str, str], str],
                 opened: str) -> str:
    """A call with each required argument, and each optional one or not, in the schema's order."""
    call_open, arg_open, arg_close, call_close = TAGGED[family]
    function = tool["function"]
    schema = function.get("parameters") or {}
    reference = schema.get("$ref")
    if isinstance(reference, str) and reference.startswith(DEFINITION_REFS):
        # The whole of the parameters a definition (Zod's named schemas): its arguments are the definition's.
        kind, _, name = reference[2:].partition("/")
        named = _definitions(schema).get(kind, {}).get(name)
        schema = {**named, **_definitions(schema)} if isinstance(named, dict) else schema
    # Read leniently, as the JSON formats' grammars read a schema: what is not a list or an object is none.
    required, properties = schema.get("required"), schema.get("properties")
    required = required if isinstance(required, list) else []
    properties = properties if isinstance(properties, dict) else {}
    arguments = []
    for key, value in properties.items():
        value_rule = _tagged_value(value, arg_close, tokens, _definitions(schema), lazy)
        argument = f"{_text(arg_open.format(key=key), tokens)} {value_rule}"
        arguments.append(argument if key in required else f"({argument})?")
    return " ".join([_after(call_open.format(name=function["name"]), opened, tokens), *arguments,
                     _text(call_close, tokens)])


def _after(text: str, opened: str, tokens: Mapping[str, int]) -> str:
    """Fixed text that begins a call, less the opening already written before it."""
    assert text.startswith(opened)
    return _text(text[len(opened):], tokens)


def _call_rule(tool: dict, family: str, tokens: Mapping[str, int], lazy: dict[tuple[str, str], str],
               opened: str = "") -> str:
    """The lark rule for one call of `tool` in `family`'s format; `opened`: the
    call's opening (OPENING), where the text before it has written it."""
    name, parameters = tool["function"]["name"], tool["function"].get("parameters")
    if family in TAGGED:
        return _tagged_call(tool, family, tokens, lazy, opened)
    if family in JSON_BODY:
        header, end = JSON_BODY[family]
        before, numbered, after = header.format(name=name, index="\0").partition("\0")
        header_rule = " ".join(part for part in (_after(before, opened, tokens), "/[0-9]+/" if numbered else "",
                                                 _text(after, tokens)) if part)
        return f"{header_rule} {_arguments(parameters)} {_text(end, tokens)}"
    schema = _call_schema(tool, "parameters" if family == "llama3" else "arguments",
                          "#/items" if family == "mistral" else "#")
    if family == "mistral":
        inner = {k: v for k, v in schema.items() if k not in DEFINITIONS}
        schema = {"type": "array", "items": inner, "minItems": 1, "maxItems": 1, **_definitions(schema)}
    before, after = AROUND[family]
    return f"{_after(before, opened, tokens)} {_arguments(schema)} {_text(after, tokens)}"


@dataclass(frozen=True)
class Thinking:
    """A model's reasoning block (its markers), which its constrained answer
    may follow: a grammar from the first token would take its thinking away."""

    open: str
    close: str
    opened: bool  # the prompt opened the block: the output starts inside it


def answer_grammar(tools: list[dict], family: str, tokens: Mapping[str, int] | None = None,
                   param: str = "tool_choice", answer_schema: dict | None = None,
                   answer_param: str = "response_format", strict: bool = False,
                   thinking: Thinking | None = None, prose: bool = False, several: bool = False) -> str:
    """Output that is exactly one call of one of `tools`, in the model's own
    tool-call format (one of FAMILY_OF_PARSER's values); `tokens`: the model's
    added tokens, by text. With `answer_schema` (a JSON response_format, beside
    tools the model may call or alone), that JSON answer instead of a call is
    allowed too (`answer_param`: the body's name for it, for errors). With
    `prose` (a format of OPENING's), text instead, or text and then the call;
    with `several` besides, more calls after it (where the format's opening
    comes once a call). With `thinking`, a reasoning block first (optional
    unless the prompt opened it), then whitespace."""
    _bounded(tools, "tools")
    tokens = tokens or {}
    lazy: dict[tuple[str, str], str] = {}  # the tagged formats' text values, the reasoning, the prose
    rules = {f"choice{i}": _call_rule(tool, family, tokens, lazy) for i, tool in enumerate(tools)}
    if answer_schema is not None:
        _bounded(answer_schema, answer_param)
        rules["choice_json"] = f"%json {json.dumps(_compact(answer_schema, strict))}"
    answer = " | ".join(rules)
    prose_token, more = "", ""
    if prose:
        opening = OPENING[family]
        rules |= {f"opened{i}": _call_rule(tool, family, tokens, lazy, opening) for i, tool in enumerate(tools)}
        opened = " | ".join(f"opened{i}" for i in range(len(tools)))
        more = " (SPACE? call)*" if several and family not in ONE_OPENING else ""
        answer = f"PROSE | {_prose_then(opening, tokens, lazy)} ({opened}){more}"
        rules["call"] = " | ".join(f"choice{i}" for i in range(len(tools)))
        # Text that holds no opening, in whatever tokens the model writes it: a call is never read
        # from text the grammar did not hold.
        prose_token = f"PROSE: /(?s:.*)/ & ~/(?s:.*){re.escape(opening)}(?s:.*)/\n"
    start = "answer"
    if thinking is not None:
        thought = _raw_text("(?s:.*)", thinking.close, tokens, lazy)
        block = thought if thinking.opened else f"({_text(thinking.open, tokens)} {thought})?"
        start = f"{block} SPACE? answer"
    lark = (f"start: {start}\nanswer: {answer}\n" + "".join(f"{name}: {rule}\n" for name, rule in rules.items())
            + _lazy_rules(lazy) + prose_token + ("SPACE: /[ \\t\\r\\n]+/\n" if thinking or more else ""))
    try:
        return _validated(llguidance.LLMatcher.grammar_from_lark(lark), param)
    except APIError:
        if answer_schema is not None:  # the answer's own 400 where it is the cause, naming its parameter
            json_schema_grammar(answer_schema, answer_param, strict=strict)
        raise


def _prose_then(opening: str, tokens: Mapping[str, int], lazy: dict[tuple[str, str], str]) -> str:
    """The model's text up to a call, and the call's opening."""
    if _pieces(opening, tokens)[0][1] is not None:  # an added token: no text holds it
        return f"PROSE {_text(opening, tokens)}"
    return _raw_text("(?s:.*)", opening, tokens, lazy)
