"""Forced tool calls: the grammar written for each format accepts a call as the
model writes it, refuses one that breaks the schema, and what it accepts is
what the format's parser reads back."""

import json

import llguidance
import pytest
from tokenizers import AddedToken

from gateway.errors import APIError
from gateway.parsing import HarmonyParser, ToolCallParser
from gateway.structured import OPENING, TAGGED, Thinking, answer_grammar, json_schema_grammar
from gateway.tool_formats import load_tool_format
from tests.tiny_model import train_tokenizer

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "required": ["city", "days"],
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "unit": {"enum": ["C", "F"]}}}}}
ARGUMENTS = {"city": "New York", "days": 3}

# family: (mlx-lm's parser name or None for mlxd's own, a call as the model writes it)
CALLS = {
    "hermes": (None, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "New York", "days": 3}}\n</tool_call>'),
    "mistral": (None, '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "New York", "days": 3}}]'),
    "llama3": (None, '{"name": "get_weather", "parameters": {"city": "New York", "days": 3}}'),
    "qwen3_coder": ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
                                   "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"),
    "glm47": ("glm47", "<tool_call>get_weather<arg_key>city</arg_key><arg_value>New York</arg_value>"
                       "<arg_key>days</arg_key><arg_value>3</arg_value></tool_call>"),
    "minimax_m2": ("minimax_m2", '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">New York'
                                 '</parameter>\n<parameter name="days">3</parameter>\n</invoke>\n</minimax:tool_call>'),
    "kimi_k2": ("kimi_k2", "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
                           '<|tool_call_argument_begin|>{"city": "New York", "days": 3}<|tool_call_end|>'
                           "<|tool_calls_section_end|>"),
    "harmony": (None, '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
                      '{"city": "New York", "days": 3}'),
}
# The markers real models have as tokens of their own.
MARKERS = ["<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
           "<minimax:tool_call>", "</minimax:tool_call>", "<|tool_calls_section_begin|>", "<|tool_call_begin|>",
           "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<|tool_calls_section_end|>", "<|channel|>",
           "<|constrain|>", "<|message|>", "<think>", "</think>"]


@pytest.fixture(scope="module")
def tokenizer():
    tok = train_tokenizer()
    tok.add_tokens([AddedToken(marker, normalized=False, special=marker.startswith("<|")) for marker in MARKERS])
    return tok


def accepts(tok, grammar: str, text: str) -> bool:
    matcher = llguidance.LLMatcher(llguidance.LLTokenizer(tok.to_str()), grammar)
    return all(matcher.consume_token(t) for t in tok.encode(text).ids) and matcher.is_accepting()


def parsed(family: str, parser_name: str | None, text: str) -> list[tuple[str, dict]]:
    if family == "harmony":
        _, _, calls = HarmonyParser([TOOL]).feed(text, True)
    else:
        fmt = load_tool_format(parser_name) if parser_name else None
        _, calls = ToolCallParser(family, [TOOL], fmt).feed(text, True)
    return [(call.name, json.loads(call.arguments)) for call in calls]


@pytest.mark.parametrize("family", sorted(CALLS))
def test_the_grammar_accepts_the_call_and_the_parser_reads_it_back(tokenizer, family):
    parser_name, text = CALLS[family]
    tokens = {token.content: token_id for token_id, token in tokenizer.get_added_tokens_decoder().items()}
    grammar = answer_grammar([TOOL], family, tokens)
    assert accepts(tokenizer, grammar, text)
    assert not accepts(tokenizer, grammar, text.replace("3", '"three"', 1))  # days must be an integer
    assert parsed(family, parser_name, text) == [("get_weather", ARGUMENTS)]


@pytest.mark.parametrize("family", ["qwen3_coder", "glm47", "minimax_m2"])
@pytest.mark.parametrize("parameters", [{"properties": {"city": True}}, {"properties": []}, {"required": 5},
                                        {"properties": {"city": {"type": "string"}}, "required": "city"}])
def test_a_tagged_format_reads_an_odd_schema_leniently(tokenizer, family, parameters):
    """Schemas a JSON Schema validator takes (`true` for "anything") or a
    client may send (a list for the properties): a grammar, not a 500."""
    tokens = {token.content: token_id for token_id, token in tokenizer.get_added_tokens_decoder().items()}
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": parameters}}
    assert answer_grammar([tool], family, tokens)


