"""Tool calls and reasoning, end to end, through scripted models that are certain to produce them."""

from __future__ import annotations

import json

import anthropic
import httpx
import ollama
import openai
import pytest

from tests.conftest import Server, stop_all
from tests.scripted_model import TEMPLATE, make_scripted_model
from tests.test_anthropic import assert_event_grammar

CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
RESPONSES_TOOLS = [{"type": "function", **TOOLS[0]["function"]}]
ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "Weather in a city",
                    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]

# gpt-oss's Harmony format: markers are special tokens; each script piece must be
# one token, so a repeated marker travels inside a longer (ordinary) piece.
HARMONY_MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>", "<|call|>", "<|return|>")
HARMONY = {
    "harmony": ["<|channel|>", "analysis", "<|message|>", "Need the weather.", "<|end|>",
                "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>",
                json.dumps(CALL["arguments"]), "<|call|>"],
    "reasoning-harmony": ["<|channel|>", "analysis", "<|message|>", "The user wants the capital.\n", "<|end|>",
                          "<|start|>assistant<|channel|>final<|message|>", "Paris.", "<|return|>"],
}

SCRIPTS = {
    "hermes": ("<tool_call>", ["Let me check.", "<tool_call>", "\n" + json.dumps(CALL) + "\n", "</tool_call>"]),
    "hermes-between": ("<tool_call>", ["Let me check.", "<tool_call>", "\n" + json.dumps(CALL) + "\n", "</tool_call>",
                                       " It is on its way."]),
    "hermes-two": ("<tool_call>", ["<tool_call>", json.dumps(CALL), "</tool_call>", "\n<tool_call>",
                                   json.dumps({"name": "get_time", "arguments": {"zone": "CET"}}), " </tool_call>"]),
    "mistral": ("[TOOL_CALLS]", ["[TOOL_CALLS]", json.dumps([CALL])]),
    "llama3": ("<|python_tag|>", [json.dumps({"name": "get_weather", "parameters": {"city": "Paris"}})]),
    "reasoning": ("<think>", ["<think>", "\nThe user wants the capital.\n", "</think>", "\n\nParis."]),
    # Reasoning markers only mlx-lm knows, found by it in the vocabulary.
    "reasoning-longcat": ("", ["<longcat_think>", "\nThe user wants the capital.\n", "</longcat_think>",
                               "\n\nParis."]),
    "reasoning-gemma": ("", ["<|channel>", "thought\nThe user wants the capital.\n", "<channel|>", "Paris."]),
    # Formats mlx-lm has parsers for, detected by mlx-lm from these markers in the template.
    "qwen3_coder": ("<tool_call>\n<function=", ["Let me check.", "<tool_call>",
                                                 "\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                                                 "</function>\n", "</tool_call>"]),
    "glm47": ("<arg_key>", ["<tool_call>", "get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>",
                            "</tool_call>"]),
    "minimax_m2": ("<minimax:tool_call>", ["<minimax:tool_call>",
                                           '<invoke name="get_weather"><parameter name="city">Paris</parameter>'
                                           "</invoke>", "</minimax:tool_call>"]),
    "gemma4": ("<|tool_call> <tool_call|>", ["<|tool_call>", 'call:get_weather{city:<|"|>Paris<|"|>}',
                                             "<tool_call|>"]),
    "kimi_k2": ("<|tool_calls_section_begin|>", ["<|tool_calls_section_begin|>", "<|tool_call_begin|>",
                                                 "functions.get_weather:0", "<|tool_call_argument_begin|>",
                                                 json.dumps(CALL["arguments"]), "<|tool_call_end|>",
                                                 "<|tool_calls_section_end|>"]),
    # A call whose "unit" breaks its tool's schema, with a second choice that keeps to it (SECOND).
    "hermes-unit": ("<tool_call>", ["Let me check.", "<tool_call>", '\n{"name": "get_weather", "arguments": {"unit": "',
                                    "K", '"}}\n', "</tool_call>"]),
    "pythonic": ("<|tool_call_start|>", ["<|tool_call_start|>", '[get_weather(city="Paris")]', "<|tool_call_end|>"]),
    "function_gemma": ("<start_function_call>", ["<start_function_call>",
                                                 "call:get_weather{city:<escape>Paris<escape>}",
                                                 "<end_function_call>"]),
}

SECOND = {"hermes-unit": {"K": "C"}}

# A template that renders calls' ids and tool results' (as Kimi's and Mistral's do); with
# STRICT, it refuses an id that is not nine characters long, as Mistral's do.
ID_TEMPLATE = TEMPLATE.replace(
    "<tool_call>{{ c.function | tojson }}</tool_call>",
    "{% if STRICT and c.id | length != 9 %}{{ raise_exception('Tool call IDs should be alphanumeric strings with "
    "length 9!') }}{% endif %}<tool_call>{{ c.id }} {{ c.function | tojson }}</tool_call>",
).replace("{{ m.content }}", "{{ m.tool_call_id ~ ': ' if m.tool_call_id }}{{ m.content }}")
ID_TEMPLATES = {"mistral-ids": ("mistral", ID_TEMPLATE.replace("STRICT", "true")),
                "kimi_k2-ids": ("kimi_k2", ID_TEMPLATE.replace("STRICT", "false"))}


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    servers = {}

    def get(name: str) -> Server:
        if name not in servers:
            family, template = ID_TEMPLATES.get(name, (name, TEMPLATE))
            markers, script = SCRIPTS[family] if family in SCRIPTS else (" ".join(HARMONY_MARKERS), HARMONY[family])
            path = make_scripted_model(tmp_path_factory.mktemp(name) / "model", script, markers,
                                       special=HARMONY_MARKERS, template=template, second=SECOND.get(name))
            servers[name] = Server(["serve", "--model", str(path), "--served-model-name", "scripted"],
                                   path.parent / "serve.log")
            servers[name].wait_ready()
        return servers[name]

    yield get
    stop_all(list(servers.values()))


def openai_client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def calls_of(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def streamed(client, **kwargs):
    """(content, reasoning, calls, finish_reason) assembled from stream deltas."""
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in client.chat.completions.create(model="scripted", stream=True, **kwargs):
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            reasoning += getattr(delta, "reasoning_content", None) or ""
            for call in delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = call.id or entry["id"]
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, reasoning, [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())], finish


@pytest.mark.parametrize("family", ["hermes", "mistral", "llama3", "qwen3_coder", "glm47", "minimax_m2", "gemma4",
                                    "kimi_k2", "pythonic", "function_gemma", "harmony"])
def test_tool_calls_parsed_for_each_family(scripted, family):
    client = openai_client(scripted(family))
    response = client.chat.completions.create(model="scripted", messages=ASK, tools=TOOLS, temperature=0)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert calls_of(choice.message) == [("get_weather", {"city": "Paris"})]
    # Kimi's calls carry their own ids, which its template expects back; the others get ours.
    assert choice.message.tool_calls[0].id == "functions.get_weather:0" if family == "kimi_k2" else (
        choice.message.tool_calls[0].id.startswith("call_"))
    expected_content = "Let me check." if family in ("hermes", "qwen3_coder") else None
    assert choice.message.content == expected_content
    content, _, calls, finish = streamed(client, messages=ASK, tools=TOOLS, temperature=0)
    assert calls == calls_of(choice.message)
    assert (content or None) == expected_content
    assert finish == "tool_calls"


def test_tool_choice_none_leaves_text_alone(scripted):
    client = openai_client(scripted("hermes"))
    response = client.chat.completions.create(model="scripted", messages=ASK, tools=TOOLS, tool_choice="none",
                                              temperature=0)
    choice = response.choices[0]
    assert choice.message.tool_calls is None
    assert choice.finish_reason == "stop"
    assert json.dumps(CALL) in choice.message.content


@pytest.mark.parametrize("model", ["reasoning", "hermes-between", "reasoning-harmony"])
def test_logprobs_are_the_contents_alone(scripted, model):
    """OpenAI's logprobs.content lists the message content's tokens: not the
    reasoning's, nor a tool call's markup (streamed or not). (The whitespace
    that parts them from the content's start the parser leaves out.)"""
    client = openai_client(scripted(model))
    whole = client.chat.completions.create(model="scripted", messages=ASK, tools=TOOLS, temperature=0, logprobs=True)
    message = whole.choices[0].message
    assert message.content and (message.tool_calls if model == "hermes-between" else message.reasoning_content)
    assert "".join(t.token for t in whole.choices[0].logprobs.content).strip() == message.content.strip()
    chunks = list(client.chat.completions.create(model="scripted", messages=ASK, tools=TOOLS, temperature=0,
                                                 logprobs=True, stream=True))
    streamed_tokens = [t.token for c in chunks if c.choices and c.choices[0].logprobs
                       for t in c.choices[0].logprobs.content or []]
    assert "".join(streamed_tokens).strip() == message.content.strip()


def test_parallel_tool_calls(scripted):
    client = openai_client(scripted("hermes-two"))
    both = client.chat.completions.create(model="scripted", messages=ASK, tools=TOOLS, temperature=0)
    assert [name for name, _ in calls_of(both.choices[0].message)] == ["get_weather", "get_time"]
    one = client.chat.completions.create(model="scripted", messages=ASK, tools=TOOLS, temperature=0,
                                         parallel_tool_calls=False)
    assert [name for name, _ in calls_of(one.choices[0].message)] == ["get_weather"]
    _, _, streamed_calls, _ = streamed(client, messages=ASK, tools=TOOLS, temperature=0)
    assert streamed_calls == calls_of(both.choices[0].message)


def test_tool_messages_round_trip(scripted):
    server = scripted("hermes")
    client = openai_client(server)
    first = client.chat.completions.create(model="scripted", messages=ASK, tools=TOOLS, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"},
    ]
    second = client.chat.completions.create(model="scripted", messages=history, tools=TOOLS, temperature=0)
    assert second.choices[0].finish_reason == "tool_calls"
    # The tool's answer was rendered into the prompt.
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + 5
    # The SDKs' own pattern: the returned message object sent back as it is
    # (with its refusal, annotations, audio and function_call fields), rendered the same.
    returned = ASK + [first.choices[0].message, history[-1]]
    again = client.chat.completions.create(model="scripted", messages=returned, tools=TOOLS, temperature=0)
    assert again.usage.prompt_tokens == second.usage.prompt_tokens
    raw = first.choices[0].message.model_dump()
    raw.update(refusal=None, annotations=[], audio=None, function_call=None)
    assert client.chat.completions.create(model="scripted", messages=ASK + [raw, history[-1]], tools=TOOLS,
                                          temperature=0).usage.prompt_tokens == second.usage.prompt_tokens
    # The older single function_call renders as a call too.
    older = ASK + [{"role": "assistant", "content": None, "function_call": {
        "name": call.function.name, "arguments": call.function.arguments}}, {"role": "tool", "tool_call_id": "call_0",
                                                                            "content": "18 degrees and sunny"}]
    legacy = client.chat.completions.create(model="scripted", messages=older, tools=TOOLS, temperature=0)
    assert legacy.usage.prompt_tokens > first.usage.prompt_tokens + 5


def history_with(call_id: str, arguments: str = json.dumps(CALL["arguments"])) -> list[dict]:
    """The question, a call with this id, and the tool's result for it, in OpenAI's messages."""
    return ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": call_id, "content": "18 degrees and sunny"},
    ]


def test_a_template_that_takes_nine_character_ids_gets_them(scripted):
    """Mistral's templates (Devstral, Mistral Small) refuse other ids: every client's second turn failed."""
    server = scripted("mistral-ids")
    client = openai_client(server)
    first = client.chat.completions.create(model="scripted", messages=ASK, tools=TOOLS, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    assert call.id.startswith("call_")
    second = client.chat.completions.create(model="scripted", messages=history_with(call.id), tools=TOOLS,
                                            temperature=0)
    assert second.choices[0].finish_reason == "tool_calls"
    # The same id renders the same every turn (the prefix cache holds the conversation).
    assert client.chat.completions.create(model="scripted", messages=history_with(call.id), tools=TOOLS,
                                          temperature=0).usage.prompt_tokens == second.usage.prompt_tokens
    messages = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0).messages
    assert messages.create(model="scripted", max_tokens=8, tools=ANTHROPIC_TOOLS, messages=ASK + [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_01A09q90qw90lq917835lq9",
                                           "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01A09q90qw90lq917835lq9",
                                      "content": "18 degrees"}]},
    ]).stop_reason == "tool_use"


