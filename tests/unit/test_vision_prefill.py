"""A request with images is prefilled a piece per engine step (vision tower
blocks as a time budget allows, then a chunk of its prompt), with the running
requests decoding between the pieces; what it then writes equals mlx-vlm's
in-process answer.
The engine and mlx-vlm run here in-process, on the tiny fixtures."""

from __future__ import annotations

import json
import math

import mlx.core as mx
import numpy as np
import pytest
from PIL import Image

from protocol import AddRequest, Sampling, Tensor
from tests.reference import VisionReference
from tests.tiny_vision_model import make_tiny_vision_model, processed
from worker.engine import IMAGE_WORK_SHARE, Engine, InvalidRequest
from worker.prefix_cache import PrefixCache
from worker.tower import evaluate_in_pieces
from worker.vision import MIN_CHUNK, UnsupportedVisionModel, VisionPrefill, chunk_size, load_vision_model, token_seconds

CHUNK = 8
MESSAGES = [{"role": "user", "content": [
    {"type": "image"},
    {"type": "text", "text": "Describe the colours you see, then tell a long story about the capital of France."},
]}]


@pytest.fixture(scope="module", params=["llava", "qwen2_vl", "qwen3_vl", "gemma3"])
def vision_model(request, tmp_path_factory):
    return make_tiny_vision_model(tmp_path_factory.mktemp("models") / request.param, family=request.param)


@pytest.fixture(scope="module")
def reference(vision_model):
    return VisionReference(vision_model)


def engine_for(path, image_work_share: float = IMAGE_WORK_SHARE, prefix_cache: PrefixCache | None = None) -> Engine:
    model, image_token_id = load_vision_model(path)
    vision = VisionPrefill(model, image_token_id, CHUNK, None)
    return Engine(vision.language_model, eos_token_ids=[], vocab_size=model.config.vocab_size, context_length=2048,
                  capacity=8, prefill_batch_size=4, prefill_step_size=CHUNK, vision=vision,
                  image_work_share=image_work_share, prefix_cache=prefix_cache)


def add_image_request(engine: Engine, reference: VisionReference, image: Image.Image) -> int:
    """MESSAGES with `image` as request "image" (12 tokens); its prompt's length."""
    prompt, arrays = processed(reference.processor, MESSAGES, image)
    engine.add(AddRequest("image", prompt, Sampling(max_tokens=12, ignore_eos=True),
                          [Tensor(name, list(a.shape), a.dtype.name) for name, a in arrays.items()]),
               [memoryview(a).cast("B") for a in arrays.values()])
    return len(prompt)


def random_image(seed: int) -> Image.Image:
    return Image.fromarray((np.random.default_rng(seed).random((56, 84, 3)) * 255).astype(np.uint8))


def test_an_image_prefill_runs_in_pieces_between_decode_steps(vision_model, reference):
    engine = engine_for(vision_model, image_work_share=0.0)  # the least image work a step can hold
    engine.add(AddRequest("text", reference.tokenizer.encode("Once upon a time"),
                          Sampling(max_tokens=500, ignore_eos=True)))
    while not engine.step():
        pass  # until the text request decodes
    image = random_image(0)
    prompt_length = add_image_request(engine, reference, image)
    steps, answer = 0, []
    while not answer:
        outputs = {o.request_id: o for o in engine.step()}
        steps += 1
        assert "text" in outputs, f"step {steps} of the image prefill decoded nothing for the text request"
        answer = outputs["image"].token_ids if "image" in outputs else []
    # A piece per step (a tower block, the tower's end, a chunk of the prompt), then the step that joins the batch.
    assert steps >= (prompt_length - 1) // CHUNK
    while len(answer) < 12:
        answer += next((o.token_ids for o in engine.step() if o.request_id == "image"), [])
    assert answer == reference.greedy(MESSAGES, [image], 12, ignore_eos=True).token_ids


def test_a_step_with_time_to_spare_runs_more_of_the_image_work(vision_model, reference):
    engine = engine_for(vision_model, image_work_share=1e6)
    engine.add(AddRequest("text", reference.tokenizer.encode("Once upon a time"),
                          Sampling(max_tokens=500, ignore_eos=True)))
    for _ in range(5):  # plain decode steps, timed for the budget
        engine.step()
    image = random_image(3)
    add_image_request(engine, reference, image)
    steps, answer = 0, []
    while not answer:
        outputs = {o.request_id: o for o in engine.step()}
        steps += 1
        answer = outputs["image"].token_ids if "image" in outputs else []
    # The whole prefill in the first step, where it joins the batch; its last
    # prompt token goes through the batch's next step, its first token the one after.
    assert steps <= 3
    assert answer == reference.greedy(MESSAGES, [image], 1, ignore_eos=True).token_ids[:len(answer)]


