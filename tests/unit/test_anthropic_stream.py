"""The Anthropic stream's events for a message's deltas (gateway.anthropic_api.MessageOutput)."""

import json

from gateway.anthropic_api import MessageOutput
from gateway.output_processor import KEEPALIVE, Delta
from gateway.parsing import ToolCall


def events(*deltas: Delta) -> list[dict]:
    out = MessageOutput("tiny", 100)
    raw = b"".join(piece for delta in deltas for piece in out.delta(delta))
    return [json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: ")]


def text_of(stream: list[dict]) -> str:
    return "".join(e["delta"]["text"] for e in stream if e["type"] == "content_block_delta"
                   and e["delta"]["type"] == "text_delta")


def test_leading_whitespace_opens_no_block_of_its_own_and_is_not_lost():
    """An answer that starts with indentation: no text block of whitespace
    alone, and the indentation reaches the client in front of the text."""
    stream = events(Delta("    "), Delta("return x", finish_reason="stop"))
    assert text_of(stream) == "    return x"
    assert sum(e["type"] == "content_block_start" for e in stream) == 1


def test_whitespace_between_a_call_and_nothing_else_is_dropped():
    stream = events(Delta("", tool_calls=[ToolCall("f", '{"a": 1}')]), Delta("\n\n", finish_reason="tool_calls"))
    assert text_of(stream) == "" and [e["content_block"]["type"] for e in stream
                                      if e["type"] == "content_block_start"] == ["tool_use"]


def test_tool_arguments_that_are_not_an_object_stream_as_an_empty_one():
    """Clients parse the input_json pieces of a block, put together, as the
    tool's input object; the message whole says {} for such arguments."""
    for arguments, expected in (('"oops"', {}), ("[1, 2]", {}), ('{"a": 1}', {"a": 1})):
        stream = events(Delta("", tool_calls=[ToolCall("f", arguments)], finish_reason="tool_calls"))
        pieces = "".join(e["delta"]["partial_json"] for e in stream if e["type"] == "content_block_delta")
        assert json.loads(pieces) == expected


def test_a_keepalive_is_a_ping_wherever_it_comes():
    out = MessageOutput("tiny", 100)
    first = out.delta(Delta("Hello"))
    ping = out.delta(KEEPALIVE)
    assert ping == [b'event: ping\ndata: {"type":"ping"}\n\n'] and out.delta(Delta(" there"))[0].startswith(
        b"event: content_block_delta")
    assert first[0].startswith(b"event: content_block_start")