def test_kimi_reads_back_its_own_call_ids(scripted):
    """Kimi's ids name the function and the call's place (`functions.get_weather:0`): an id
    given back with Anthropic's prefix, or another client's, renders as Kimi wrote it."""
    server = scripted("kimi_k2-ids")
    message = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0).messages.create(
        model="scripted", max_tokens=32, messages=ASK, tools=ANTHROPIC_TOOLS)
    assert message.content[-1].id == "toolu_functions.get_weather:0"
    client = openai_client(server)
    tokens = {call_id: client.chat.completions.create(model="scripted", messages=history_with(call_id),
                                                      tools=TOOLS, temperature=0, max_tokens=1).usage.prompt_tokens
              for call_id in ("functions.get_weather:0", message.content[-1].id, "call_abc")}
    assert len(set(tokens.values())) == 1, tokens


@pytest.mark.parametrize("model", ["reasoning", "reasoning-longcat", "reasoning-gemma", "reasoning-harmony"])
def test_reasoning_goes_to_reasoning_content(scripted, model):
    client = openai_client(scripted(model))
    completion = client.chat.completions.create(model="scripted", messages=ASK, temperature=0)
    message = completion.choices[0].message
    assert message.content == "Paris."
    assert message.reasoning_content == "The user wants the capital.\n"
    # The opening marker, the reasoning and the closing marker (Harmony: the analysis message whole,
    # its header three tokens here).
    assert completion.usage.completion_tokens_details.reasoning_tokens == (5 if model == "reasoning-harmony" else 3)
    content, reasoning, _, finish = streamed(client, messages=ASK, temperature=0)
    assert (content, reasoning, finish) == ("Paris.", "The user wants the capital.\n", "stop")