def count_pieces(tape: list, budget: float) -> int:
    pieces, count = evaluate_in_pieces(tape, budget), 1
    try:
        next(pieces)
        while True:
            count += 1
            pieces.send(budget)
    except StopIteration:
        return count


def test_a_spent_budget_still_runs_a_block_per_piece():
    tape = [[mx.array([float(i)]) * 2] for i in range(4)]
    assert count_pieces(tape, 0.0) == 4
    assert count_pieces(tape, math.inf) == 1


def test_the_pieces_hold_one_blocks_outputs_not_every_blocks():
    """A large image's tower: twenty blocks of 4 MB each, run in pieces; once
    run, the memory the blocks' outputs hold is the last block's alone."""
    first = mx.zeros((1024, 1024))
    mx.eval(first)
    before = mx.get_active_memory()
    tape, x = [], first
    for _ in range(20):
        x = x * 1.0001 + 1
        tape.append([x])
    del x
    assert count_pieces(tape, 0.0) == 20
    assert mx.get_active_memory() - before <= 2 * first.nbytes


def test_the_budget_does_not_change_the_cache(vision_model, reference):
    model, image_token_id = load_vision_model(vision_model)
    vision = VisionPrefill(model, image_token_id, CHUNK, None)
    prompt, arrays = processed(reference.processor, MESSAGES, random_image(2))
    states = []
    for budget in (0.0, math.inf):
        pieces = vision.prefill(prompt, len(prompt), -1, arrays, None, 0)
        next(pieces)
        while True:
            try:
                pieces.send(budget)
            except StopIteration as finished:
                states.append(finished.value[0].state[0])
                break
    assert mx.array_equal(*states)


def test_a_request_aborted_while_its_image_prefills_is_gone(vision_model, reference):
    engine = engine_for(vision_model)
    add_image_request(engine, reference, random_image(1))
    assert engine.step() == [] and engine.waiting == 1  # its tower runs; it is still prefilling
    engine.abort(["image"])
    assert (engine.has_work, engine.waiting, engine.running) == (False, 0, 0)
    engine.add(AddRequest("text", reference.tokenizer.encode("Once upon a time"), Sampling(max_tokens=3)))
    tokens = []
    while engine.has_work:
        tokens += [t for o in engine.step() for t in o.token_ids]
    assert len(tokens) == 3


def test_state_left_by_an_abort_as_an_image_request_joins_answers_right(vision_model, reference):
    """Aborted in the step its prefill ends, before its last prompt token is
    fed, a request leaves KV state for all its prompt but that token: filed
    under as many tokens as it holds, it serves the same request again, whose
    answer is mlx-vlm's."""
    engine = engine_for(vision_model, prefix_cache=PrefixCache(1 << 30))
    image = random_image(2)
    prompt_length = add_image_request(engine, reference, image)
    while engine._requests["image"].uid is None:  # until it joins mlx-lm's batch
        assert engine.step() == []
    engine.abort(["image"])
    add_image_request(engine, reference, image)
    outputs = []
    while engine.has_work:
        outputs += engine.step()
    assert outputs[0].cached_tokens == prompt_length - 1
    assert [t for o in outputs for t in o.token_ids] == reference.greedy(MESSAGES, [image], 12, ignore_eos=True).token_ids


def test_tensors_the_model_cannot_take_fail_their_request_alone(vision_model, reference):
    """Shapes numpy or MLX will not build (65 dimensions): this request's
    error, and the engine goes on serving."""
    engine = engine_for(vision_model)
    prompt, _ = processed(reference.processor, MESSAGES, random_image(3))
    with pytest.raises(InvalidRequest, match="cannot take these inputs"):
        engine.add(AddRequest("bad", prompt, Sampling(max_tokens=4), [Tensor("pixel_values", [1] * 65, "float32")]),
                   [memoryview(bytes(4))])
    assert not engine.has_work
    add_image_request(engine, reference, random_image(4))
    while engine.has_work:
        engine.step()


