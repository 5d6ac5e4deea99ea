"""Structured output in the worker: an llguidance grammar masks each step's logits.

The gateway turns response_format (or a forced tool call) into an llguidance
grammar and validates it; the worker keeps one matcher per request and, as a
logits processor on the main thread, lets through only the tokens the grammar
allows next. llguidance rather than xgrammar: xgrammar requires PyTorch.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import cast

import llguidance
import llguidance.hf
import mlx.core as mx
import numpy as np
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask


class GrammarError(ValueError):
    pass


# Compiled grammars kept, each as a fresh matcher to copy: an agent sends the
# same schema or tools every turn, and a request's n choices share one. Compiling
# takes milliseconds to a third of a second (4,000 properties), on the main
# thread; a copy, under a millisecond.
COMPILED_GRAMMARS = 32


class Grammars:
    """Matchers for one model. Building its llguidance tokenizer takes about a
    second, so that happens on the first constrained request, not at start-up."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: list[int]) -> None:
        self._hf_tokenizer = hf_tokenizer
        self._vocab_size = vocab_size
        self._eos = eos_token_ids
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._unusable: str | None = None  # why llguidance could not take the tokenizer, once it failed
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()

    def processor(self, grammar: str, generated: list[int]):
        """A processor for `grammar`, past the tokens already `generated`
        under it (a request resumed on this worker after a lost one)."""
        matcher = self._matcher(grammar)
        if generated and not matcher.consume_tokens(generated):
            raise GrammarError(f"the tokens already generated do not follow it: {matcher.get_error()}")
        return GrammarProcessor(matcher, self._vocab_size)

    def _matcher(self, grammar: str) -> llguidance.LLMatcher:
        """A fresh matcher of `grammar`: a copy of the one compiled before, if it was."""
        if (compiled := self._compiled.get(grammar)) is not None:
            self._compiled.move_to_end(grammar)
            return compiled.deep_copy()
        if self._tokenizer is None:
            if self._unusable is not None:
                raise GrammarError(self._unusable)
            try:
                self._tokenizer = llguidance.hf.from_tokenizer(
                    self._hf_tokenizer, n_vocab=self._vocab_size, eos_token=self._eos or None
                )
            except Exception as e:  # llguidance cannot take it (a slow tokenizer, more tokens than the model has)
                self._unusable = f"this model's tokenizer cannot be held to a grammar: {e}"
                raise GrammarError(self._unusable) from None
        matcher = llguidance.LLMatcher(self._tokenizer, grammar)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        self._compiled[grammar] = matcher.deep_copy()
        if len(self._compiled) > COMPILED_GRAMMARS:
            self._compiled.popitem(last=False)
        return matcher


class GrammarProcessor:
    """A logits processor (mlx-lm's signature: (tokens so far, logits) -> logits)."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self._matcher = matcher
        self._bitmask = allocate_token_bitmask(1, vocab_size)
        self._started = False

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        if self._started:
            # The last token of the context is the one sampled at the previous step.
            self._matcher.consume_token(cast(int, tokens[-1].item()))
        self._started = True
        fill_next_token_bitmask(self._matcher, self._bitmask, 0)
        allowed = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")[: logits.shape[-1]]
        return mx.where(mx.array(allowed.astype(bool)), logits, -mx.inf)
