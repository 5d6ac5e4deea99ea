"""A conversation that ends with the assistant's words (Anthropic's prefill):
the prompt stops inside that message, for the answer to go on from it; a
template that rewrites the message's text cannot, and opens a new turn instead."""

import json

from gateway.tokenizer import Tokenizer

MESSAGES = [{"role": "user", "content": "Tell me about the sea."}, {"role": "assistant", "content": "The sea"}]


def tokenizer(tiny_model, template: str | None = None) -> Tokenizer:
    files = {p.name: p.read_bytes() for p in tiny_model.iterdir() if p.suffix == ".json"}
    if template is not None:
        config = json.loads(files["tokenizer_config.json"])
        files["tokenizer_config.json"] = json.dumps({**config, "chat_template": template}).encode()
    return Tokenizer(files)


def test_a_prefill_is_continued(tiny_model):
    prompt = tokenizer(tiny_model).render_chat(MESSAGES, continue_final=True)
    assert prompt.endswith("The sea")


def test_a_template_that_rewrites_the_last_message_opens_a_new_turn(tiny_model):
    shouting = ("{% for m in messages %}<{{ m.role }}>{{ m.content | upper }}</{{ m.role }}>{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")
    prompt = tokenizer(tiny_model, shouting).render_chat(MESSAGES, continue_final=True)
    assert prompt.endswith("<assistant>THE SEA</assistant><assistant>")
