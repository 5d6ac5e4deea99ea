"""A tiny random-weight llama (or qwen2) model with a tokenizer trained on the spot.

Real MLX, real mlx-lm loading, real HF tokenizer files and chat template;
small enough to build in well under a second and decode at hundreds of
tokens/s on a CPU.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France; Berlin is the capital of Germany.",
    "Once upon a time there was a small server that answered every question.",
    "Tokens flow from the worker to the gateway and out to the client.",
    "Numbers 0 1 2 3 4 5 6 7 8 9 and symbols ! ? , . : ; ( ) [ ] { } \" ' - _ / \\",
    "héllo wörld ñandú — naïve café: ünïcödé text 😀 漢字",
] * 20

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# As Qwen 3.5's template does: a system message anywhere but first is an error.
SYSTEM_FIRST_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' and not loop.first %}"
    "{{ raise_exception('System message must be at the beginning.') }}{% endif %}{% endfor %}" + CHAT_TEMPLATE
)

# Qwen3-Next's hybrid layers (Qwen 3.5's kind), small: with two layers, the
# first is linear attention (a fixed-size state, not trimmable) and the second
# full attention (a KV cache that grows).
QWEN3_NEXT = {
    "head_dim": 16, "partial_rotary_factor": 0.25, "full_attention_interval": 2,
    "linear_num_value_heads": 2, "linear_num_key_heads": 2, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4, "num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64,
}


def train_tokenizer(vocab_size: int = 384) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return tok


def make_tiny_model(
    path: Path,
    *,
    seed: int = 0,
    layers: int = 2,
    hidden: int = 64,
    context: int = 2048,
    logit_scale: float = 8.0,
    model_type: str = "llama",
    weight_index: bool = False,
    chat_template: str = CHAT_TEMPLATE,
    extra_config: dict | None = None,
) -> Path:
    """Write a loadable mlx-lm model directory at `path` and return it.

    logit_scale sharpens the random lm_head so that greedy choices are far
    apart: batched and single-request decoding round floats differently, and
    a near-tie would make their outputs differ for reasons unrelated to the
    server.

    model_type: an mlx-lm architecture with llama's parameters (qwen2 adds
    attention biases and can be split by layers: pipeline()). weight_index
    writes the model.safetensors.index.json a sharded checkpoint has, which
    mlx-lm's pipeline loading reads. extra_config: what an architecture
    needs beyond llama's parameters (QWEN3_NEXT for qwen3_next).
    """
    path.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer()
    tok.save(str(path / "tokenizer.json"))
    vocab_size = tok.get_vocab_size()
    eos_id = tok.token_to_id("<|im_end|>")
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": None,
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "unk_token": None,
                "chat_template": chat_template,
                "model_max_length": context,
                "clean_up_tokenization_spaces": False,
            }
        )
    )
    config = {
        "model_type": model_type,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": hidden * 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab_size,
        "max_position_embeddings": context,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "eos_token_id": eos_id,
        **(extra_config or {}),
    }
    (path / "config.json").write_text(json.dumps(config))
    mx.random.seed(seed)
    architecture = importlib.import_module(f"mlx_lm.models.{model_type}")
    model = architecture.Model(architecture.ModelArgs.from_dict(config))
    model.lm_head.weight = model.lm_head.weight * logit_scale
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    if weight_index:
        index = {"metadata": {}, "weight_map": {name: "model.safetensors" for name in weights}}
        (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return path
