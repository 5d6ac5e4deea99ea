"""The Anthropic stream's events for a message's deltas (gateway.anthropic_api.MessageOutput)."""

import json

from gateway.anthropic_api import MessageOutput, signature_of
from gateway.output_processor import Delta
from gateway.parsing import ToolCall


def events(*deltas: Delta, thinking: str | None = "shown") -> list[dict]:
    out = MessageOutput("tiny", 100, thinking)
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


def test_whitespace_before_a_call_does_not_lead_the_text_after_it():
    """As in the message whole: held whitespace, then a call, then text; the streamed text began "\n\n"."""
    stream = events(Delta("\n\n"), Delta("", tool_calls=[ToolCall("f", '{"a": 1}')]), Delta("after"),
                    Delta("", finish_reason="tool_calls"))
    assert text_of(stream) == "after"


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
    ping = out.keepalive()
    assert ping == [b'event: ping\ndata: {"type":"ping"}\n\n'] and out.delta(Delta(" there"))[0].startswith(
        b"event: content_block_delta")
    assert first[0].startswith(b"event: content_block_start")


def test_thinking_ends_signed_with_its_reasoning_and_omitted_shows_none_of_it():
    deltas = (Delta("", reasoning="Think"), Delta("", reasoning=" more."), Delta("Paris.", finish_reason="stop"))
    for thinking, shown in (("shown", ["Think", " more."]), ("omitted", [])):
        stream = events(*deltas, thinking=thinking)
        block = [e for e in stream if e.get("index") == 0]
        assert block[0]["content_block"] == {"type": "thinking", "thinking": "", "signature": ""}
        thoughts = [e["delta"]["thinking"] for e in block if e.get("delta", {}).get("type") == "thinking_delta"]
        assert thoughts == shown
        assert block[-2]["delta"] == {"type": "signature_delta", "signature": signature_of("Think more.")}
        assert block[-1]["type"] == "content_block_stop" and text_of(stream) == "Paris."
    assert not any(e.get("content_block", {}).get("type") == "thinking" for e in events(*deltas, thinking=None))

