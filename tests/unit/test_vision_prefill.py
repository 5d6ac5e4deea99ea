"""A request with images is prefilled a piece per engine step (vision tower
blocks as a time budget allows, then a chunk of its prompt), with the running
requests decoding between the pieces; what it then writes equals mlx-vlm's
in-process answer.
The engine and mlx-vlm run here in-process, on the tiny fixtures."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from PIL import Image

from protocol import AddRequest, Sampling, Tensor
from tests.reference import VisionReference
from tests.tiny_vision_model import make_tiny_vision_model
from worker.engine import Engine
from worker.vision import UnsupportedVisionModel, VisionPrefill, load_vision_model

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


def engine_for(path) -> Engine:
    model, image_token_id = load_vision_model(path)
    vision = VisionPrefill(model, image_token_id, CHUNK, None)
    return Engine(vision.language_model, eos_token_ids=[], vocab_size=model.config.vocab_size, context_length=2048,
                  capacity=8, prefill_batch_size=4, prefill_step_size=CHUNK, vision=vision)


def processed(reference: VisionReference, image: Image.Image) -> tuple[list[int], dict[str, np.ndarray]]:
    """MESSAGES with `image`: the prompt's tokens and the image's tensors."""
    text = reference.processor.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    out = reference.processor(text=[text], images=[image], return_tensors="np", add_special_tokens=False)
    arrays = {name: np.ascontiguousarray(value) for name, value in out.items()
              if name not in ("input_ids", "attention_mask", "mm_token_type_ids")}
    return out["input_ids"][0].tolist(), arrays


def add_image_request(engine: Engine, reference: VisionReference, image: Image.Image) -> int:
    """MESSAGES with `image` as request "image" (12 tokens); its prompt's length."""
    prompt, arrays = processed(reference, image)
    engine.add(AddRequest("image", prompt, Sampling(max_tokens=12, ignore_eos=True),
                          [Tensor(name, list(a.shape), a.dtype.name) for name, a in arrays.items()]),
               [memoryview(a).cast("B") for a in arrays.values()])
    return len(prompt)


def random_image(seed: int) -> Image.Image:
    return Image.fromarray((np.random.default_rng(seed).random((56, 84, 3)) * 255).astype(np.uint8))


def test_an_image_prefill_runs_in_pieces_between_decode_steps(vision_model, reference):
    engine = engine_for(vision_model)
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
    # A chunk of the prompt per step, then the step that joins the batch.
    assert steps >= (prompt_length - 1) // CHUNK
    while len(answer) < 12:
        answer += next((o.token_ids for o in engine.step() if o.request_id == "image"), [])
    assert answer == reference.greedy(MESSAGES, [image], 12, ignore_eos=True).token_ids


def test_a_spent_budget_runs_the_tower_a_block_per_piece_to_the_same_cache(vision_model, reference):
    model, image_token_id = load_vision_model(vision_model)
    vision = VisionPrefill(model, image_token_id, CHUNK, None)
    prompt, arrays = processed(reference, random_image(2))
    runs = {}
    for budget in (0.0, math.inf):
        pieces = vision.prefill(prompt, len(prompt), -1, arrays, None, 0)
        next(pieces)
        count = 0
        while True:
            count += 1
            try:
                pieces.send(budget)
            except StopIteration as finished:
                runs[budget] = count, finished.value[0].state[0]
                break
    # Each block but the last its own piece; the last one runs with the tower's end.
    assert runs[0.0][0] - runs[math.inf][0] == len(vision.blocks) - 1
    assert mx.array_equal(runs[0.0][1], runs[math.inf][1])


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


def test_an_untested_family_is_refused_at_load_naming_the_served_ones(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "paligemma", "vision_config": {}}')
    with pytest.raises(UnsupportedVisionModel, match="'paligemma' vision model; mlxd serves the vision families "
                                                     "gemma3, idefics3, llava, mistral3, qwen2_5_vl, qwen2_vl, qwen3_vl, smolvlm"):
        load_vision_model(tmp_path)