def failing_image_work():
    yield  # built
    raise MemoryError("the tower ran out of memory")


def test_image_work_that_fails_fails_its_request_alone(vision_model, reference):
    """A failure in a request's image work (an out-of-memory in its tower)
    ends that request with the reason, not every request in the batch."""
    engine = engine_for(vision_model)
    engine.add(AddRequest("text", reference.tokenizer.encode("Once upon a time"), Sampling(max_tokens=6, ignore_eos=True)))
    add_image_request(engine, reference, random_image(5))
    failing = engine._prefilling[0][2]
    engine._prefilling[0] = (*engine._prefilling[0][:2], failing_image_work())
    next(engine._prefilling[0][2])
    failing.close()
    tokens = []
    while engine.has_work:
        tokens += [t for o in engine.step() if o.request_id == "text" for t in o.token_ids]
    assert [request_id for request_id, _ in engine.failed] == ["image"] and "out of memory" in engine.failed[0][1]
    assert len(tokens) == 6 and engine.waiting == engine.running == 0


def test_a_decode_step_is_timed_under_image_work_from_the_start(vision_model, reference):
    """Image requests arriving with the first text one: every step carries
    image work, and the first decode step is timed all the same, so that the
    image work gets a share of a step, not the least a piece can hold forever."""
    engine = engine_for(vision_model)
    engine.add(AddRequest("text", reference.tokenizer.encode("Once upon a time"), Sampling(max_tokens=50, ignore_eos=True)))
    add_image_request(engine, reference, random_image(6))
    while engine._prefilling:
        engine.step()
    assert engine._decode_seconds


def test_an_untested_family_is_refused_at_load_naming_the_served_ones(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "paligemma", "vision_config": {}}')
    with pytest.raises(UnsupportedVisionModel, match="'paligemma' vision model; mlxd serves the vision families "
                                                     "gemma3, idefics3, llava, mistral3, qwen2_5_vl, qwen2_vl, qwen3_vl, smolvlm"):
        load_vision_model(tmp_path)


@pytest.mark.parametrize("config", [
    {"model_type": "llava", "vision_config": {}, "model_file": "evil.py"},  # mlx-vlm would run it
    {"model_type": "llava", "vision_config": {}, "architectures": ["Lfm2BidirectionalForMaskedLM"]},
])
def test_a_config_that_makes_mlx_vlm_load_something_else_is_refused(tmp_path, config):
    (tmp_path / "evil.py").write_text("raise SystemExit('ran the model directory\'s code')")
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedVisionModel):
        load_vision_model(tmp_path)


def test_prompt_chunks_grow_where_a_token_adds_little_to_a_chunks_time():
    # Times from a GPU, where a forward pass costs about a decode step whatever
    # its size: 32 tokens 10.0 ms, 12 tokens 9.8 ms. A 5 ms budget then holds
    # far more tokens, tried at twice the largest chunk timed so far.
    assert token_seconds([(32, 0.0100), (12, 0.0098)]) == pytest.approx(0.00001)
    assert chunk_size(0.005, [(32, 0.0100), (12, 0.0098)], 2048, 1000) == 64
    assert chunk_size(0.005, [(32, 0.0100), (12, 0.0098), (64, 0.0103)], 2048, 1000) == 128
    assert chunk_size(0.005, [(32, 0.0100), (12, 0.0098), (64, 0.0103)], 2048, 100) == 100
    # Times from a CPU, where the time grows with the tokens: the budget's share.
    assert chunk_size(0.2, [(32, 0.16), (12, 0.06)], 2048, 1000) == 40
    assert chunk_size(0.005, [(32, 0.16), (12, 0.06)], 2048, 1000) == MIN_CHUNK
    # Nothing timed yet; nothing decoding (no budget); step_size caps.
    assert chunk_size(0.005, [], 2048, 1000) == MIN_CHUNK
    assert chunk_size(math.inf, [(32, 0.16)], 512, 1000) == 512
    assert chunk_size(10.0, [(32, 0.16)], 8, 1000) == 8
    # A tail shorter than MIN_CHUNK goes with the chunk before it (a step saved), within step_size.
    assert chunk_size(0.005, [], 2048, MIN_CHUNK + 15) == MIN_CHUNK + 15
    assert chunk_size(0.005, [], 2048, 2 * MIN_CHUNK) == MIN_CHUNK
    assert chunk_size(math.inf, [], 512, 520) == 512
