"""Text decoding beside image prefills inside the worker's engine, without HTTP.

    python -m tests.bench.vision_steps [--model VLM_DIR | --qwen2-vl-size small|2b] [--image-size 224]

The worker's Engine in this process keeps 8 text requests decoding (64
tokens each, each finished one replaced at once), first alone, then with 4
vision users beside them (each request a new random image). Reports text
inter-token latency p50/p99 in both phases and vision requests/s, twice: with
a step's image work held to the engine's share of a decode step
(IMAGE_WORK_SHARE), and unbounded (each piece runs the whole tower, then
whole prompt chunks). With no gateway or load generator on the same cores,
this is the worker's own part of what `vision_mix` measures end to end.
Default model: the small random Qwen2-VL (16 tower blocks 512 wide), whose
tower is compute-bound on a CPU as a real one is on a Mac.
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image
from transformers import AutoTokenizer

from worker.blas import load_fast_blas

load_fast_blas()  # before MLX loads

from gateway.tokenizer import load_processor  # noqa: E402
from protocol import AddRequest, Sampling, Tensor  # noqa: E402
from tests.bench.load import pct  # noqa: E402
from tests.tiny_vision_model import make_tiny_vision_model, processed  # noqa: E402
from worker.engine import IMAGE_WORK_SHARE, Engine  # noqa: E402
from worker.vision import VisionPrefill, load_vision_model  # noqa: E402

TEXT = "Write a long story about a lighthouse keeper and the sea."
MESSAGES = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe this picture in detail."}]}]
TOKENS = 64


class Traffic:
    """Requests in an engine: text users and vision users, each replaced when it finishes."""

    def __init__(self, engine: Engine, text_ids: list[int], images: list) -> None:
        self.engine, self.text_ids, self.images = engine, text_ids, images
        self.added = 0
        self.last_token: dict[str, float] = {}

    def add(self, kind: str) -> None:
        self.added += 1
        request_id, sampling = f"{kind}{self.added}", Sampling(max_tokens=TOKENS, ignore_eos=True)
        if kind == "text":
            self.engine.add(AddRequest(request_id, self.text_ids, sampling))
        else:
            prompt, arrays = self.images[self.added % len(self.images)]
            tensors = [Tensor(name, list(a.shape), a.dtype.name) for name, a in arrays.items()]
            self.engine.add(AddRequest(request_id, prompt, sampling, tensors),
                            [memoryview(a).cast("B") for a in arrays.values()])
        self.last_token[request_id] = math.nan

    def run(self, text_users: int, vision_users: int, steps: int) -> tuple[list[float], float]:
        """Text inter-token gaps (seconds) over `steps` steps, and vision requests finished a second."""
        for kind, users in (("text", text_users), ("image", vision_users)):
            for _ in range(users):
                self.add(kind)
        gaps, finished = [], 0
        begin = time.perf_counter()
        for _ in range(steps):
            outputs = self.engine.step()
            now = time.perf_counter()
            for out in outputs:
                kind = "text" if out.request_id.startswith("text") else "image"
                if kind == "text" and not math.isnan(self.last_token[out.request_id]):
                    gaps.append(now - self.last_token[out.request_id])
                self.last_token[out.request_id] = now
                if out.finish_reason is not None:
                    del self.last_token[out.request_id]
                    finished += kind == "image"
                    self.add(kind)
        wall = time.perf_counter() - begin
        self.engine.abort_all()
        self.last_token.clear()
        return gaps, finished / wall


def processed_images(model_dir: str, size: int, count: int) -> tuple[list[int], list]:
    """The text prompt's tokens, and `count` random images as (prompt, tensors) the way the gateway sends them."""
    processor = load_processor(model_dir, AutoTokenizer.from_pretrained(model_dir))
    images = [processed(processor, MESSAGES, Image.fromarray(
        (np.random.default_rng(seed).random((size, size, 3)) * 255).astype(np.uint8))) for seed in range(count)]
    return processor.tokenizer.encode(TEXT), images


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="", help="a vision-language model directory")
    parser.add_argument("--qwen2-vl-size", default="small", choices=["small", "2b"])
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--steps", type=int, default=400, help="engine steps per phase")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or str(make_tiny_vision_model(Path(tmp) / "vision", family="qwen2_vl",
                                                             qwen2_vl_size=args.qwen2_vl_size))
        text_ids, images = processed_images(model_dir, args.image_size, 32)
        model, image_token_id = load_vision_model(Path(model_dir))
        vision = VisionPrefill(model, image_token_id, 2048, None)
        print(f"model: {args.model or f'{args.qwen2_vl_size} random qwen2_vl (tests/tiny_vision_model.py)'}; "
              f"{args.image_size}x{args.image_size} images ({len(images[0][0])} prompt tokens); {TOKENS} tokens "
              f"a request; 8 text users, 4 vision users beside them; {args.steps} steps a phase")
        print("| image work a step | text ITL p50/p99 alone ms | beside vision ms | p99 ratio | vision requests/s |")
        print("|---|---|---|---|---|")
        for share in (IMAGE_WORK_SHARE, math.inf):
            engine = Engine(vision.language_model, eos_token_ids=[], vocab_size=model.config.vocab_size,
                            context_length=4096, capacity=32, prefill_batch_size=8, prefill_step_size=2048,
                            vision=vision, image_work_share=share)
            traffic = Traffic(engine, text_ids, images)
            traffic.run(8, 4, args.steps // 4)  # warm-up
            alone, _ = traffic.run(8, 0, args.steps)
            beside, vision_rate = traffic.run(8, 4, args.steps)
            label = f"{share:g} of a decode step" if share != math.inf else "unbounded"
            print(f"| {label} | {pct(alone, .5):.1f} / {pct(alone, .99):.1f} | {pct(beside, .5):.1f} / "
                  f"{pct(beside, .99):.1f} | {pct(beside, .99) / pct(alone, .99):.2f}x | {vision_rate:.2f} |")

if __name__ == "__main__":
    main()
