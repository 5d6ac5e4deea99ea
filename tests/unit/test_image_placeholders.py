"""A template that leaves an image out of the prompt is a clear 400, never
another image in its place (some processors fill the placeholders left with
the first images); so is any image token of the model written in a message's text."""

import json
import subprocess
import sys

import pytest

from tests.tiny_vision_model import IMAGE_TEXT, chat_template, make_tiny_vision_model

# Run apart: the gateway never imports mlx-vlm, whose import (here, by the
# fixtures) registers processors of its own with transformers.
PROMPTS = """
import json, sys
from pathlib import Path
from PIL import Image
from gateway.tokenizer import PromptError, Tokenizer

path = Path(sys.argv[1])
tokenizer = Tokenizer({p.name: p.read_bytes() for p in path.iterdir() if p.suffix != ".safetensors"}, vision=True)
images = [Image.new("RGB", (28, 28), "red"), Image.new("RGB", (28, 28), "blue")]
image = [{"type": "image"}, {"type": "text", "text": "this"}]
out = []
for first in ("user", "system"):
    try:
        tokenizer.chat_prompt([{"role": first, "content": image}, {"role": "user", "content": image}], images=images)
        out.append("ok")
    except PromptError as e:
        out.append(str(e))
config = json.loads((path / "config.json").read_text())
image_id = config.get("image_token_index", config.get("image_token_id"))
placeholder = getattr(tokenizer.processor, "boi_token", None) or tokenizer.processor.image_token
# The template's placeholder, and the token the vision model counts (Gemma 3's differ).
for token in (placeholder, tokenizer._tok.convert_ids_to_tokens(image_id)):
    try:  # written in a question about the image
        tokenizer.chat_prompt([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"what is {token}?"}]}],
                              images=images[:1])
        out.append("ok")
    except PromptError as e:
        out.append(str(e))
for token in (placeholder, tokenizer._tok.convert_ids_to_tokens(image_id)):
    try:  # written in a tool's definition, which this template renders
        tool = {"type": "function", "function": {"name": "f", "description": f"draws {token}", "parameters": {}}}
        tokenizer.chat_prompt([{"role": "user", "content": image}], tools=[tool], images=images[:1])
        out.append("ok")
    except PromptError as e:
        out.append(str(e))
print(json.dumps(out))
"""


@pytest.mark.parametrize("family", ["llava", "qwen2_vl", "gemma3", "idefics3", "smolvlm", "mistral3"])
def test_an_image_the_template_leaves_out_is_a_clear_error(tmp_path, family):
    path = make_tiny_vision_model(tmp_path / family, family=family)
    # As Gemma 3's and Mistral's templates do: a system message keeps only its text.
    template = chat_template(IMAGE_TEXT[family]).replace(
        "{% if part['type'] == 'image' %}", "{% if part['type'] == 'image' and message['role'] != 'system' %}")
    template = "{% for tool in tools or [] %}{{ tool['function']['description'] }}\n{% endfor %}" + template
    (path / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    run = subprocess.run([sys.executable, "-c", PROMPTS, str(path)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    both_asked, one_left_out, *tokens_in_text, in_tool, in_tool_too = json.loads(run.stdout)
    assert both_asked == "ok"
    assert "placed 1 of the request's 2 images" in one_left_out
    # Gemma 3's <image_soft_token> passed, and failed the request in the worker (a 500, or a 200 cut short).
    assert all("holds the model's image token" in answer for answer in tokens_in_text), tokens_in_text
    # Written in a tool's description, it passed too: the worker's 500 (Gemma 3's), or another image's place.
    assert all("holds the model's image token" in answer for answer in (in_tool, in_tool_too)), (in_tool, in_tool_too)
