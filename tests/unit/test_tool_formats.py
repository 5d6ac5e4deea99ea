import json
import subprocess
import sys

import pytest

from gateway.parsing import ToolCallParser
from gateway.tool_formats import load_tool_format

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]

# One call in each format mlx-lm ships a parser for, as its models write it.
CALLS = {
    "json_tools": '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>',
    "qwen3_coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
                   "</tool_call>",
    "glm47": "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>",
    "minimax_m2": '<minimax:tool_call><invoke name="get_weather"><parameter name="city">Paris</parameter>'
                  "</invoke></minimax:tool_call>",
    "kimi_k2": '<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>'
               '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>',
    "pythonic": '<|tool_call_start|>[get_weather(city="Paris")]<|tool_call_end|>',
    "function_gemma": "<start_function_call>call:get_weather{city:<escape>Paris<escape>}<end_function_call>",
    "gemma4": '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>',
    "mistral": '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}',
}


def streamed(parser: ToolCallParser, text: str, piece: int) -> tuple[str, list]:
    """Feed `text` in pieces of `piece` characters, as tokens arrive."""
    content, calls = "", []
    pieces = [text[i:i + piece] for i in range(0, len(text), piece)]
    for i, chunk in enumerate(pieces):
        out, found = parser.feed(chunk, final=i == len(pieces) - 1)
        content += out
        calls += found
    return content, calls


@pytest.mark.parametrize("name", sorted(CALLS))
@pytest.mark.parametrize("piece", [1, 3, 1000])
def test_every_format_parses_as_it_streams(name, piece):
    fmt = load_tool_format(name)
    assert fmt is not None
    content, calls = streamed(ToolCallParser(name, TOOLS, fmt), "Let me check. " + CALLS[name], piece)
    assert content.strip() == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]


@pytest.mark.parametrize("name", ["qwen3_coder", "minimax_m2"])
def test_a_call_that_does_not_parse_stays_text(name):
    fmt = load_tool_format(name)
    broken = fmt.start + "not a call at all" + fmt.end
    content, calls = streamed(ToolCallParser(name, TOOLS, fmt), broken, 4)
    assert calls == [] and content == broken


def test_text_without_a_call_streams_through():
    fmt = load_tool_format("qwen3_coder")
    parser = ToolCallParser("qwen3_coder", TOOLS, fmt)
    assert parser.feed("Paris is ", final=False) == ("Paris is ", [])
    assert parser.feed("lovely.", final=True) == ("lovely.", [])


def test_unknown_names_load_nothing():
    assert load_tool_format("") is None and load_tool_format("no_such_parser") is None
    assert load_tool_format("../etc") is None


def test_loading_a_parser_does_not_import_mlx():
    code = ("import sys; from gateway.tool_formats import load_tool_format; "
            "assert load_tool_format('glm47') is not None; "
            "assert not any(m == 'mlx' or m.startswith(('mlx.', 'mlx_lm')) for m in sys.modules), sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("name, value", [("glm47", "{1, 2}"), ("glm47", "b'x'"), ("qwen3_coder", "{1, 2}")])
def test_a_value_the_parser_reads_as_python_but_not_json_leaves_the_call_as_text(name, value):
    """qwen3_coder's and glm47's parsers read a value that is no string with ast.literal_eval: a set
    or bytes is no JSON (it was a 500 for the whole request)."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "array"}}}}}]
    call = CALLS[name].replace("Paris", value)
    content, calls = streamed(ToolCallParser(name, tools, load_tool_format(name)), call, 5)
    assert calls == [] and content == call
