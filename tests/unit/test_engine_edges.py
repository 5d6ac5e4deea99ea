"""The engine at its edges, in-process on the tiny model: a constrained
request resumed part-way through its answer, a finished grammar's end, and a
step that fails part-way."""

from __future__ import annotations

import gc

import llguidance
import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from gateway.ledger import batch_kv
from protocol import AddRequest, Sampling
from worker.engine import Engine
from worker.footprint import kv_footprint, probe_cache
from worker.grammar import Grammars
from worker.model import load_model
from worker.prefix_cache import PrefixCache

SENTENCE = "The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def loaded(tiny_model):
    return load_model(str(tiny_model))


def engine_for(loaded, prefix_cache: PrefixCache | None = None) -> Engine:
    return Engine(loaded.model, eos_token_ids=loaded.eos_token_ids, vocab_size=loaded.vocab_size,
                  context_length=512, capacity=8, prefill_batch_size=4, prefill_step_size=64,
                  grammars=Grammars(loaded.hf_tokenizer, loaded.vocab_size, loaded.eos_token_ids),
                  prefix_cache=prefix_cache)


def answers(engine: Engine, *requests: AddRequest) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {r.request_id: [] for r in requests}
    for request in requests:
        engine.add(request)
    while engine.has_work:
        for output in engine.step():
            out[output.request_id] += output.token_ids
    return out