@pytest.mark.parametrize("family", sorted(CALLS))
def test_definitions_a_schema_refers_to_stay_within_reach(tokenizer, family):
    """Pydantic's and MCP's tool schemas keep types in `$defs` and point at them
    with `$ref`; the grammar of a call puts the parameters inside a schema of
    its own, whose root must still hold them (was a 400: "Pointer '/$defs/Days'
    does not exist")."""
    parameters = {**TOOL["function"]["parameters"], "$defs": {"Days": {"type": "integer", "minimum": 1}}}
    parameters["properties"] = {**parameters["properties"], "days": {"$ref": "#/$defs/Days"}}
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": parameters}}
    tokens = {token.content: token_id for token_id, token in tokenizer.get_added_tokens_decoder().items()}
    grammar = answer_grammar([tool], family, tokens)
    _, text = CALLS[family]
    assert accepts(tokenizer, grammar, text)
    assert not accepts(tokenizer, grammar, text.replace("3", '"three"', 1))


@pytest.mark.parametrize("family", ["hermes", "mistral", "llama3"])
def test_references_into_the_parameters_follow_them_into_the_calls_schema(tokenizer, family):
    """Zod points at a type used twice by its place ("#/properties/city") and
    at the whole for a recursive one ("#"): moved inside the call's schema,
    the first was a 400 ("Pointer ... does not exist"), the second pointed at
    the call itself."""
    parameters = {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string"}, "home": {"$ref": "#/properties/city"},
        "stops": {"type": "array", "items": {"$ref": "#"}}}}
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": parameters}}
    grammar = answer_grammar([tool], family, {t.content: i for i, t in tokenizer.get_added_tokens_decoder().items()})
    _, text = CALLS[family]
    good = '{"city": "Rome", "home": "Oslo", "stops": [{"city": "Bern", "stops": []}]}'
    call = text.replace('{"city": "New York", "days": 3}', good)
    assert accepts(tokenizer, grammar, call)
    assert not accepts(tokenizer, grammar, call.replace('"Oslo"', "5"))
    assert not accepts(tokenizer, grammar, call.replace('{"city": "Bern", "stops": []}',
                                                        '{"name": "get_weather", "arguments": {"city": "Bern"}}'))


@pytest.mark.parametrize("family", ["qwen3_coder", "glm47", "minimax_m2"])
def test_a_tagged_format_takes_parameters_that_are_a_definition(tokenizer, family):
    """Zod's named schemas: the parameters a `$ref` to a definition. The
    grammar read no arguments from it, and a forced call could only be empty."""
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "$ref": "#/definitions/Weather", "definitions": {"Weather": TOOL["function"]["parameters"]}}}}
    grammar = answer_grammar([tool], family, {t.content: i for i, t in tokenizer.get_added_tokens_decoder().items()})
    _, text = CALLS[family]
    assert accepts(tokenizer, grammar, text)
    empty = {"qwen3_coder": "<tool_call>\n<function=get_weather>\n</function>\n</tool_call>",
             "glm47": "<tool_call>get_weather</tool_call>",
             "minimax_m2": '<minimax:tool_call>\n<invoke name="get_weather">\n</invoke>\n</minimax:tool_call>'}
    assert not accepts(tokenizer, grammar, empty[family])


@pytest.mark.parametrize("strict", [False, True])
def test_string_formats_llguidance_does_not_know_are_annotations(tokenizer, strict):
    """Pydantic writes `password`, `binary`, `path`; OpenAPI `byte`: llguidance refused the whole
    schema (a 400). Known formats still hold, the rest of the schema too, and data is left alone."""
    schema = {"type": "object", "additionalProperties": False, "required": ["secret", "when"], "properties": {
        "secret": {"type": "string", "format": "password", "maxLength": 3},
        "blob": {"type": "string", "format": "binary"},
        "when": {"type": "string", "format": "date"},
        "kind": {"const": {"format": "binary"}},
        "default": {"type": "string", "format": "password"},  # a property named as a keyword
        "format": {"type": "string", "format": "byte"},
    }}
    grammar = json_schema_grammar(schema, strict=strict)
    assert accepts(tokenizer, grammar, '{"secret": "abc", "when": "2026-11-26"}')
    assert not accepts(tokenizer, grammar, '{"secret": "abcd", "when": "2026-11-26"}')  # maxLength holds
    assert not accepts(tokenizer, grammar, '{"secret": "abc", "when": "soon"}')  # a known format holds
    assert accepts(tokenizer, grammar, '{"secret": "abc", "when": "2026-11-26", "kind": {"format": "binary"}}')
    tool = {"type": "function", "function": {"name": "login", "parameters": schema}}
    assert answer_grammar([tool], "hermes")


