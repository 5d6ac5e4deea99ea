"""Ollama's request fields as Ollama reads them: a role in any case, a
thinking level that turns thinking on, a negative seed that is no seed, a
repeat_penalty of 0 or less that is none, a top_p above 1 that is 1."""

import json

from gateway.ollama_api import chat_input, decode_ollama, sampling, thinking
from gateway.ollama_schema import ChatRequest, Options


def test_a_role_is_read_in_any_case_and_nulls_are_left_out():
    body = decode_ollama(json.dumps({"model": "m", "messages": [{"role": "User", "content": "hi", "images": None}],
                                     "options": {"seed": None}}).encode(), ChatRequest)
    assert [m["role"] for m in chat_input(body.messages, body.think).messages] == ["user"]


def test_a_thinking_level_turns_thinking_on():
    assert thinking("low") == {"reasoning_effort": "low", "enable_thinking": True}
    assert thinking("max") == {"reasoning_effort": "high", "enable_thinking": True}
    assert thinking(False) == {"enable_thinking": False} and thinking(None) is None


def test_a_negative_seed_is_no_seed():
    assert sampling(Options(seed=-1), None)[0].seed is None
    assert sampling(Options(seed=0), None)[0].seed == 0 and sampling(Options(seed=7), None)[0].seed == 7


def test_options_out_of_openais_ranges_are_taken_as_ollama_takes_them():
    body = decode_ollama(json.dumps({"model": "m", "messages": [],
                                     "options": {"repeat_penalty": 0, "top_p": 1.5}}).encode(), ChatRequest)
    params = sampling(body.options, None)[0]
    assert (params.repetition_penalty, params.top_p) == (1.0, 1.0)
    assert sampling(Options(repeat_penalty=-1.0), None)[0].repetition_penalty == 1.0
    assert sampling(Options(repeat_penalty=1.2, top_p=0.5), None)[0].repetition_penalty == 1.2
    assert sampling(Options(), None)[0].repetition_penalty is None  # the model's own default


def test_a_tool_calls_index_sent_back_as_null_is_read_as_go_reads_it():
    call = {"function": {"name": "f", "arguments": {}, "index": None}}
    body = decode_ollama(json.dumps({"model": "m", "messages": [{"role": "assistant", "content": "",
                                                                  "tool_calls": [call]}]}).encode(), ChatRequest)
    assert body.messages[0].tool_calls[0].function.name == "f"