@pytest.mark.parametrize("model", ["reasoning", "reasoning-harmony"])
def test_ollamas_think_reads_a_thinking_models_reasoning(scripted, model):
    """A model that thinks (markers, or Harmony's analysis channel) says so in
    /api/show and takes `think`; one that does not refuses it (test_ollama.py)."""
    client = ollama.Client(host=scripted(model).url)
    assert "thinking" in client.show("scripted").capabilities
    reply = client.chat(model="scripted", messages=ASK, think=True, options={"temperature": 0})
    assert (reply.message.thinking, reply.message.content) == ("The user wants the capital.\n", "Paris.")


def test_chat_template_kwargs_pass_through(scripted):
    client = openai_client(scripted("reasoning"))
    response = client.chat.completions.create(model="scripted", messages=ASK, temperature=0,
                                              extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert response.choices[0].message.content == "Paris."


def test_anthropic_says_a_message_cut_short_after_a_whole_call_was_cut(scripted):
    """Two calls, the second cut by max_tokens: max_tokens, as Anthropic answers
    (it said tool_use, and the client ran the first never knowing of the second)."""
    client = anthropic.Anthropic(base_url=scripted("hermes-two").url, api_key="unused", max_retries=0)
    message = client.messages.create(model="scripted", max_tokens=5, messages=ASK, tools=ANTHROPIC_TOOLS)
    assert [b.type for b in message.content][0] == "tool_use" and message.stop_reason == "max_tokens"
    with client.messages.stream(model="scripted", max_tokens=5, messages=ASK, tools=ANTHROPIC_TOOLS) as stream:
        assert stream.get_final_message().stop_reason == "max_tokens"
    assert client.messages.create(model="scripted", max_tokens=64, messages=ASK,
                                  tools=ANTHROPIC_TOOLS).stop_reason == "tool_use"


def test_anthropic_tool_use(scripted):
    client = anthropic.Anthropic(base_url=scripted("hermes").url, api_key="unused", max_retries=0)
    message = client.messages.create(model="scripted", max_tokens=32, messages=ASK, tools=ANTHROPIC_TOOLS)
    assert message.stop_reason == "tool_use"
    assert [b.type for b in message.content] == ["text", "tool_use"]
    assert message.content[0].text == "Let me check."
    assert (message.content[1].name, message.content[1].input) == ("get_weather", {"city": "Paris"})
    assert message.content[1].id.startswith("toolu_")
    with client.messages.stream(model="scripted", max_tokens=32, messages=ASK, tools=ANTHROPIC_TOOLS) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [(b.type, getattr(b, "input", None)) for b in final.content] == [("text", None), ("tool_use", {"city": "Paris"})]
    follow_up = client.messages.create(model="scripted", max_tokens=32, tools=ANTHROPIC_TOOLS, messages=ASK + [
        {"role": "assistant", "content": [{"type": "tool_use", "id": message.content[1].id, "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": message.content[1].id,
                                      "content": "18 degrees"}]},
    ])
    prompt_tokens = [m.usage.input_tokens + m.usage.cache_read_input_tokens for m in (message, follow_up)]
    assert prompt_tokens[1] > prompt_tokens[0] + 5


def test_strict_tools_hold_the_models_own_calls_to_their_schemas(scripted):
    """With tool_choice auto, a tool marked strict (each API's `strict: true`)
    gets calls that follow its schema: the scripted model writes "K", which
    the tool's enum does not hold, and its second choice "C" where a grammar
    refuses "K". Its text before the call stays as it is."""
    parameters = {"type": "object", "properties": {"unit": {"enum": ["C", "F"]}}, "required": ["unit"],
                  "additionalProperties": False}
    tool = {"name": "get_weather", "description": "Weather in a city", "parameters": parameters}
    server = scripted("hermes-unit")
    client = openai_client(server)
    for strict, unit in [(None, "K"), (False, "K"), (True, "C")]:
        tools = [{"type": "function", "function": {**tool, **({} if strict is None else {"strict": strict})}}]
        whole = client.chat.completions.create(model="scripted", messages=ASK, tools=tools, temperature=0)
        assert whole.choices[0].message.content == "Let me check."
        assert calls_of(whole.choices[0].message) == [("get_weather", {"unit": unit})]
        assert streamed(client, messages=ASK, tools=tools, temperature=0)[2] == [("get_weather", {"unit": unit})]
    message = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0).messages.create(
        model="scripted", max_tokens=32, messages=ASK, extra_body={"temperature": 0}, tools=[
            {"name": "get_weather", "input_schema": parameters, "strict": True}])
    assert [(b.type, getattr(b, "input", None)) for b in message.content] == [("text", None), ("tool_use", {"unit": "C"})]
    response = client.responses.create(model="scripted", input="Weather in Paris?", temperature=0,
                                       tools=[{"type": "function", **tool, "strict": True}])
    assert [json.loads(item.arguments) for item in response.output if item.type == "function_call"] == [{"unit": "C"}]