def test_a_finished_grammar_lets_the_model_end_with_any_of_its_end_tokens(loaded):
    """Qwen 3 and Llama 3 end a turn with the second of their two end tokens
    (<|im_end|>, <|eot_id|>): only the first was allowed once a grammar was done."""
    tokenizer = loaded.hf_tokenizer
    ends = sorted(tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>"))
    done = tokenizer.encode("Hi", add_special_tokens=False)
    processor = Grammars(tokenizer, loaded.vocab_size, ends).processor(llguidance.grammar_from("lark", 'start: "Hi"'),
                                                                       done)
    logits = processor(mx.array(done), mx.zeros((1, loaded.vocab_size)))
    assert mx.isfinite(logits[0]).tolist().count(True) == 2
    assert [i for i in ends if mx.isfinite(logits[0, i]).item()] == ends


def test_a_constrained_request_resumed_part_way_goes_on_where_it_was(loaded):
    """A worker lost mid-answer: the gateway sends the prompt with the tokens
    so far to the next one, whose grammar must start past them."""
    grammar = llguidance.grammar_from("lark", f'start: "{SENTENCE}"')
    prompt = loaded.hf_tokenizer.encode("Once upon a time")
    whole = answers(engine_for(loaded), AddRequest("a", prompt, Sampling(max_tokens=40, grammar=grammar)))["a"]
    assert loaded.hf_tokenizer.decode(whole, skip_special_tokens=True) == SENTENCE
    for k in (1, 3, len(whole) - 2):
        rest = answers(engine_for(loaded), AddRequest("a", prompt + whole[:k], Sampling(max_tokens=40 - k, grammar=grammar),
                                                      generated_tokens=k))["a"]
        assert whole[:k] + rest == whole


def test_a_seeded_sampled_request_resumed_part_way_goes_on_as_it_would_have(loaded):
    """The same seed gives the same tokens: a resumed request's next token
    takes the random key it would have taken (it took the first key again)."""
    prompt = loaded.hf_tokenizer.encode("Once upon a time")
    sampling = Sampling(max_tokens=16, temperature=1.5, seed=7, ignore_eos=True)
    whole = answers(engine_for(loaded), AddRequest("a", prompt, sampling))["a"]
    assert len(set(whole)) > 4  # sampled, not one token over and over
    k = 6
    rest = answers(engine_for(loaded), AddRequest("a", prompt + whole[:k], Sampling(
        max_tokens=16 - k, temperature=1.5, seed=7, ignore_eos=True), generated_tokens=k))["a"]
    assert whole[:k] + rest == whole


def test_requests_of_one_grammar_each_follow_it_from_its_start(loaded):
    """The grammar is compiled once and each request gets a fresh copy of it
    (a matcher shared between them would have one start past the other's tokens)."""
    grammar = llguidance.grammar_from("lark", f'start: "{SENTENCE}"')
    prompt = loaded.hf_tokenizer.encode("Once upon a time")
    engine = engine_for(loaded)
    together = answers(engine, *(AddRequest(r, prompt, Sampling(max_tokens=40, grammar=grammar)) for r in "ab"))
    later = answers(engine, AddRequest("c", prompt, Sampling(max_tokens=40, grammar=grammar)))
    for tokens in [*together.values(), *later.values()]:
        assert loaded.hf_tokenizer.decode(tokens, skip_special_tokens=True) == SENTENCE


def test_tokens_off_the_grammar_are_refused_on_resuming(loaded):
    grammar = llguidance.grammar_from("lark", f'start: "{SENTENCE}"')
    prompt = loaded.hf_tokenizer.encode("Once upon a time")
    off = loaded.hf_tokenizer.encode("A cat", add_special_tokens=False)
    with pytest.raises(ValueError, match="do not follow"):
        engine_for(loaded).add(AddRequest("a", prompt + off, Sampling(max_tokens=8, grammar=grammar),
                                          generated_tokens=len(off)))


class FailingKeep(PrefixCache):
    """Filing the second finished request fails (as an out-of-memory would)."""

    def keep(self, tokens, cache, scope=""):
        self.kept = getattr(self, "kept", 0) + 1
        if self.kept == 2:
            raise MemoryError("filing a finished request's KV state")
        super().keep(tokens, cache, scope)


def test_a_step_that_fails_part_way_leaves_no_request_unanswered(loaded):
    """Two requests finish in the step that fails as the second is filed: the
    first, already filed, must still be among those the worker fails (its
    client gets an error, not silence); the one still running is failed too,
    and nothing of the failed step goes into the prefix cache."""
    cache = FailingKeep(1 << 30)
    engine = engine_for(loaded, cache)
    prompt = loaded.hf_tokenizer.encode("Once upon a time")
    for request_id, tokens in (("A", 2), ("B", 2), ("C", 50)):
        engine.add(AddRequest(request_id, prompt + [ord(request_id)],
                              Sampling(max_tokens=tokens, ignore_eos=True)))
    with pytest.raises(MemoryError):
        while True:
            engine.step()
    filed = len(cache._lru)
    assert sorted(engine.abort_all(failed=True)) == ["A", "B", "C"]
    assert len(cache._lru) == filed and not engine.has_work


@pytest.mark.parametrize(("order", "running"), [(("abort", "add"), True), (("add", "abort"), False)])
def test_a_request_aborted_and_added_again_in_one_batch_runs(loaded, tmp_path, order, running):
    """The worker reads its messages in batches and applies the aborts first:
    an add the batch aborts after it is dropped, but an add after its abort (a
    request the gateway took back and resumed there) must still run."""
    from protocol import Abort, Hello
    from protocol.worker_settings import WorkerSettings
    from worker.serve import Worker

    settings = WorkerSettings(model="tiny", worker_endpoint=f"ipc://{tmp_path}/nobody.sock")
    worker = Worker(settings, engine_for(loaded), Hello(1, 1, 1, "tiny", 512, loaded.vocab_size, 8, [], {}), None)
    try:
        add = AddRequest("a", loaded.hf_tokenizer.encode("Once upon a time"), Sampling(max_tokens=4))
        messages = {"abort": (Abort(["a"]), []), "add": (add, [])}
        worker.handle([messages[kind] for kind in order])
        assert worker.engine.has_work is running
    finally:
        worker._connection.close(linger=0)
        worker.socket.close(linger=0)
        worker._context.term()


def test_the_prefix_cache_holds_the_memory_it_counts(loaded):
    """A finished request's KV state is a copy of its row of the batch; left
    lazy, each entry held the batch's whole buffers (every row) as they were
    when it finished, where the budget counted one row."""
    mx.eval(loaded.model.parameters())
    gc.collect()
    mx.clear_cache()
    base = mx.get_active_memory()
    cache = PrefixCache(1 << 30)
    engine = Engine(loaded.model, eos_token_ids=loaded.eos_token_ids, vocab_size=loaded.vocab_size,
                    context_length=512, capacity=8, prefill_batch_size=8, prefill_step_size=512, prefix_cache=cache)
    prompts = [loaded.hf_tokenizer.encode(f"{i} {SENTENCE} " * 30)[:400] for i in range(8)]
    answers(engine, *[AddRequest(f"r{i}", p, Sampling(max_tokens=2 + 3 * i, ignore_eos=True))
                      for i, p in enumerate(prompts)])
    del engine
    gc.collect()
    mx.synchronize()
    mx.clear_cache()
    held = mx.get_active_memory() - base
    counted = cache.stats().bytes
    assert cache.stats().entries == 8 and counted > 0
    assert held <= 1.1 * counted, f"held {held} bytes for {counted} counted"


@pytest.mark.parametrize("temperature", [1e-39, 1e-45])
def test_a_vanishing_temperature_is_greedy(loaded, temperature):
    """1/T overflows float32 (or the scaled logits do): every token was -inf and the draw uniform."""
    prompt = loaded.hf_tokenizer.encode("Once upon a time")
    greedy = answers(engine_for(loaded), AddRequest("a", prompt, Sampling(max_tokens=12, ignore_eos=True)))["a"]
    cold = answers(engine_for(loaded), AddRequest("a", prompt, Sampling(max_tokens=12, ignore_eos=True,
                                                                        temperature=temperature, seed=3)))["a"]
    assert cold == greedy


def test_presence_and_frequency_penalties_count_the_completion_only(loaded):
    """OpenAI's penalties count the tokens sampled so far, not the prompt's; a request
    resumed part-way counts the tokens it had generated before as its own."""
    prompt = loaded.hf_tokenizer.encode(f"{SENTENCE} {SENTENCE}")
    plain = Sampling(max_tokens=1, logprobs=5, logit_bias={t: 3.0 for t in prompt})
    penalized = Sampling(max_tokens=1, logprobs=5, logit_bias={t: 3.0 for t in prompt},
                         presence_penalty=2.0, frequency_penalty=1.0)

    def first_logprobs(sampling: Sampling):
        engine = engine_for(loaded)
        engine.add(AddRequest("a", prompt, sampling))
        while engine.has_work:
            for output in engine.step():
                return output.logprobs[0]

    assert first_logprobs(penalized) == first_logprobs(plain)  # nothing generated yet: nothing to penalize

    def completion_penalties(tokens, logits):
        generated = tokens[len(prompt):]
        if len(generated):
            logits[:, generated] -= 2.0  # presence
            logits = logits.at[:, generated].subtract(1.0)  # frequency, once per occurrence
        return logits

    sampling = Sampling(max_tokens=24, ignore_eos=True, presence_penalty=2.0, frequency_penalty=1.0)
    expected = [int(t) for t, _ in generate_step(mx.array(prompt), loaded.model, max_tokens=24,
                                                 logits_processors=[completion_penalties])]
    assert answers(engine_for(loaded), AddRequest("a", prompt, sampling))["a"] == expected
    greedy = answers(engine_for(loaded), AddRequest("a", prompt, Sampling(max_tokens=24, ignore_eos=True)))["a"]
    assert greedy != expected  # the penalties changed the answer: they were applied
    k = 7
    resumed = answers(engine_for(loaded), AddRequest("a", prompt + expected[:k],
                                                     Sampling(max_tokens=24 - k, ignore_eos=True, presence_penalty=2.0,
                                                              frequency_penalty=1.0), generated_tokens=k))["a"]
    assert expected[:k] + resumed == expected


def test_the_ledgers_kv_charge_covers_what_the_batch_holds(loaded):
    """One long request beside seven short ones: mlx-lm pads the short rows to the long one's
    length, and the ledger charges what that holds (it charged the sum of the lengths, 7.5x less)."""
    footprint = kv_footprint(probe_cache(loaded.model))
    engine = Engine(loaded.model, eos_token_ids=loaded.eos_token_ids, vocab_size=loaded.vocab_size,
                    context_length=2048, capacity=8, prefill_batch_size=8, prefill_step_size=512)
    lengths, max_tokens = [1900] + [8] * 7, 16
    gc.collect()
    mx.clear_cache()
    base, held, relaid = mx.get_active_memory(), 0, 0
    for i, length in enumerate(lengths):
        engine.add(AddRequest(f"r{i}", [5 + j % 300 for j in range(length)], Sampling(max_tokens=max_tokens,
                                                                                     ignore_eos=True)))
    rows = []
    while engine.has_work:
        engine.step()
        mx.synchronize()
        now = mx.get_active_memory() - base
        rows.append(len(engine._generator._generation_batch))
        # A row joining or leaving copies every row's KV state (worker.joins), and MLX lets go of
        # the copy's sources once a later step has run: the batch's own is read once it has held still.
        if rows[-2:] == [rows[-1]] * 2:
            held = max(held, now)
        else:
            relaid = max(relaid, now)
    charged = batch_kv(footprint, [length + max_tokens for length in lengths])
    # Within a step's passing arrays (the ledger charges KV state, not a step's activations).
    assert held <= 1.1 * charged, f"the batch held {held} bytes, the ledger charged {charged}"
    # Until then the old layout and the new are both held (as they were inside the next step, when
    # the copy ran there: the peak is the same), and no more than that.
    assert relaid <= 2.2 * charged, f"a join's copy held {relaid} bytes, the ledger charged {charged}"
    assert held > 4 * sum(footprint.bytes_for(length + max_tokens) for length in lengths)  # the old charge
