"""An assistant turn's reasoning, sent back by the client, reaches the chat
template as the message's `reasoning_content` in every API: templates that
replay it (Qwen 3's, for the turns after the last user message: an agent's
tool loop) then render the prompt the model's own tokens made."""

import msgspec

from gateway import anthropic_api, openai_api
from gateway.anthropic_schema import MessagesRequest
from gateway.openai_responses import conversation
from gateway.openai_responses_schema import FunctionCallItem, MessageItem, ReasoningItemIn
from gateway.openai_schema import ChatCompletionRequest
from tests.unit.test_prefill import tokenizer

CALL = {"id": "call_1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}
REPLAYING = ("{% for m in messages %}<{{ m.role }}>{% if m.reasoning_content %}<think>{{ m.reasoning_content }}"
             "</think>{% endif %}{{ m.content }}{% endfor %}")


def assistant_of(messages: list[dict]) -> dict:
    return next(m for m in messages if m["role"] == "assistant")


def test_chat_completions():
    body = msgspec.convert({"model": "m", "messages": [
        {"role": "user", "content": "list files"},
        {"role": "assistant", "content": None, "reasoning_content": "I should call ls", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "a.txt"}]}, ChatCompletionRequest)
    assert assistant_of(openai_api.chat_input(body).messages)["reasoning_content"] == "I should call ls"


def test_anthropic_thinking_blocks():
    body = msgspec.convert({"model": "m", "max_tokens": 8, "messages": [
        {"role": "user", "content": "list files"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "I should call ls", "signature": "s"},
                                          {"type": "tool_use", "id": "toolu_1", "name": "ls", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "a.txt"}]}]},
        MessagesRequest)
    assert assistant_of(anthropic_api.chat_input(body).messages)["reasoning_content"] == "I should call ls"


def test_responses_reasoning_items(tiny_model):
    messages, _ = conversation([
        MessageItem("user", "list files"),
        ReasoningItemIn("reasoning", [{"type": "summary_text", "text": "I should call ls"}]),
        FunctionCallItem("function_call", "call_1", "ls", "{}"),
        MessageItem("user", "thanks"),
    ])
    assert assistant_of(messages)["reasoning_content"] == "I should call ls"
    assert "reasoning_content" not in messages[-1]
    prompt = tokenizer(tiny_model, REPLAYING).render_chat(messages)
    assert "<assistant><think>I should call ls</think>" in prompt


def test_reasoning_stays_with_its_turn():
    """A turn cut short while reasoning leaves its reasoning before the next user message: not the next
    answer's; reasoning before a call that joins an assistant message goes with that message."""
    messages, _ = conversation([
        MessageItem("user", "q1"), ReasoningItemIn("reasoning", [{"type": "summary_text", "text": "R1"}]),
        MessageItem("user", "q2"), MessageItem("assistant", "a2"),
        ReasoningItemIn("reasoning", [{"type": "summary_text", "text": "R2"}]),
        FunctionCallItem("function_call", "c1", "ls", "{}"),
    ])
    assert "reasoning_content" not in messages[1]
    assert assistant_of(messages)["reasoning_content"] == "R2" and assistant_of(messages)["tool_calls"]
