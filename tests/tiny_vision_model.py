"""A tiny random-weight LLaVA model (CLIP vision tower + llama), with the
tiny model's trained tokenizer, an image placeholder token, and an image
processor configuration of its own. mlx-vlm loads it; transformers' LLaVA
processor runs its image preprocessing (without PyTorch)."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from tokenizers import AddedToken

from tests.tiny_model import train_tokenizer

IMAGE_TOKEN = "<image>"
IMAGE_SIZE = 28
PATCH_SIZE = 14

# Messages' content arrives as a list of parts (text and image); each image
# part becomes one placeholder, which the processor expands to the image's tokens.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<image>' }}{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def make_tiny_vision_model(path: Path, *, seed: int = 0, logit_scale: float = 8.0) -> Path:
    """Write a loadable mlx-vlm LLaVA directory at `path` and return it."""
    from mlx_vlm.models import llava

    path.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer()
    tok.add_special_tokens([AddedToken(IMAGE_TOKEN, special=True, normalized=False)])
    tok.save(str(path / "tokenizer.json"))
    vocab_size = tok.get_vocab_size()
    eos_id = tok.token_to_id("<|im_end|>")
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": 2048,
        "clean_up_tokenization_spaces": False,
    }))
    (path / "chat_template.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    (path / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "CLIPImageProcessor",
        "processor_class": "LlavaProcessor",
        "do_resize": True,
        "size": {"shortest_edge": IMAGE_SIZE},
        "do_center_crop": True,
        "crop_size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "do_convert_rgb": True,
        "resample": 3,
    }))
    (path / "processor_config.json").write_text(json.dumps({
        "processor_class": "LlavaProcessor",
        "patch_size": PATCH_SIZE,
        "vision_feature_select_strategy": "default",
        "image_token": IMAGE_TOKEN,
        "num_additional_image_tokens": 1,
    }))
    text = {
        "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "vocab_size": vocab_size,
        "max_position_embeddings": 2048, "tie_word_embeddings": False,
    }
    vision = {
        "model_type": "clip_vision_model", "num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64,
        "num_attention_heads": 2, "image_size": IMAGE_SIZE, "patch_size": PATCH_SIZE, "projection_dim": 32,
        "num_channels": 3, "layer_norm_eps": 1e-5,
    }
    config = {
        "model_type": "llava", "image_token_index": tok.token_to_id(IMAGE_TOKEN),
        "vision_feature_select_strategy": "default", "vision_feature_layer": -2,
        "vocab_size": vocab_size, "eos_token_id": eos_id, "text_config": text, "vision_config": vision,
    }
    (path / "config.json").write_text(json.dumps(config))
    model_config = llava.ModelConfig.from_dict(config)
    model_config.text_config = llava.TextConfig.from_dict(text)
    model_config.vision_config = llava.VisionConfig.from_dict(vision)
    mx.random.seed(seed)
    model = llava.Model(model_config)
    # Sharpened logits keep greedy choices far apart (see make_tiny_model);
    # a strong projector makes the image decide the answer.
    lm = model.language_model
    lm.lm_head.weight = lm.lm_head.weight * logit_scale
    projector = model.multi_modal_projector.linear_2
    projector.weight = projector.weight * logit_scale
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    return path