def test_blocks_come_in_their_order_whole_or_streamed(scripted):
    """Text, a call, more text: Anthropic's content blocks and Responses' output items, as the stream sends them;
    also where stop sequences hold the end of the call back until the text after it has come (the text came
    first)."""
    server = scripted("hermes-between")
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    for stops in [[], ["never-seen"]]:
        message = client.messages.create(model="scripted", max_tokens=32, messages=ASK, tools=ANTHROPIC_TOOLS,
                                         stop_sequences=stops)
        with client.messages.stream(model="scripted", max_tokens=32, messages=ASK, tools=ANTHROPIC_TOOLS,
                                    stop_sequences=stops) as stream:
            final = stream.get_final_message()
        blocks = [(b.type, getattr(b, "text", None)) for b in message.content]
        assert blocks == [("text", "Let me check."), ("tool_use", None), ("text", " It is on its way.")]
        assert [(b.type, getattr(b, "text", None)) for b in final.content] == blocks
    responses = openai_client(server).responses
    whole = responses.create(model="scripted", input="Weather in Paris?", tools=RESPONSES_TOOLS, temperature=0)
    assert [item.type for item in whole.output] == ["message", "function_call", "message"]
    streamed = [e for e in responses.create(model="scripted", input="Weather in Paris?", tools=RESPONSES_TOOLS,
                                            temperature=0, stream=True) if e.type == "response.completed"]
    assert [item.type for item in streamed[0].response.output] == ["message", "function_call", "message"]


