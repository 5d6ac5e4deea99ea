"""Scripted models: real MLX llama models whose weights make greedy decoding
say a chosen script, piece by piece.

Each script piece is an added token of the tokenizer; the embedding is the
identity, the transformer block is zeroed (so the residual stream carries the
current token unchanged), and lm_head maps each token to the next piece (the
last prompt token to the first piece, the last piece to EOS). Random weights
cannot be relied on to emit a tool call or a reasoning block; these can, so
the real stack's parsers are tested end to end.

A model given an `after_tool` script says that one instead once the
conversation holds a tool result: its template ends the prompt on a second
trigger token, so an agent's whole turn (call a tool, then answer) is scripted.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models import llama
from tokenizers import AddedToken

from tests.tiny_model import train_tokenizer

# ChatML with tools; the comment names the family's markers, which is how the
# gateway detects a model's tool-call format and reasoning markers.
TEMPLATE = (
    "{# MARKERS #}"
    "{%- if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}"
    "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{# AFTER_TOOL #}{% endif %}"
)
AFTER_TOOL_TRIGGER = "<|tool_answered|>"
AFTER_TOOL = "{% if messages | selectattr('role', 'equalto', 'tool') | list %}" + AFTER_TOOL_TRIGGER + "{% endif %}"


def make_scripted_model(path: Path, script: list[str], markers: str = "<tool_call>",
                        after_tool: Sequence[str] = (), context: int = 1024, special: Sequence[str] = (),
                        template: str = TEMPLATE, second: dict[str, str] | None = None) -> Path:
    """special: tokens added as special tokens (as a format's markers often are), script pieces or not;
    template: a chat template in TEMPLATE's shape (it ends the prompt on the same token); second: a
    script piece's second choice, which greedy decoding takes where a grammar refuses the piece, and
    which the script goes on from as from the piece."""
    path.mkdir(parents=True, exist_ok=True)
    second = second or {}
    tok = train_tokenizer()
    tok.add_special_tokens([AddedToken(word, normalized=False, special=True) for word in special])
    words = [*script, *after_tool] + ([AFTER_TOOL_TRIGGER] if after_tool else []) + list(second.values())
    tok.add_tokens([AddedToken(word, normalized=False, special=False) for word in words if word not in special])
    ids = [tok.token_to_id(word) for word in words]
    assert None not in ids and len(set(ids)) == len(ids), "script pieces must be distinct tokens"
    pieces, answer = ids[:len(script)], ids[len(script):len(script) + len(after_tool)]
    tok.save(str(path / "tokenizer.json"))
    template = template.replace("MARKERS", markers)
    if after_tool:
        template = template.replace("{# AFTER_TOOL #}", AFTER_TOOL)
    eos = tok.token_to_id("<|im_end|>")
    trigger = tok.encode("<|im_start|>assistant\n").ids[-1]
    vocab = tok.get_vocab_size()
    hidden = vocab + vocab % 2  # rotary embeddings want an even head size
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "chat_template": template,
        "clean_up_tokenization_spaces": False,
    }))
    config = {
        "model_type": "llama", "hidden_size": hidden, "num_hidden_layers": 1, "intermediate_size": 8,
        "num_attention_heads": 1, "num_key_value_heads": 1, "rms_norm_eps": 1e-6, "vocab_size": vocab,
        "max_position_embeddings": context, "tie_word_embeddings": False, "eos_token_id": eos,
    }
    (path / "config.json").write_text(json.dumps(config))
    model = llama.Model(llama.ModelArgs.from_dict(config))
    weights = dict(tree_flatten(model.parameters()))
    weights = {name: mx.zeros_like(w) for name, w in weights.items()}
    weights["model.embed_tokens.weight"] = mx.eye(vocab, hidden)
    weights["model.norm.weight"] = mx.ones((hidden,))
    weights["model.layers.0.input_layernorm.weight"] = mx.ones((hidden,))
    weights["model.layers.0.post_attention_layernorm.weight"] = mx.ones((hidden,))
    successor = {trigger: pieces[0], **dict(zip(pieces, pieces[1:])), pieces[-1]: eos}
    if after_tool:
        successor |= {ids[-1]: answer[0], **dict(zip(answer, answer[1:])), answer[-1]: eos}
    head = mx.zeros((vocab, hidden))
    rows = mx.array(list(successor.values()))
    cols = mx.array(list(successor.keys()))
    head[rows, cols] = 1.0
    for piece, alternative in second.items():
        at, alt = script.index(piece), tok.token_to_id(alternative)
        head[alt, [trigger, *pieces][at]] = 0.5
        head[successor[pieces[at]], alt] = 1.0
    weights["lm_head.weight"] = head
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    return path
