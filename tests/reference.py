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