def test_anthropic_thinking_blocks(scripted):
    server = scripted("reasoning")
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    message = client.messages.create(model="scripted", max_tokens=32, messages=ASK,
                                     thinking={"type": "enabled", "budget_tokens": 1024})
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert message.content[0].thinking == "The user wants the capital.\n"
    assert message.content[1].text == "Paris."
    with client.messages.stream(model="scripted", max_tokens=32, messages=ASK,
                                thinking={"type": "enabled", "budget_tokens": 1024}) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].signature == message.content[0].signature != ""
    # Omitted, as Claude Code asks: blocks of no text whose signature carries the reasoning back.
    omitted = {"type": "adaptive", "display": "omitted"}
    hidden = client.messages.create(model="scripted", max_tokens=32, messages=ASK, thinking=omitted)
    with client.messages.stream(model="scripted", max_tokens=32, messages=ASK, thinking=omitted) as stream:
        hidden_streamed = stream.get_final_message()
    for reply in (hidden, hidden_streamed):
        assert [(b.type, getattr(b, "thinking", None)) for b in reply.content] == [("thinking", ""), ("text", None)]
        assert reply.content[0].signature == message.content[0].signature
    import httpx

    names = []
    body = {"model": "scripted", "max_tokens": 32, "messages": ASK, "stream": True}
    with httpx.stream("POST", server.url + "/v1/messages", json=body, timeout=30) as r:
        names = [line[7:] for line in r.iter_lines() if line.startswith("event: ")]
    assert_event_grammar(names)
    # Not asked for thinking: a model that reasons anyway (this one's script) keeps it to itself.
    assert names.count("content_block_start") == 1
    unasked = client.messages.create(model="scripted", max_tokens=32, messages=ASK)
    assert [(b.type, b.text) for b in unasked.content] == [("text", "Paris.")]


