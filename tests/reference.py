"""Greedy decoding with mlx-lm in-process: the reference for parity tests."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler

from worker.model import dequantize_for_cpu


@dataclass
class Expected:
    token_ids: list[int]  # generated, stop token included if one was hit
    text: str  # what a client must see
    finish_reason: str
    logprobs: list = None  # mlx-lm's log-softmax at each generated position


class Reference:
    def __init__(self, path: Path) -> None:
        self.model, self.tokenizer = load(str(path))
        # The same model the worker serves on the CPU backend.
        dequantize_for_cpu(self.model)

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)

    def text_prompt(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer._tokenizer.decode(
            token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False
        )

    def token_text(self, token_id: int) -> str:
        """A token as logprobs name it: a special token as itself (`<|im_end|>`)."""
        return self.tokenizer._tokenizer.decode([token_id], skip_special_tokens=False,
                                                clean_up_tokenization_spaces=False)

    def greedy(self, prompt: list[int], max_tokens: int, ignore_eos: bool = False, processors=None) -> Expected:
        tokens: list[int] = []
        finish = "length"
        logprobs = []
        for token, token_logprobs in generate_step(
            mx.array(prompt), self.model, max_tokens=max_tokens, sampler=make_sampler(0.0),
            logits_processors=processors,
        ):
            tokens.append(int(token))
            logprobs.append(token_logprobs)
            if not ignore_eos and int(token) in self.tokenizer.eos_token_ids:
                finish = "stop"
                break
        text_tokens = tokens[:-1] if finish == "stop" else tokens
        return Expected(tokens, self.decode(text_tokens), finish, logprobs)


class VisionReference:
    """mlx-vlm in-process, on the inputs the model's processor makes:
    transformers' where it runs without PyTorch, else mlx-vlm's own (never the
    gateway's)."""

    def __init__(self, path: Path) -> None:
        import transformers
        from mlx_vlm import load as load_vlm

        self.model, self._vlm_processor = load_vlm(str(path))
        # By its class: importing mlx-vlm patches transformers' AutoProcessor.
        processor_class = json.loads((path / "preprocessor_config.json").read_text())["processor_class"]
        try:
            self.processor = getattr(transformers, processor_class).from_pretrained(str(path))
        except ImportError:  # it needs PyTorch (Qwen-VL's video half, Pixtral's): mlx-vlm's own
            self.processor = self._vlm_processor
            if self.processor.chat_template is None:  # mlx-vlm's Mistral 3 processor does not read it
                self.processor.chat_template = json.loads((path / "chat_template.json").read_text())["chat_template"]
        self.tokenizer = self.processor.tokenizer
        config = self.model.config
        self.image_token_id = getattr(config, "image_token_index", None) or config.image_token_id

    def inputs(self, messages: list[dict], images: list) -> dict:
        text = self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        if not images:
            return {"input_ids": mx.array([self.tokenizer.encode(text, add_special_tokens=False)])}
        out = self.processor(text=[text], images=images, return_tensors="np", add_special_tokens=False)
        # The attention mask goes in as `mask`, as mlx-vlm's own generate passes it.
        return {"mask" if name == "attention_mask" else name: mx.array(value) for name, value in out.items()
                if name != "mm_token_type_ids"}

    def greedy(self, messages: list[dict], images: list, max_tokens: int, ignore_eos: bool = False) -> Expected:
        """mlx-vlm's own generation loop; it ends at EOS without yielding it
        (so token_ids never hold the EOS)."""
        from mlx_vlm.generate import stream_generate

        criteria = self._vlm_processor.tokenizer.stopping_criteria
        eos = criteria.eos_token_ids
        if ignore_eos:  # set directly: reset([]) keeps the config's additional EOS ids
            criteria.eos_token_ids = []
        try:
            tokens = [int(r.token) for r in stream_generate(self.model, self._vlm_processor, "", max_tokens=max_tokens,
                                                            temperature=0.0, **self.inputs(messages, images))]
        finally:
            criteria.eos_token_ids = eos
        # The loop may run one token past max_tokens.
        finish = "length" if len(tokens) >= max_tokens else "stop"
        tokens = tokens[:max_tokens]
        text = self.tokenizer.decode(tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        return Expected(tokens, text, finish)
