"""Chat and completion requests as clients send them, read into a Plan."""

import json

import pytest

from gateway.errors import APIError, decode_body
from gateway.openai_api import chat_plan, completion_plan
from gateway.openai_schema import ChatCompletionRequest, CompletionRequest

ASK = {"role": "user", "content": "Weather in Paris?"}


def chat(**body):
    return chat_plan(decode_body(json.dumps({"model": "m", "messages": [ASK], **body}).encode(),
                                 ChatCompletionRequest))


def test_a_message_keeps_what_clients_carry_along_without_a_400():
    """The SDK's stream helpers return calls with `index` and `parsed_arguments`
    (sent back as they are), Open WebUI keeps each streamed call's `index`,
    OpenCode puts `cache_control` on messages and parts."""
    call = {"id": "call_1", "type": "function", "index": 0,
            "function": {"name": "weather", "arguments": '{"city": "Paris"}', "parsed_arguments": None}}
    plan = chat(messages=[ASK, {"role": "assistant", "content": None, "tool_calls": [call], "parsed": None},
                          {"role": "tool", "tool_call_id": "call_1", "content": [
                              {"type": "text", "text": "18C", "cache_control": {"type": "ephemeral"}}]}],
                stream=True, stream_options={"include_usage": True, "include_obfuscation": False})
    assert plan.prompt.messages[1]["tool_calls"][0]["function"] == {"name": "weather", "arguments": {"city": "Paris"}}
    assert plan.prompt.messages[2]["content"] == [{"type": "text", "text": "18C"}]
    with pytest.raises(APIError) as e:  # a parameter of the request itself is still named
        chat(temperature_schedule="low")
    assert e.value.status == 400 and e.value.param == "temperature_schedule"


def test_openais_service_hints_are_taken_and_not_used():
    """Clients send them when asked to (Vercel's AI SDK: textVerbosity; LangChain: store, metadata)."""
    plan = chat(verbosity="low", store=False, metadata={"run": "1"}, prompt_cache_retention="24h",
                service_tier="auto")
    assert plan.prompt.messages == [{"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]}]


@pytest.mark.parametrize(("effort", "kwargs"), [
    ("low", {"reasoning_effort": "low", "enable_thinking": False}),
    ("xhigh", {"reasoning_effort": "high", "enable_thinking": True}),
])
def test_reasoning_effort_reaches_the_template(effort, kwargs):
    assert chat(reasoning_effort=effort).prompt.template_kwargs == kwargs
    both = chat(reasoning_effort=effort, chat_template_kwargs={"enable_thinking": True, "x": 1})
    assert both.prompt.template_kwargs == {**kwargs, "enable_thinking": True, "x": 1}


def test_the_deprecated_function_result_answers_its_call():
    plan = chat(messages=[ASK, {"role": "assistant", "content": None,
                                "function_call": {"name": "weather", "arguments": "{}"}},
                          {"role": "function", "name": "weather", "content": "18C"}])
    call, result = plan.prompt.messages[1], plan.prompt.messages[2]
    assert result["role"] == "tool" and result["tool_call_id"] == call["tool_calls"][0]["id"]


def test_tools_reach_the_template_without_null_fields():
    plan = chat(tools=[{"type": "function", "function": {"name": "weather"}}])
    assert plan.tools == [{"type": "function", "function": {"name": "weather", "description": "",
                                                            "parameters": {"type": "object"}}}]


def test_no_logprobs_with_zero_alternatives_is_no_logprobs():
    assert chat(logprobs=False, top_logprobs=0).sampling.logprobs is None


def test_a_list_of_one_token_list_is_one_prompt():
    def prompt(value):
        return completion_plan(decode_body(json.dumps({"model": "m", "prompt": value}).encode(),
                                           CompletionRequest)).prompt

    assert prompt([[1, 2, 3]]) == prompt([1, 2, 3]) == [1, 2, 3]
    with pytest.raises(APIError, match="several prompts"):
        prompt([[1, 2], [3]])