def test_harmony_reasoning_before_a_call(scripted):
    client = openai_client(scripted("harmony"))
    message = client.chat.completions.create(model="scripted", messages=ASK, tools=TOOLS, temperature=0).choices[0].message
    assert message.reasoning_content == "Need the weather." and calls_of(message) == [("get_weather", {"city": "Paris"})]


@pytest.mark.parametrize("family", ["hermes", "mistral", "llama3", "harmony", "qwen3_coder", "glm47", "minimax_m2"])
def test_a_forced_call_follows_the_models_format(scripted, family):
    client = openai_client(scripted(family))
    # A closed schema: the grammar, not the model, then decides when the call ends.
    city = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
            "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": city}}]
    response = client.chat.completions.create(model="scripted", messages=ASK, tools=tools, tool_choice="required",
                                              max_tokens=200, temperature=0)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    [(name, arguments)] = calls_of(choice.message)
    assert name == "get_weather" and arguments["city"] in ("Paris", "Oslo")


def test_a_forced_call_in_a_format_without_a_grammar_is_a_clear_400(scripted):
    client = openai_client(scripted("gemma4"))
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="scripted", messages=ASK, tools=TOOLS, tool_choice="required")
    assert e.value.body["param"] == "tool_choice"


def test_ollama_tool_calls_and_thinking(scripted):
    """Ollama's client: a call comes back with its arguments as an object, a
    tool result goes back in as a `tool` message, reasoning comes as `thinking`."""
    client = ollama.Client(host=scripted("hermes").url)
    first = client.chat(model="scripted", messages=ASK, tools=TOOLS, options={"temperature": 0})
    assert [(c.function.name, dict(c.function.arguments)) for c in first.message.tool_calls] == [
        (CALL["name"], CALL["arguments"])]
    parts = list(client.chat(model="scripted", messages=ASK, tools=TOOLS, options={"temperature": 0}, stream=True))
    streamed_calls = [c for p in parts for c in p.message.tool_calls or []]
    assert [(c.function.name, dict(c.function.arguments)) for c in streamed_calls] == [(CALL["name"],
                                                                                        CALL["arguments"])]
    history = ASK + [first.message, {"role": "tool", "content": "sunny", "tool_name": "get_weather"}]
    assert client.chat(model="scripted", messages=history, tools=TOOLS, options={"temperature": 0}).done

    thinking = ollama.Client(host=scripted("reasoning").url).chat(model="scripted", messages=ASK, think=True,
                                                                    options={"temperature": 0})
    assert (thinking.message.content, thinking.message.thinking) == ("Paris.", "The user wants the capital.\n")


