"""How much of an embeddings request the worker embeds between two steps: as
many inputs as the step's budget holds at what an input costs, a forward
pass's own cost counted (many short inputs are not cheap); an input that
alone costs more than the budget, in parts."""

import math

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load

from protocol import Embed
from worker.embed import Embedder, Pooling
from worker.serve import EmbeddingJob, input_seconds


def job(*lengths: int) -> EmbeddingJob:
    return EmbeddingJob(Embed("e", [list(range(n)) for n in lengths]))


def whole(left: int) -> int:
    return left


def test_untimed_a_piece_is_one_input():
    assert len(job(5, 5, 5).next_piece(input_seconds([]), 1.0, whole).inputs) == 1


def test_a_forward_pass_costs_something_whatever_its_length():
    # As on a GPU: 10 ms a pass, next to nothing a token. A per-token pace alone (the
    # slope, 10 µs a token) would put the budget's 5,000 five-token inputs in one piece.
    cost = input_seconds([(2000, 0.030), (100, 0.011), (1000, 0.020)])
    assert 0.009 < cost(0) < 0.011 and math.isclose(cost(1000) - cost(0), 0.010, rel_tol=0.05)
    assert len(job(*[5] * 100).next_piece(cost, 0.05, whole).inputs) == 4


def test_with_nothing_decoding_a_piece_is_a_prefill_chunk_of_tokens():
    pieces = job(30, 30, 30, 30)
    assert [len(i) for i in pieces.next_piece(float, 64, whole).inputs] == [30, 30]
    pieces.embedded = 3
    assert [len(i) for i in pieces.next_piece(float, 64, whole).inputs] == [30]


def test_an_input_longer_than_the_budget_goes_in_parts_that_make_it_up():
    """It was one piece however long: an input of a whole context stopped every stream for its forward pass."""
    pieces = job(10, 150, 10)
    first = pieces.next_piece(float, 64, lambda left: min(64, left))
    assert [len(i) for i in first.inputs] == [10] and first.ends and not first.continues
    assert not pieces.done(first, [np.ones(4, "<f4")])
    parts = []
    while pieces.embedded == 1:
        part = pieces.next_piece(float, 64, lambda left: min(64, left))
        parts.append(part)
        assert not pieces.done(part, [np.ones(4, "<f4")] if part.ends else [])
    assert [len(p.inputs[0]) for p in parts] == [64, 64, 22]
    assert [(p.continues, p.ends) for p in parts] == [(False, False), (True, False), (True, True)]
    assert sum((p.inputs[0] for p in parts), []) == list(range(150))
    last = pieces.next_piece(float, 64, lambda left: min(64, left))
    assert [len(i) for i in last.inputs] == [10] and pieces.done(last, [np.ones(4, "<f4")])


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return load(str(tiny_model))[0]


@pytest.mark.parametrize("mode", ["last", "mean", "first"])
def test_an_input_read_in_parts_has_the_vector_of_one_read_whole(tiny, mode):
    embedder = Embedder(tiny, Pooling(mode))
    ids = [(7 * i) % 380 + 3 for i in range(300)]
    expected = embedder.read(ids)
    assert embedder.read(ids[:100], ends=False) is None
    assert embedder.read(ids[100:132], continues=True, ends=False) is None
    vector = embedder.read(ids[132:], continues=True)
    assert vector is not None
    np.testing.assert_allclose(vector, expected, rtol=0, atol=1e-5)
    hidden = tiny.model(mx.array([ids]))[0].astype(mx.float32)
    pooled = {"last": hidden[-1], "mean": hidden.mean(axis=0), "first": hidden[0]}[mode]
    np.testing.assert_allclose(expected, np.array(pooled / mx.linalg.norm(pooled)), rtol=0, atol=1e-6)


def test_first_token_pooling_reads_only_the_part_that_holds_the_first_token(tiny):
    embedder = Embedder(tiny, Pooling("first"))
    ids = [(5 * i) % 380 + 3 for i in range(200)]
    expected = embedder.read(ids)
    calls = []
    transformer = embedder.transformer
    embedder.transformer = lambda *args, **kwargs: calls.append(args) or transformer(*args, **kwargs)
    embedder.read(ids[:50], ends=False)
    embedder.read(ids[50:120], continues=True, ends=False)
    vector = embedder.read(ids[120:], continues=True)
    assert len(calls) == 1  # a causal model's first hidden state never sees the later parts
    np.testing.assert_allclose(vector, expected, rtol=0, atol=1e-5)