def test_a_pattern_llguidance_cannot_hold_is_left_unenforced_unless_strict(tokenizer):
    """A password rule's look-ahead: a 400 for the whole schema, where a
    schema that is not strict leaves what the grammar cannot hold unenforced;
    the patterns it can hold still hold. Strict: a 400, as OpenAI refuses."""
    schema = {"type": "object", "required": ["secret", "code"], "additionalProperties": False, "properties": {
        "secret": {"type": "string", "pattern": "^(?=.*[A-Z]).{8,}$"},
        "code": {"type": "string", "pattern": "^[A-Z]{3}$"}}}
    grammar = json_schema_grammar(schema)
    assert accepts(tokenizer, grammar, '{"secret": "lowercase", "code": "ABC"}')
    assert not accepts(tokenizer, grammar, '{"secret": "lowercase", "code": "abc"}')
    with pytest.raises(APIError, match="look-around"):
        json_schema_grammar(schema, strict=True)


@pytest.mark.parametrize("family", ["qwen3_coder", "glm47", "minimax_m2"])
@pytest.mark.parametrize("value, good, bad", [
    ({"enum": [1, 2, 3]}, "2", "banana"),
    ({"enum": ["a", None]}, "a", "banana"),
    ({"type": "string", "maxLength": 3}, "abc", "banana"),
    ({"type": "string", "minLength": 2, "maxLength": 4}, "abcd", "a"),
])
def test_a_tagged_format_holds_an_argument_to_its_enum_and_length(tokenizer, family, value, good, bad):
    """Written raw between tags, a value was free text unless its enum was all strings."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"v": value}, "required": ["v"]}}}
    tokens = {token.content: token_id for token_id, token in tokenizer.get_added_tokens_decoder().items()}
    grammar = answer_grammar([tool], family, tokens)
    call_open, arg_open, arg_close, call_close = TAGGED[family]

    def call(text: str) -> str:
        return call_open.format(name="f") + arg_open.format(key="v") + text + arg_close + call_close

    assert accepts(tokenizer, grammar, call(good)) and not accepts(tokenizer, grammar, call(bad))
    # What the grammar let through reads back as the schema has it: 2, not "2".
    _, calls = ToolCallParser(family, [tool], load_tool_format(family)).feed(call(good), True)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"v": json.loads(good) if good == "2" else good})]


@pytest.mark.parametrize("family", ["qwen3_coder", "glm47", "minimax_m2"])
def test_a_tagged_formats_json_values_read_back_as_json(tokenizer, family):
    """Pydantic's Optional[...] (anyOf with null), a $ref to a definition, a const, a type list: the grammar has
    the model write them as JSON, and Qwen3-Coder's and MiniMax's parsers gave that JSON back as a string
    ("5", "\"hello\""), in forced calls and free ones alike."""
    parameters = {"type": "object", "$defs": {"Color": {"enum": ["red", "blue"]}}, "properties": {
        "q": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        "n": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
        "c": {"$ref": "#/$defs/Color"},
        "k": {"const": 7},
        "t": {"type": ["string", "null"]},
        "plain": {"type": "string"}}, "required": ["q", "n", "c", "k", "t", "plain"]}
    tool = {"type": "function", "function": {"name": "f", "parameters": parameters}}
    arguments = {"q": "hello", "n": 5, "c": "red", "k": 7, "t": None, "plain": "5"}
    call_open, arg_open, arg_close, call_close = TAGGED[family]
    text = call_open.format(name="f") + "".join(
        arg_open.format(key=key) + (value if key == "plain" else json.dumps(value)) + arg_close
        for key, value in arguments.items()) + call_close
    tokens = {token.content: token_id for token_id, token in tokenizer.get_added_tokens_decoder().items()}
    assert accepts(tokenizer, answer_grammar([tool], family, tokens), text)
    _, calls = ToolCallParser(family, [tool], load_tool_format(family)).feed(text, True)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("f", arguments)]


def test_a_schemas_own_guidance_that_is_no_object_is_ignored(tokenizer):
    """It was merged into mlxd's settings as a mapping: a 500 for a string."""
    parameters = {**TOOL["function"]["parameters"], "x-guidance": "whatever"}
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": parameters}}
    tokens = {token.content: token_id for token_id, token in tokenizer.get_added_tokens_decoder().items()}
    assert accepts(tokenizer, answer_grammar([tool], "hermes", tokens), CALLS["hermes"][1])
    assert accepts(tokenizer, json_schema_grammar(parameters), json.dumps(ARGUMENTS))


@pytest.mark.parametrize("family", sorted(set(CALLS) - {"llama3"}))
def test_beside_a_json_answer_a_call_is_allowed_too(tokenizer, family):
    tokens = {token.content: token_id for token_id, token in tokenizer.get_added_tokens_decoder().items()}
    answer = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
    grammar = answer_grammar([TOOL], family, tokens, answer_schema=answer)
    assert accepts(tokenizer, grammar, CALLS[family][1])
    assert accepts(tokenizer, grammar, '{"answer": "sunny"}')
    assert not accepts(tokenizer, grammar, '{"city": "sunny"}')
    assert not accepts(tokenizer, grammar, "It is sunny.")