def test_ollama_numbers_an_answers_tool_calls(scripted):
    """Each call carries its place among the answer's calls, streamed or not:
    Open WebUI reads streamed calls as OpenAI's deltas, and merged two calls
    of index 0 into one with both names and both argument objects."""
    server = scripted("hermes-two")
    body = {"model": "scripted", "messages": ASK, "tools": TOOLS, "options": {"temperature": 0}}
    whole = httpx.post(server.url + "/api/chat", json={**body, "stream": False}, timeout=60).json()
    assert [(c["function"]["name"], c["function"]["index"]) for c in whole["message"]["tool_calls"]] == [
        ("get_weather", 0), ("get_time", 1)]
    ids = [c["id"] for c in whole["message"]["tool_calls"]]  # as Ollama gives them, for tool_call_id
    assert len(set(ids)) == 2 and all(i.startswith("call_") for i in ids)
    with httpx.stream("POST", server.url + "/api/chat", json=body, timeout=60) as r:
        lines = [json.loads(line) for line in r.iter_lines() if line]
    streamed = [c["function"] for line in lines for c in line["message"].get("tool_calls") or []]
    assert streamed == [c["function"] for c in whole["message"]["tool_calls"]]


def test_ollama_show_says_the_same_of_a_model_loaded_or_not(scripted):
    """Apps ask /api/show before any load, to offer a model for tools, thinking or images."""
    client = ollama.Client(host=scripted("reasoning").url)
    loaded = client.show("scripted")
    assert client.generate(model="scripted", keep_alive=0).done_reason == "unload"
    assert client.ps().models == []
    unloaded = client.show("scripted")
    assert set(unloaded.capabilities) == set(loaded.capabilities) == {"completion", "tools", "thinking"}
    assert unloaded.template == loaded.template != ""


def test_a_reasoning_model_thinks_before_its_json_answer(scripted):
    """The JSON grammar held the output from the first token, so a reasoning model could not think first."""
    client = openai_client(scripted("reasoning"))
    city = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
            "additionalProperties": False}
    response = client.chat.completions.create(
        model="scripted", messages=ASK, temperature=0, max_tokens=40,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": city}})
    message = response.choices[0].message
    assert message.reasoning_content == "The user wants the capital.\n"
    assert json.loads(message.content)["city"] in ("Paris", "Rome")
