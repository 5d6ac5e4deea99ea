"""Tiny random-weight vision-language models, one per family mlxd serves,
built as mlx-vlm's own tests build theirs: the family's mlx-vlm Model class on
a small config, random weights, the tiny model's trained tokenizer with the
family's image tokens, and the family's image processor configuration. mlx-vlm
loads each; transformers runs its image preprocessing (without PyTorch).

LLaVA: a CLIP vision tower and a llama; every image is IMAGE_SIZE square and
takes the same tokens. Idefics3: a SigLIP-style tower whose patches are
shuffled into fewer tokens, and a llama (SmolVLM: the same under its own
name and processor). Gemma 3: a SigLIP tower pooled to a
fixed number of tokens, and Gemma's language model with a sliding-window layer.
Mistral 3: a Pixtral tower over images kept in their aspect, and a mistral. Qwen2-VL, Qwen2.5-VL and Qwen3-VL: vision towers of
their own, an image's token count following its size (28- or 32-pixel cells),
and a language model with multimodal rotary positions (mRoPE), whose prompts
with images run their positions behind their length.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from tokenizers import AddedToken

from gateway.tokenizer import PROMPT_ARRAYS
from tests.tiny_model import train_tokenizer

FAMILIES = ("llava", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "idefics3", "smolvlm", "gemma3", "mistral3")
IMAGE_SIZE = 28
PATCH_SIZE = 14

# What one image part of a message becomes in each family's prompt; the
# processor expands the image token to the image's tokens.
QWEN_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
IMAGE_TEXT = {"llava": "<image>", "qwen2_vl": QWEN_IMAGE, "qwen2_5_vl": QWEN_IMAGE, "qwen3_vl": QWEN_IMAGE,
              "idefics3": "<image>", "smolvlm": "<image>", "gemma3": "<start_of_image>",
              "mistral3": "[IMG]"}
IMAGE_TOKENS = {
    "llava": ["<image>"],
    "qwen2_vl": ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"],
}
IMAGE_TOKENS["qwen2_5_vl"] = IMAGE_TOKENS["qwen3_vl"] = IMAGE_TOKENS["qwen2_vl"]
IMAGE_TOKENS["idefics3"] = IMAGE_TOKENS["smolvlm"] = ["<fake_token_around_image>", "<image>", "<global-img>"]
IMAGE_TOKENS["gemma3"] = ["<start_of_image>", "<image_soft_token>", "<end_of_image>"]
IMAGE_TOKENS["mistral3"] = ["[IMG]", "[IMG_BREAK]", "[IMG_END]"]


def chat_template(image_text: str) -> str:
    """Messages' content arrives as a list of parts (text and image)."""
    return (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
        "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
        "{% for part in message['content'] %}"
        "{% if part['type'] == 'image' %}{{ '" + image_text + "' }}"
        "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
        "{% endfor %}{% endif %}{{ '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )


# Every fixture's processor scales pixels to [0, 1], then to [-1, 1].
NORMALIZE = {"do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": [0.5, 0.5, 0.5],
             "image_std": [0.5, 0.5, 0.5], "do_convert_rgb": True}

TEXT_CONFIG = {
    "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128, "num_attention_heads": 4,
    "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "max_position_embeddings": 2048, "tie_word_embeddings": False,
}


# Larger Qwen2-VL models, random too, for benchmarks where a tiny tower would
# time only overheads: "small" (a 16-block tower 512 wide, for a CPU) and
# "2b" (Qwen2-VL-2B's dimensions, a 32-block tower 1280 wide and a 28-layer
# language model, for a GPU).
QWEN2_VL_SIZES = {
    "small": {
        "vision": {"depth": 16, "embed_dim": 512, "num_heads": 8, "mlp_ratio": 4, "hidden_size": 512},
        "text": {"hidden_size": 512, "num_hidden_layers": 8, "intermediate_size": 1536, "num_attention_heads": 8,
                 "num_key_value_heads": 2, "rope_scaling": {"type": "mrope", "mrope_section": [8, 12, 12]}},
        "processor": {"min_pixels": 56 * 56, "max_pixels": 28 * 28 * 1280},
        "dtype": mx.float32,
    },
    "2b": {
        "vision": {"depth": 32, "embed_dim": 1280, "num_heads": 16, "mlp_ratio": 4, "hidden_size": 1536},
        "text": {"hidden_size": 1536, "num_hidden_layers": 28, "intermediate_size": 8960, "num_attention_heads": 12,
                 "num_key_value_heads": 2, "max_position_embeddings": 32768,
                 "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}},
        "processor": {"min_pixels": 56 * 56, "max_pixels": 28 * 28 * 1280},
        "dtype": mx.bfloat16,
    },
}


def make_tiny_vision_model(path: Path, *, family: str = "llava", seed: int = 0, logit_scale: float = 8.0,
                           qwen2_vl_size: str | None = None, ministral3: bool = False) -> Path:
    """Write a loadable mlx-vlm directory of `family` at `path` and return it;
    with `qwen2_vl_size` (family qwen2_vl only), one of QWEN2_VL_SIZES instead;
    with `ministral3` (family mistral3 only), Ministral 3's text model, whose
    attention scaling grows from the 8th position on."""
    if qwen2_vl_size and family != "qwen2_vl":
        raise ValueError("only the qwen2_vl family comes in other sizes here")
    if ministral3 and family != "mistral3":
        raise ValueError("only the mistral3 family has a ministral3 text model")
    path.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in IMAGE_TOKENS[family]])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": 2048,
        "clean_up_tokenization_spaces": False,
        # Gemma 3's processor finds its image tokens on the tokenizer.
        **({"extra_special_tokens": {"boi_token": "<start_of_image>", "image_token": "<image_soft_token>",
                                     "eoi_token": "<end_of_image>"}} if family == "gemma3" else {}),
    }))
    (path / "chat_template.json").write_text(json.dumps({"chat_template": chat_template(IMAGE_TEXT[family])}))
    build = {"llava": _llava, "idefics3": _idefics3, "smolvlm": _idefics3, "gemma3": _gemma3,
             "mistral3": _mistral3}.get(family, _qwen_vl)
    size = QWEN2_VL_SIZES[qwen2_vl_size] if qwen2_vl_size else None
    if size:
        config, model = _qwen_vl(path, tok, family, seed, size)
    else:
        config, model = _mistral3(path, tok, family, seed, ministral3) if ministral3 else build(path, tok, family, seed)
    (path / "config.json").write_text(json.dumps(config))
    # Sharpened logits keep greedy choices far apart (see make_tiny_model).
    lm = model.language_model
    lm.lm_head.weight = lm.lm_head.weight * logit_scale
    if size:
        model.set_dtype(size["dtype"])
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    return path


