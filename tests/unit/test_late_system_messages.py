"""System messages past the first message (Claude Code sends one after the
user's; Codex's developer messages become two or more): kept in place where
the template takes them, and joined into one leading system message where the
template refuses them (Qwen 3.5's raises "System message must be at the
beginning")."""

import pytest

from gateway.tokenizer import PromptError
from tests.tiny_model import SYSTEM_FIRST_TEMPLATE
from tests.unit.test_prefill import tokenizer

LATE_SYSTEM = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hello."},
    {"role": "system", "content": "The date is today."},
    {"role": "user", "content": "What day is it?"},
]


def test_a_template_that_takes_late_system_messages_keeps_them_in_place(tiny_model):
    prompt = tokenizer(tiny_model).render_chat(LATE_SYSTEM)
    assert prompt.index("Hello.") < prompt.index("The date is today.") < prompt.index("What day is it?")


def test_a_template_that_refuses_them_gets_one_leading_system_message(tiny_model):
    prompt = tokenizer(tiny_model, SYSTEM_FIRST_TEMPLATE).render_chat(LATE_SYSTEM)
    assert prompt == ("<|im_start|>system\nBe brief.\n\nThe date is today.<|im_end|>\n"
                      "<|im_start|>user\nHello.<|im_end|>\n<|im_start|>user\nWhat day is it?<|im_end|>\n"
                      "<|im_start|>assistant\n")
    two_leading = [{"role": "system", "content": "A."}, {"role": "system", "content": "B."}, LATE_SYSTEM[1]]
    assert tokenizer(tiny_model, SYSTEM_FIRST_TEMPLATE).render_chat(two_leading).startswith(
        "<|im_start|>system\nA.\n\nB.<|im_end|>\n<|im_start|>user\nHello.")


def test_parts_are_joined_too_and_a_refusal_for_another_reason_is_still_a_400(tiny_model):
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hi."}]},
                {"role": "system", "content": [{"type": "text", "text": "Note."}]}]
    prompt = tokenizer(tiny_model, SYSTEM_FIRST_TEMPLATE).render_chat(messages)
    assert prompt.startswith("<|im_start|>system\nNote.<|im_end|>\n<|im_start|>user\nHi.")
    refusing = "{{ raise_exception('Conversation roles must alternate') }}"
    with pytest.raises(PromptError, match="roles must alternate"):
        tokenizer(tiny_model, refusing).render_chat(LATE_SYSTEM)
