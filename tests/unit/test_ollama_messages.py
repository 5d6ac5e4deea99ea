"""Ollama's messages as chat templates take them: a tool result carries the
id of the call it answers (templates that pair them by id need one), though
Ollama's messages carry no ids."""

from gateway.ollama_api import chat_input
from gateway.ollama_schema import Message, ToolCall, ToolCallFunction


def call(name: str, **arguments) -> ToolCall:
    return ToolCall(ToolCallFunction(name, arguments))


def test_tool_results_get_the_ids_of_the_calls_they_answer():
    messages = [
        Message("user", "Weather in Paris and Rome, and the time?"),
        Message("assistant", tool_calls=[call("get_weather", city="Paris"), call("get_time"),
                                         call("get_weather", city="Rome")]),
        Message("tool", "12:00", tool_name="get_time"),
        Message("tool", "sunny"),  # no tool_name: the next call not answered yet
        Message("tool", "rainy", tool_name="get_weather"),
        Message("assistant", "Sunny in Paris, rainy in Rome; noon."),
    ]
    rendered = chat_input(messages, None).messages
    ids = [c["id"] for c in rendered[1]["tool_calls"]]
    assert len(set(ids)) == 3 and all(len(i) == 9 and i.isalnum() for i in ids)  # as Mistral's templates demand
    assert [m.get("tool_call_id") for m in rendered[2:5]] == [ids[1], ids[0], ids[2]]
    assert "tool_call_id" not in rendered[5]


def test_the_ids_a_client_sends_back_pair_a_result_with_its_call():
    """Ollama's answers carry each call's id now, and a tool result may name it (`tool_call_id`)."""
    messages = [
        Message("user", "Weather in Paris and Rome?"),
        Message("assistant", tool_calls=[ToolCall(ToolCallFunction("get_weather", {"city": "Paris"}), "call_p"),
                                         ToolCall(ToolCallFunction("get_weather", {"city": "Rome"}), "call_r")]),
        Message("tool", "rainy", tool_name="get_weather", tool_call_id="call_r"),
        Message("tool", "sunny", tool_name="get_weather", tool_call_id="call_p"),
    ]
    rendered = chat_input(messages, None).messages
    assert [c["id"] for c in rendered[1]["tool_calls"]] == ["call_p", "call_r"]
    assert [m["tool_call_id"] for m in rendered[2:4]] == ["call_r", "call_p"]
    # An id that names no call (a client's own): paired by the tool's name and order, as without one.
    messages[2:4] = [Message("tool", "sunny", tool_name="get_weather", tool_call_id="mine-1"),
                     Message("tool", "rainy", tool_name="get_weather", tool_call_id="mine-2")]
    assert [m["tool_call_id"] for m in chat_input(messages, None).messages[2:4]] == ["call_p", "call_r"]