def _random_model(module, config: dict, text: dict, vision: dict, seed: int):
    """The family's mlx-vlm Model on these configurations, its weights random from `seed`."""
    model_config = module.ModelConfig.from_dict(dict(config))
    model_config.text_config = module.TextConfig.from_dict(text)
    model_config.vision_config = module.VisionConfig.from_dict(vision)
    mx.random.seed(seed)
    return module.Model(model_config)


def _llava(path: Path, tok, family: str, seed: int):
    from mlx_vlm.models import llava

    (path / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "CLIPImageProcessor",
        "processor_class": "LlavaProcessor",
        "do_resize": True,
        "size": {"shortest_edge": IMAGE_SIZE},
        "do_center_crop": True,
        "crop_size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        **NORMALIZE,
        "resample": 3,
    }))
    (path / "processor_config.json").write_text(json.dumps({
        "processor_class": "LlavaProcessor",
        "patch_size": PATCH_SIZE,
        "vision_feature_select_strategy": "default",
        "image_token": "<image>",
        "num_additional_image_tokens": 1,
    }))
    text = {"model_type": "llama", **TEXT_CONFIG, "vocab_size": tok.get_vocab_size()}
    vision = {
        "model_type": "clip_vision_model", "num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64,
        "num_attention_heads": 2, "image_size": IMAGE_SIZE, "patch_size": PATCH_SIZE, "projection_dim": 32,
        "num_channels": 3, "layer_norm_eps": 1e-5,
    }
    config = {
        "model_type": "llava", "image_token_index": tok.token_to_id("<image>"),
        "vision_feature_select_strategy": "default", "vision_feature_layer": -2,
        "vocab_size": tok.get_vocab_size(), "eos_token_id": tok.token_to_id("<|im_end|>"),
        "text_config": text, "vision_config": vision,
    }
    model = _random_model(llava, config, text, vision, seed)
    # A strong projector makes the image decide the answer.
    projector = model.multi_modal_projector.linear_2
    projector.weight = projector.weight * 8
    return config, model


