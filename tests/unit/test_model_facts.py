"""What listings say of a model from its files alone (before it loads): its
chat template wherever the model keeps it, and whether it sees images."""

import json

import pytest

from gateway.model_facts import model_facts


@pytest.mark.parametrize("where", ["tokenizer_config.json", "chat_template.jinja", "chat_template.json"])
def test_the_template_is_found_where_the_model_keeps_it(tmp_path, where):
    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llava", "vision_config": {"model_type": "clip"}}))
    content = template if where.endswith(".jinja") else json.dumps({"chat_template": template})
    (tmp_path / where).write_text(content)
    facts = model_facts(str(tmp_path))
    assert facts.chat_template == template and facts.vision and facts.family == "llava"


def test_a_template_file_that_is_not_text_leaves_the_listing_whole(tmp_path):
    """Not UTF-8: /v1/models, /api/tags and `mlxd list` failed with a 500 or a traceback."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "chat_template.jinja").write_bytes(b"\xff\xfe{{ messages }}")
    assert model_facts(str(tmp_path)).chat_template == ""
