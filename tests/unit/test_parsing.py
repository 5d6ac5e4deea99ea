import json

import pytest

from gateway.parsing import (
    ReasoningSplitter,
    ToolCallParser,
    detect_reasoning,
    detect_tool_family,
    stream_parsers,
)


def split_all(splitter: ReasoningSplitter, pieces: list[str]) -> tuple[str, str]:
    reasoning, content = "", ""
    for i, piece in enumerate(pieces):
        r, c = splitter.feed(piece, final=i == len(pieces) - 1)
        reasoning, content = reasoning + r, content + c
    return reasoning, content


def parse_all(parser: ToolCallParser, pieces: list[str]):
    content, calls = "", []
    for i, piece in enumerate(pieces):
        c, new = parser.feed(piece, final=i == len(pieces) - 1)
        content += c
        calls += new
    return content, calls


@pytest.mark.parametrize("pieces", [
    ["<think>plan</think>answer"],
    ["<thi", "nk>pl", "an</th", "ink>ans", "wer"],
    ["<think>\nplan</think>\n\nanswer"],
])
def test_reasoning_is_split_off_however_it_arrives(pieces):
    assert split_all(ReasoningSplitter("<think>", "</think>", inside=False), pieces) == ("plan", "answer")


def test_reasoning_opened_by_the_prompt():
    assert split_all(ReasoningSplitter("<think>", "</think>", inside=True), ["plan</think>answer"]) == ("plan", "answer")


def test_text_without_markers_streams_at_once():
    splitter = ReasoningSplitter("<think>", "</think>", inside=False)
    assert splitter.feed("plain text", final=False) == ("", "plain text")


def test_an_unclosed_reasoning_block_ends_as_reasoning():
    assert split_all(ReasoningSplitter("<think>", "</think>", inside=False), ["<think>never", " closed"]) == (
        "never closed", "")


def test_a_held_marker_prefix_that_was_not_one_is_text():
    splitter = ReasoningSplitter("<think>", "</think>", inside=False)
    assert splitter.feed("a <th", final=False) == ("", "a ")
    assert splitter.feed("ree", final=True) == ("", "<three")


def test_hermes_calls_streamed_in_pieces():
    content, calls = parse_all(ToolCallParser("hermes"), [
        "Let me look. <tool", '_call>{"name": "get", "argu', 'ments": {"q": 1}}</tool_call>',
    ])
    assert content == "Let me look. "
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get", {"q": 1})]
    assert calls[0].id.startswith("call_")


def test_hermes_two_calls():
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", "arguments": {}}</tool_call>'
    content, calls = parse_all(ToolCallParser("hermes"), [text])
    assert content == "" and [c.name for c in calls] == ["a", "b"]


def test_hermes_bad_json_stays_text():
    content, calls = parse_all(ToolCallParser("hermes"), ["<tool_call>not json</tool_call>"])
    assert calls == [] and content == "<tool_call>not json</tool_call>"


def test_hermes_unclosed_call_at_the_end_is_parsed_if_it_is_json():
    content, calls = parse_all(ToolCallParser("hermes"), ['<tool_call>{"name": "a", "arguments": {"x": 2}}'])
    assert content == "" and calls[0].name == "a"


def test_mistral_calls():
    content, calls = parse_all(ToolCallParser("mistral"), ['[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}]'])
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"a": 1})]


def test_llama3_whole_message_call_with_parameters():
    content, calls = parse_all(ToolCallParser("llama3"), ['{"name": "f", ', '"parameters": {"a": 1}}'])
    assert content == "" and json.loads(calls[0].arguments) == {"a": 1}


def test_llama3_python_tag_and_several_calls():
    text = '<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "parameters": {}}'
    assert [c.name for c in parse_all(ToolCallParser("llama3"), [text])[1]] == ["f", "g"]


def test_llama3_plain_text_is_text():
    assert parse_all(ToolCallParser("llama3"), ["Hello ", "there"]) == ("Hello there", [])


def test_llama3_json_that_is_not_a_call_stays_text():
    assert parse_all(ToolCallParser("llama3"), ['{"answer": 42}']) == ('{"answer": 42}', [])


@pytest.mark.parametrize("template, family", [
    ("{{ '[TOOL_CALLS]' }}", "mistral"),
    ("<|python_tag|>{{ x }}", "llama3"),
    ("{% if role == 'ipython' %}", "llama3"),
    ("<tool_call>", "hermes"),
    ("", "hermes"),
])
def test_tool_family_from_the_template(template, family):
    assert detect_tool_family(template) == family


def test_reasoning_markers_from_template_or_vocabulary():
    assert detect_reasoning("<think>", set()) == ("<think>", "</think>")
    assert detect_reasoning("", {"<thinking>"}) == ("<thinking>", "</thinking>")
    assert detect_reasoning("plain", {"hello"}) is None


def test_stream_parsers_make_fresh_parsers_per_stream():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    make = stream_parsers(("<think>", "</think>"), "hermes", "prompt <think>", tools)
    (first, tools_a), (_, tools_b) = make(), make()
    assert first.inside and tools_a is not tools_b
    assert stream_parsers(None, "hermes", "", None)() == (None, None)