def _qwen_vl(path: Path, tok, family: str, seed: int, size: dict | None = None):
    import importlib

    module = importlib.import_module(f"mlx_vlm.models.{family}")
    processor = {"qwen2_vl": "Qwen2VLProcessor", "qwen2_5_vl": "Qwen2_5_VLProcessor",
                 "qwen3_vl": "Qwen3VLProcessor"}[family]
    patch = 16 if family == "qwen3_vl" else PATCH_SIZE
    cell = 2 * patch  # a token's square of pixels, after the 2 x 2 merge
    # Images from one cell to 4 x 4 cells keep their size: 1 to 16 image tokens.
    (path / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": processor,
        "min_pixels": cell * cell,
        "max_pixels": 16 * cell * cell,
        "patch_size": patch,
        "temporal_patch_size": 2,
        "merge_size": 2,
        **NORMALIZE,
        **(size["processor"] if size else {}),
    }))
    vision = {"model_type": family, "depth": 2, "num_heads": 2, "patch_size": patch, "spatial_patch_size": patch,
              "spatial_merge_size": 2, "temporal_patch_size": 2, "in_channels": 3}
    if family == "qwen2_vl":
        vision |= {"embed_dim": 32, "hidden_size": TEXT_CONFIG["hidden_size"], "mlp_ratio": 2}
    elif family == "qwen2_5_vl":  # windowed attention in the first block, full in the second
        vision |= {"hidden_size": 32, "intermediate_size": 64, "out_hidden_size": TEXT_CONFIG["hidden_size"],
                   "window_size": 56, "fullatt_block_indexes": [1], "tokens_per_second": 2}
    else:  # learned position embeddings on an 8 x 8 grid; the first block's features also enter layer 0 (deepstack)
        vision |= {"hidden_size": 32, "intermediate_size": 64, "out_hidden_size": TEXT_CONFIG["hidden_size"],
                   "num_position_embeddings": 64, "deepstack_visual_indexes": [0]}
    vision |= size["vision"] if size else {}
    ids = {t: tok.token_to_id(t) for t in IMAGE_TOKENS[family]}
    # head_dim 16: 8 rotary frequencies, split over time, height and width.
    text = {**TEXT_CONFIG, "vocab_size": tok.get_vocab_size(), "rope_theta": 10000.0,
            "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}} | (size["text"] if size else {})
    config = {
        "model_type": family, "image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"], "vision_end_token_id": ids["<|vision_end|>"],
        "eos_token_id": tok.token_to_id("<|im_end|>"), "vision_config": vision,
    }
    if family == "qwen3_vl":  # its language model's settings nest under text_config
        config |= {"text_config": {"model_type": "qwen3_vl_text", **text, "head_dim": 16},
                   "vocab_size": text["vocab_size"]}
    else:
        config |= {**text}
    model = _random_model(module, config, config.get("text_config", config), vision, seed)
    merger = model.vision_tower.merger
    last = merger.linear_fc2 if family == "qwen3_vl" else merger.mlp[-1]
    last.weight = last.weight * 8
    return config, model


def _idefics3(path: Path, tok, family: str, seed: int):
    """Idefics3, or SmolVLM: Idefics3's model under its own name and processor."""
    import importlib

    module = importlib.import_module(f"mlx_vlm.models.{family}")
    processor = "Idefics3Processor" if family == "idefics3" else "SmolVLMProcessor"
    # Images resized to 112 x 112 (no splitting into tiles): 8 x 8 patches of
    # 14 pixels, shuffled 2 x 2 into 16 image tokens between <fake_token_around_image>s.
    (path / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": processor.replace("Processor", "ImageProcessor"),
        "processor_class": processor,
        "do_resize": True,
        "size": {"longest_edge": 112},
        "max_image_size": {"longest_edge": 112},
        "do_image_splitting": False,
        **NORMALIZE,
        "do_pad": True,
    }))
    (path / "processor_config.json").write_text(json.dumps({"processor_class": processor, "image_seq_len": 16}))
    text = {"model_type": "llama", **TEXT_CONFIG, "vocab_size": tok.get_vocab_size()}
    vision = {"model_type": "idefics3" if family == "idefics3" else "smolvlm_vision", "hidden_size": 32,
              "num_attention_heads": 2, "patch_size": PATCH_SIZE, "num_hidden_layers": 2, "intermediate_size": 64,
              "image_size": 112}
    config = {
        "model_type": family, "image_token_id": tok.token_to_id("<image>"), "scale_factor": 2,
        "vocab_size": tok.get_vocab_size(), "eos_token_id": tok.token_to_id("<|im_end|>"),
        "text_config": text, "vision_config": vision,
    }
    model = _random_model(module, config, text, vision, seed)
    connector = model.connector.modality_projection.proj
    connector.weight = connector.weight * 8
    return config, model