@pytest.mark.parametrize("family, markers", [(family, markers) for family in sorted(OPENING)
                                             for markers in ("added", "plain") if family != "kimi_k2" or markers == "added"])
def test_strict_tools_leave_the_model_its_text_and_hold_its_calls(tokenizer, family, markers):
    """Strict tools with tool_choice auto: text, or text and then calls that
    follow their schemas; never text the parser would read as a call the
    grammar did not hold, nor text after the calls (the call's opening as the
    model's own token, or written as text by a tokenizer that has none)."""
    tok = tokenizer if markers == "added" else train_tokenizer()  # Kimi's markers are always special tokens
    tokens = {token.content: token_id for token_id, token in tok.get_added_tokens_decoder().items()}
    several, one = (answer_grammar([TOOL], family, tokens, prose=True, several=several) for several in (True, False))
    parser_name, call = CALLS[family]
    for text in ["", "It is sunny.", "a < b", call, "Let me check. " + call]:
        assert accepts(tok, several, text) and accepts(tok, one, text)
    assert parsed(family, parser_name, "Let me check. " + call) == [("get_weather", ARGUMENTS)]
    for text in [call.replace("3", '"three"', 1), "Let me check. " + call.replace("3", '"three"', 1),
                 call + " Done.", f"It is {OPENING[family]} sunny."]:
        assert not accepts(tok, several, text)
    assert not accepts(tok, one, call + "\n" + call)
    if family != "mistral":  # its one opening starts a list of calls
        assert accepts(tok, several, call + "\n" + call)
        assert parsed(family, parser_name, call + "\n" + call) == [("get_weather", ARGUMENTS)] * 2


@pytest.mark.parametrize("family", ["qwen3_coder", "glm47", "minimax_m2"])
def test_a_tagged_formats_text_argument_may_hold_what_its_tag_starts_with(tokenizer, family):
    """HTML, generics, `a < b` in a file's contents: values were text up to the first `<`."""
    tokens = {token.content: token_id for token_id, token in tokenizer.get_added_tokens_decoder().items()}
    grammar = answer_grammar([TOOL], family, tokens)
    parser_name, text = CALLS[family]
    odd = "<p>a < b</p>\n<parameter"
    assert accepts(tokenizer, grammar, text.replace("New York", odd))
    assert parsed(family, parser_name, text.replace("New York", odd)) == [("get_weather", {**ARGUMENTS, "city": odd})]


def test_a_json_answer_beside_calls_is_refused_as_it_is_alone():
    """Its 400 names response_format, not the tools (was tool_choice, quoting the grammar)."""
    answer = {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}
    with pytest.raises(APIError) as alone:
        json_schema_grammar(answer, strict=True)
    with pytest.raises(APIError) as beside:
        answer_grammar([TOOL], "hermes", answer_schema=answer, strict=True)
    assert (beside.value.param, beside.value.message) == (alone.value.param, alone.value.message) == (
        "response_format", alone.value.message)


@pytest.mark.parametrize("opened", [False, True])
def test_a_constrained_answer_may_follow_the_models_reasoning(tokenizer, opened):
    """The grammar held the output from its first token: a reasoning model did not think before its JSON or
    its forced call (and where the template opened the block, wrote them inside it)."""
    tokens = {token.content: token_id for token_id, token in tokenizer.get_added_tokens_decoder().items()}
    thinking = Thinking("<think>", "</think>", opened)
    answer = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
    json_only = answer_grammar([], "", tokens, answer_schema=answer, thinking=thinking)
    call_only = answer_grammar([TOOL], "hermes", tokens, thinking=thinking)
    thought = ("" if opened else "<think>") + "The user asks {about} a < b.\n</think>\n\n"
    assert accepts(tokenizer, json_only, thought + '{"answer": "sunny"}')
    assert accepts(tokenizer, call_only, thought + CALLS["hermes"][1])
    assert not accepts(tokenizer, json_only, thought + "It is sunny.")
    assert accepts(tokenizer, json_only, '{"answer": "sunny"}') is not opened  # inside the block, it must close


def test_kimis_forced_call_is_numbered_by_the_model(tokenizer):
    """The number in `functions.NAME:N` is the call's id: always 0, the calls of every turn had one id."""
    tokens = {token.content: token_id for token_id, token in tokenizer.get_added_tokens_decoder().items()}
    grammar = answer_grammar([TOOL], "kimi_k2", tokens)
    _, text = CALLS["kimi_k2"]
    assert accepts(tokenizer, grammar, text.replace("get_weather:0", "get_weather:7"))
    assert not accepts(tokenizer, grammar, text.replace("get_weather:0", "get_weather:x"))
