"""Responses input items as chat template messages."""

from gateway.images import IMAGE_LEFT_OUT
from gateway.openai_responses import conversation
from gateway.openai_responses_schema import FunctionCallItem, FunctionCallOutputItem, InputImage, InputText


def test_an_image_in_a_function_output_is_named_as_left_out():
    """Codex's view_image answers with an image: the model learns it was left out, not an empty result."""
    output = [InputText("a.png:"), InputImage(image_url="data:image/png;base64,AAAA")]
    messages, images = conversation([FunctionCallItem("function_call", "c1", "view_image", "{}"),
                                     FunctionCallOutputItem("function_call_output", "c1", output)])
    assert messages[-1]["content"] == "a.png:" + IMAGE_LEFT_OUT and images == []
