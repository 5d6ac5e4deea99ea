"""Anthropic's messages as chat templates take them: consecutive messages of
one role are one turn, as Anthropic joins them; thinking is off unless the
request asks for it, and comes back only where it was asked for."""

import asyncio
import base64
import io

import msgspec
from PIL import Image

from gateway.anthropic_api import chat_input, signature_of, thinking_blocks
from gateway.anthropic_schema import MessagesRequest
from gateway.images import IMAGE_LEFT_OUT, ImageLoader
from gateway.settings import GatewaySettings


def request(**fields) -> MessagesRequest:
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}], **fields}
    return msgspec.convert(body, MessagesRequest)


def test_consecutive_messages_of_one_role_are_one_turn():
    body = request(messages=[
        {"role": "user", "content": "First."},
        {"role": "user", "content": [{"type": "text", "text": "Second."},
                                     {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                  "data": "AAAA"}}]},
        {"role": "assistant", "content": "One."},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "done"}]},
        {"role": "user", "content": "Thanks."},
    ])
    prompt = chat_input(body)
    assert [m["role"] for m in prompt.messages] == ["user", "assistant", "tool", "user"]
    assert [p.get("text") for p in prompt.messages[0]["content"]] == ["First.", "Second.", None]
    assert prompt.messages[1]["tool_calls"][0]["function"]["name"] == "f"
    assert [image.param for image in prompt.images] == ["messages[1].content[1].source"]


def test_an_avif_image_block_is_decoded_as_the_other_formats_are():
    avif = io.BytesIO()
    Image.new("RGB", (8, 6), (0, 0, 255)).save(avif, "AVIF")
    source = {"type": "base64", "media_type": "image/avif", "data": base64.b64encode(avif.getvalue()).decode()}
    prompt = chat_input(request(messages=[{"role": "user", "content": [{"type": "image", "source": source}]}]))
    loader = ImageLoader(GatewaySettings())
    [image] = asyncio.run(loader.load(prompt.images))
    assert image.size == (8, 6) and image.mode == "RGB"


def test_thinking_is_off_unless_asked_for_and_shown_only_then():
    assert chat_input(request()).template_kwargs == {"enable_thinking": False}
    assert thinking_blocks(request()) is None
    assert thinking_blocks(request(thinking={"type": "disabled"})) is None
    enabled = request(thinking={"type": "enabled", "budget_tokens": 1024})
    assert chat_input(enabled).template_kwargs == {"enable_thinking": True} and thinking_blocks(enabled) == "shown"
    assert thinking_blocks(request(thinking={"type": "adaptive", "display": "omitted"})) == "omitted"
    effort = request(output_config={"effort": "high"})  # an effort alone decides, as before
    assert chat_input(effort).template_kwargs == {"reasoning_effort": "high", "enable_thinking": True}
    assert thinking_blocks(effort) == "shown"


def test_a_thinking_block_sent_back_without_its_text_replays_the_reasoning_its_signature_carries():
    """Claude Code asks for thinking omitted and sends the blocks back as they came: their reasoning
    went missing from the turns the template replays."""
    call = {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}
    turn = [{"type": "thinking", "thinking": "", "signature": signature_of("Check the weather.\n")}, call]
    prompt = chat_input(request(messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": turn}]))
    assert prompt.messages[1]["reasoning_content"] == "Check the weather.\n"
    foreign = [{"type": "thinking", "thinking": "", "signature": "EqQBCkgIARABGAIiQ"}, call]  # Anthropic's own
    prompt = chat_input(request(messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": foreign}]))
    assert "reasoning_content" not in prompt.messages[1]


def test_an_image_in_a_tool_result_is_named_as_left_out():
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    body = request(messages=[
        {"role": "user", "content": "Look at it."},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "read", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [{"type": "text", "text": "a.png:"}, image]}]}])
    (result,) = [m for m in chat_input(body).messages if m["role"] == "tool"]
    assert result["content"] == "a.png:\n" + IMAGE_LEFT_OUT
