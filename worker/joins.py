"""Requests join mlx-lm's running batch without a forward pass of their own.

mlx-lm's BatchGenerator moves a prefilled request into generation by running
the model once on its last prompt token, alone, in the step it joins: a
second forward pass in that step, which costs about as much as the batch's
own (a decode step is bound by reading the weights, not by its rows). Every
running stream waits for it; a vision request joining after its chunked
prefill doubled the text streams' gap. Here the joining rows enter the
running batch with that last token as their next input, so the batch's next
step computes it with everyone else's. That step returns the prompt's last
token for them, which is not generated and is dropped here: a joining
request's first token comes one step later, and nobody's step grows.

Tied to mlx-lm's batch internals (mlx-lm is pinned; the engine's parity
tests against mlx-lm cover this path).
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, GenerationBatch, PromptProcessingBatch, StopSequences
from mlx_lm.models.cache import BatchKVCache, KVCache

# Prompts up to this long, of a request that arrived alone, are prefilled
# without waiting for the pass (see _Prompts.prompt).
UNAWAITED_PROMPT_TOKENS = 512

# The log-probabilities of the step that returns a joining row's last prompt
# token; that step's output for the row is dropped, so nothing reads them.
_UNREAD = mx.array(0.0)


class _PromptEndUnseen(StopSequences.Matcher):
    """A stop matcher that lets the row's first returned token (its last
    prompt token) pass, as mlx-lm's own join never shows it to the matcher."""

    def __init__(self, matcher: StopSequences.Matcher) -> None:
        super().__init__(matcher._root)
        self._prompt_end = True

    def advance(self, token: int) -> bool:
        if self._prompt_end:
            self._prompt_end = False
            return False
        return super().advance(token)


class _Joining(GenerationBatch):
    """Rows about to join, built without GenerationBatch's first step."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        n = len(self.uids)
        self._next_logprobs = [_UNREAD] * n
        self._num_tokens = [-1] * n  # the prompt's last token, returned first, is not counted
        self._matchers = [_PromptEndUnseen(m) for m in self._matchers]

    def _step(self) -> tuple[list[int], list[mx.array]]:
        return [], []  # only ever called by __init__: the running batch steps these rows


class _Prompts(PromptProcessingBatch):
    """mlx-lm's prompt batch, handing over rows as _Joining."""

    def split(self, indices: list[int]) -> PromptProcessingBatch:
        """mlx-lm's split deep-copies the whole batch (every layer's KV state)
        and filters both copies. A request that arrived alone moves on alone,
        and is handed over as it is: that copy was about half a decode step of
        every such join. (One row merged and prefilled alone has no left
        padding, so the filter, which trims what every row pads, had nothing
        to trim.)"""
        if len(self.uids) != 1 or indices != [0]:
            return super().split(indices)
        leaving = self.__class__.__new__(self.__class__)
        leaving.__dict__.update(self.__dict__)
        self._let_go()
        return leaving

    def prompt(self, tokens: list[list[int]]) -> None:
        """A short prompt of a request that arrived alone is run without
        waiting for the pass: mlx-lm's own evaluates it there and then, which
        holds back the tokens the step already decoded and leaves the GPU idle
        while the next step is built. Longer passes keep mlx-lm's way, which
        gives their activations back to the system at once."""
        if len(tokens) != 1 or len(tokens[0]) > UNAWAITED_PROMPT_TOKENS:
            return super().prompt(tokens)
        self.tokens[0] += tokens[0]
        self.model(mx.array(tokens), cache=self.prompt_cache)
        mx.async_eval([c.state for c in self.prompt_cache])

    def generate(self, tokens: list[list[int]]) -> GenerationBatch:
        if any(len(t) > 1 for t in tokens):
            self.prompt([t[:-1] for t in tokens])
        joining = _Joining(
            self.model, self.uids, mx.array([t[-1] for t in tokens], dtype=mx.uint32), self.prompt_cache,
            self.tokens, self.samplers, self.fallback_sampler, self.logits_processors, self.stop_sequences,
            self.max_tokens,
        )
        self._let_go()
        return joining

    def _let_go(self) -> None:
        """Empty of rows: they have moved on, and these lists are theirs now."""
        self.uids, self.prompt_cache, self.tokens, self.stop_sequences = [], [], [], []
        self.samplers, self.logits_processors, self.max_tokens = [], [], []


class _Running(GenerationBatch):
    """mlx-lm's running batch, dropping what a joining row's first step returns."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._joined: set[int] = set()

    # A row joining or leaving re-lays out every row's KV state (mlx-lm
    # concatenates, pads and gathers). Started at once, that copy runs while
    # the turn goes on; left lazy, it ran inside the next decode step, which
    # every stream waits for. (Only in a step: an abort's filter stays lazy,
    # so that what the copy costs fails a step, which the worker survives.)
    def extend(self, batch: GenerationBatch) -> None:
        super().extend(batch)
        if isinstance(batch, _Joining):
            self._joined.update(batch.uids)
        self._start_layout()

    def _start_layout(self) -> None:
        mx.async_eval([c.state for c in self.prompt_cache], self._next_tokens)

    def next(self) -> list[GenerationBatch.Response]:
        rows = len(self.uids)
        responses = super().next()
        if 0 < len(self.uids) < rows:  # some finished and left
            self._start_layout()
        if self._joined:
            responses = [r for r in responses if r.uid not in self._joined]
            self._joined.clear()
        return responses


def running_kv_view(generator: BatchGenerator, uid: int) -> tuple[list, list[int]]:
    """A running request's KV state, each plain layer as views of the batch's
    arrays (no copy), and its tokens. mlx-lm's extract_cache copies the row's
    whole state, and any block of the copy costs the whole copy: the disk tier,
    which writes the blocks it does not hold yet, takes views instead."""
    batch = generator._generation_batch
    row = batch.uids.index(uid)
    layers = []
    for c in batch.prompt_cache:
        if type(c) is not BatchKVCache:
            layers.append(c.extract(row))
            continue
        start = int(c.left_padding[row])
        keys, values = c.keys, c.values
        assert keys is not None and values is not None  # the row is running: it has KV state
        view = KVCache()
        view.keys, view.values = keys[row:row + 1, :, start:c._idx], values[row:row + 1, :, start:c._idx]
        view.offset = c._idx - start
        layers.append(view)
    return layers, batch.tokens[row]


def fold_joins(generator: BatchGenerator) -> None:
    """Make a new (empty) BatchGenerator's joining requests ride its decode steps."""
    generator._prompt_batch = _Prompts.empty(
        generator.model, generator.sampler, prefill_step_size=generator.prefill_step_size
    )
    generator._generation_batch = _Running.empty(generator.model, generator.sampler)
