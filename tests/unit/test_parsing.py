import json

import pytest

from gateway.parsing import (
    HarmonyParser,
    MessageParser,
    ReasoningSplitter,
    ToolCallParser,
    arguments_object,
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


@pytest.mark.parametrize("arguments", ["9" * 5000, "[" * 100_000 + "]" * 100_000])
def test_hermes_json_python_will_not_read_stays_text(arguments):
    """A 5,000-digit number (over Python's limit for int()) or nesting past
    the recursion limit: text, not an exception in the step that renders
    every stream's output."""
    text = f'<tool_call>{{"name": "f", "arguments": {{"x": {arguments}}}}}</tool_call>'
    assert parse_all(ToolCallParser("hermes"), [text]) == (text, [])
    assert arguments_object(f'{{"x": {arguments}}}') is None


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
    ("<|start|>assistant<|channel|>final<|message|>", "harmony"),
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
    first, second = make(), make()
    assert isinstance(first, MessageParser) and first is not second
    reasoning, content, calls = first.feed('plan</think>ok<tool_call>{"name": "f", "arguments": {}}</tool_call>', True)
    assert (reasoning, content, [c.name for c in calls]) == ("plan", "ok", ["f"]) and second.calls == []
    assert stream_parsers(None, "hermes", "", None)() is None
    assert isinstance(stream_parsers(None, "harmony", "", None)(), HarmonyParser)


WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
HARMONY_CALL = ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
                'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>')


def harmony_all(parser: HarmonyParser, text: str, piece: int) -> tuple[str, str, list, list[str]]:
    """Everything the parser gives for `text` fed `piece` characters at a time, and each content delta."""
    reasoning, content, calls, deltas = "", "", [], []
    pieces = [text[i:i + piece] for i in range(0, len(text), piece)]
    for i, part in enumerate(pieces):
        r, c, new = parser.feed(part, final=i == len(pieces) - 1)
        reasoning, content, calls = reasoning + r, content + c, calls + new
        deltas.append(c)
    return reasoning, content, calls, deltas


@pytest.mark.parametrize("piece", [1, 3, 7, 1000])
def test_harmony_reasoning_then_a_call(piece):
    reasoning, content, calls, _ = harmony_all(HarmonyParser(WEATHER), HARMONY_CALL, piece)
    assert (reasoning, content) == ("Need the weather.", "")
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]


@pytest.mark.parametrize("piece", [1, 4, 1000])
def test_harmony_reasoning_then_the_final_answer(piece):
    text = "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>Paris."
    assert harmony_all(HarmonyParser(None), text, piece)[:3] == ("Easy.", "Paris.", [])


def test_harmony_streams_content_without_holding_it_back():
    *_, deltas = harmony_all(HarmonyParser(None), "<|channel|>final<|message|>one two three", 4)
    assert deltas[-3:] == ["ne t", "wo t", "hree"]  # each piece as it came


def test_harmony_recipient_in_the_start_header_and_a_preamble():
    text = ("<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant to=functions.get_weather"
            '<|channel|>commentary json<|message|>{"city": "Oslo"}<|call|>')
    _, content, calls, _ = harmony_all(HarmonyParser(WEATHER), text, 5)
    assert content == "Checking." and [c.arguments for c in calls] == ['{"city": "Oslo"}']


def test_harmony_call_without_tools_in_the_request_stays_text():
    _, content, calls, _ = harmony_all(HarmonyParser(None), HARMONY_CALL, 6)
    assert content == '{"city": "Paris"}' and calls == []


def test_harmony_call_cut_short_stays_text():
    _, content, calls, _ = harmony_all(HarmonyParser(WEATHER), HARMONY_CALL[:-12], 5)
    assert content == '{"city": "Par' and calls == []


@pytest.mark.parametrize("piece", [1, 5, 1000])
def test_harmony_reply_cut_short_in_a_header_leaks_no_markup(piece):
    """max_tokens inside the next message's header: the header was given as content."""
    text = "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>fin"
    assert harmony_all(HarmonyParser(None), text, piece)[:3] == ("Think.", "", [])
    assert harmony_all(HarmonyParser(None), "<|channel|>ana", piece)[:3] == ("", "", [])


def test_text_that_is_not_harmony_is_content():
    assert harmony_all(HarmonyParser(WEATHER), "plain words", 3)[:3] == ("", "plain words", [])


def test_harmony_reply_continuing_a_message_the_prompt_left_open_streams_as_it_comes():
    """A prefilled assistant message (continue_final_message): the reply is its body, with no header of its own."""
    prompt = "<|start|>user<|message|>Hi<|end|><|start|>assistant<|channel|>final<|message|>Bonjour"
    make = stream_parsers(None, "harmony", prompt, None)
    reasoning, content, calls, deltas = harmony_all(make(), ", Paris.<|return|>", 4)
    assert (reasoning, content, calls) == ("", ", Paris.", []) and deltas[0] == ", Pa"
    thinking = stream_parsers(None, "harmony", "<|start|>assistant<|channel|>analysis<|message|>Hm", None)()
    assert harmony_all(thinking, "m.<|end|><|start|>assistant<|channel|>final<|message|>Yes", 3)[:2] == ("m.", "Yes")
    opened = "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
    _, content, calls, _ = harmony_all(stream_parsers(None, "harmony", opened, WEATHER)(), '{"city": "Oslo"}<|call|>', 5)
    assert content == "" and [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Oslo"}')]


@pytest.mark.parametrize("prompt", ["", "<|start|>user<|message|>Hi<|end|><|start|>assistant",
                                    "<|start|>assistant<|channel|>final<|message|>Done.<|return|>"])
def test_harmony_prompt_that_leaves_no_message_open_waits_for_the_header(prompt):
    assert HarmonyParser.open_header(prompt) is None


def test_llama3_call_whose_arguments_hold_the_separator():
    """Several calls are separated by ";", which a shell command or a query may hold too."""
    for text in ['{"name": "run", "parameters": {"cmd": "cd /tmp; ls"}}',
                 '<|python_tag|>{"name": "run", "parameters": {"cmd": "cd /tmp; ls"}};{"name": "f", "parameters": {}}']:
        content, calls = parse_all(ToolCallParser("llama3"), [text[:9], text[9:]])
        assert content == "" and json.loads(calls[0].arguments) == {"cmd": "cd /tmp; ls"}
    assert [c.name for c in calls] == ["run", "f"]


def test_llama3_json_answer_with_a_name_is_not_a_call():
    """A bare JSON reply is a call only with arguments and a name among the request's tools."""
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]
    for text in ['{"name": "Alice", "age": 30}', '{"name": "Alice", "parameters": {}}', '{"name": "lookup"}']:
        assert parse_all(ToolCallParser("llama3", tools), [text]) == (text, [])
    assert [c.name for c in parse_all(ToolCallParser("llama3", tools), ['{"name": "lookup", "parameters": {}}'])[1]] \
        == ["lookup"]
