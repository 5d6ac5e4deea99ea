"""Greedy decoding with mlx-lm in-process: the reference for parity tests."""

from __future__ import annotations

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
    """mlx-vlm in-process, on the inputs the model's own processor makes (the
    processor the gateway runs: transformers' LLaVA processor)."""

    def __init__(self, path: Path) -> None:
        from mlx_vlm import load as load_vlm
        from transformers import LlavaProcessor

        self.model, self._vlm_processor = load_vlm(str(path))
        self.processor = LlavaProcessor.from_pretrained(str(path))
        self.tokenizer = self.processor.tokenizer

    def inputs(self, messages: list[dict], images: list) -> dict:
        text = self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        if not images:
            return {"input_ids": mx.array([self.tokenizer.encode(text, add_special_tokens=False)])}
        out = self.processor(text=[text], images=images, return_tensors="np", add_special_tokens=False)
        return {"input_ids": mx.array(out["input_ids"]), "pixel_values": mx.array(out["pixel_values"])}

    def greedy(self, messages: list[dict], images: list, max_tokens: int, ignore_eos: bool = False) -> Expected:
        """mlx-vlm's own generation loop; it ends at EOS without yielding it
        (so token_ids never hold the EOS)."""
        from mlx_vlm.generate import stream_generate

        criteria = self._vlm_processor.tokenizer.stopping_criteria
        eos = list(criteria.eos_token_ids)
        criteria.reset([] if ignore_eos else eos)
        try:
            tokens = [int(r.token) for r in stream_generate(self.model, self._vlm_processor, "", max_tokens=max_tokens,
                                                            temperature=0.0, **self.inputs(messages, images))]
        finally:
            criteria.reset(eos)
        # The loop may run one token past max_tokens.
        finish = "length" if len(tokens) >= max_tokens else "stop"
        tokens = tokens[:max_tokens]
        text = self.tokenizer.decode(tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        return Expected(tokens, text, finish)