def _gemma3(path: Path, tok, family: str, seed: int):
    from mlx_vlm.models import gemma3

    # 28 x 28 images, 2 x 2 patches of 14 pixels: 4 image tokens.
    (path / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Gemma3ImageProcessor",
        "processor_class": "Gemma3Processor",
        "do_resize": True,
        "size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        **NORMALIZE,
        "do_pan_and_scan": False,
    }))
    (path / "processor_config.json").write_text(json.dumps({"processor_class": "Gemma3Processor", "image_seq_length": 4}))
    # A sliding-window layer (window 128: prompts fit, long answers wrap it)
    # beside a global one, as Gemma 3 has.
    text = {"model_type": "gemma3_text", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "query_pre_attn_scalar": 16,
            "sliding_window": 128, "sliding_window_pattern": 2, "mm_tokens_per_image": 4,
            "vocab_size": tok.get_vocab_size(), "max_position_embeddings": 2048}
    vision = {"model_type": "siglip_vision_model", "num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64,
              "num_attention_heads": 2, "patch_size": PATCH_SIZE, "image_size": IMAGE_SIZE}
    config = {
        "model_type": "gemma3", "image_token_index": tok.token_to_id("<image_soft_token>"), "hidden_size": 64,
        "pad_token_id": tok.token_to_id("<|endoftext|>"), "vocab_size": tok.get_vocab_size(),
        "eos_token_id": tok.token_to_id("<|im_end|>"), "text_config": text, "vision_config": vision,
    }
    model = _random_model(gemma3, config, text, vision, seed)
    # mlx-vlm starts the projection at all ones (a checkpoint sets it), which
    # would give every image the same features.
    projector = model.multi_modal_projector
    projector.mm_input_projection_weight = mx.random.normal(projector.mm_input_projection_weight.shape) * 8
    return config, model


def _mistral3(path: Path, tok, family: str, seed: int, ministral3: bool = False):
    from mlx_vlm.models import mistral3

    # Pixtral's processor keeps an image's aspect within a longest edge of 112
    # pixels, in 28-pixel cells (14-pixel patches merged 2 x 2): a row of image
    # tokens ends with [IMG_BREAK], the image with [IMG_END].
    (path / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "PixtralImageProcessor",
        "processor_class": "PixtralProcessor",
        "patch_size": {"height": PATCH_SIZE, "width": PATCH_SIZE},
        "size": {"longest_edge": 112},
        "do_resize": True,
        **NORMALIZE,
    }))
    (path / "processor_config.json").write_text(json.dumps({
        "processor_class": "PixtralProcessor", "patch_size": PATCH_SIZE, "spatial_merge_size": 2,
        "image_token": "[IMG]", "image_break_token": "[IMG_BREAK]", "image_end_token": "[IMG_END]",
    }))
    text = {"model_type": "mistral", **TEXT_CONFIG, "head_dim": 16, "rope_theta": 10000.0,
            "vocab_size": tok.get_vocab_size()}
    if ministral3:  # Llama 4's attention scaling, past a small original context for positions to tell apart
        text |= {"model_type": "ministral3", "rope_parameters": {
            "rope_type": "default", "rope_theta": 10000.0, "llama_4_scaling_beta": 0.5,
            "original_max_position_embeddings": 8}}
    vision = {"model_type": "pixtral", "num_hidden_layers": 2, "hidden_size": 32, "head_dim": 16,
              "intermediate_size": 64, "num_attention_heads": 2, "image_size": 112, "patch_size": PATCH_SIZE,
              "num_channels": 3}
    config = {
        "model_type": "mistral3", "image_token_index": tok.token_to_id("[IMG]"), "spatial_merge_size": 2,
        "vision_feature_layer": -1, "multimodal_projector_bias": False, "vocab_size": tok.get_vocab_size(),
        "eos_token_id": tok.token_to_id("<|im_end|>"), "text_config": text, "vision_config": vision,
    }
    model = _random_model(mistral3, config, text, vision, seed)
    projector = model.multi_modal_projector.linear_2
    projector.weight = projector.weight * 8
    return config, model


def processed(processor, messages: list[dict], image) -> tuple[list[int], dict[str, np.ndarray]]:
    """`messages` with `image` through the model's processor: the prompt's
    tokens and the image's arrays, as the gateway sends them to the worker."""
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    out = processor(text=[text], images=[image], return_tensors="np", add_special_tokens=False)
    arrays = {name: np.ascontiguousarray(value) for name, value in out.items() if name not in PROMPT_ARRAYS}
    return out["input_ids"][0].tolist(), arrays

