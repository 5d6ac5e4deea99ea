"""How much of an embeddings request the worker embeds between two steps: as
many inputs as the step's budget holds at what an input costs, a forward
pass's own cost counted (many short inputs are not cheap)."""

import math

from protocol import Embed
from worker.serve import EmbeddingJob, input_seconds


def job(*lengths: int) -> EmbeddingJob:
    return EmbeddingJob(Embed("e", [[7] * n for n in lengths]))


def test_untimed_a_piece_is_one_input():
    assert len(job(5, 5, 5).next_piece(input_seconds([]), 1.0).inputs) == 1


def test_a_forward_pass_costs_something_whatever_its_length():
    # As on a GPU: 10 ms a pass, next to nothing a token. A per-token pace alone (the
    # slope, 10 µs a token) would put the budget's 5,000 five-token inputs in one piece.
    cost = input_seconds([(2000, 0.030), (100, 0.011), (1000, 0.020)])
    assert 0.009 < cost(0) < 0.011 and math.isclose(cost(1000) - cost(0), 0.010, rel_tol=0.05)
    assert len(job(*[5] * 100).next_piece(cost, 0.05).inputs) == 4


def test_with_nothing_decoding_a_piece_is_a_prefill_chunk_of_tokens():
    pieces = job(30, 30, 30, 30)
    assert [len(i) for i in pieces.next_piece(float, 64).inputs] == [30, 30]
    pieces.embedded = 3
    assert [len(i) for i in pieces.next_piece(float, 64).inputs] == [30]
