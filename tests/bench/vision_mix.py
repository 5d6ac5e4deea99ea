"""Vision requests beside text traffic, through `mlxd serve`.

    python -m tests.bench.vision_mix [--model VLM_DIR | --family F] [--text-users 8] [--vision-users 4]

Two phases in one run, streaming chat completions with the harness's load
generator: text users alone, then the same text users with vision users
beside them (each vision request a new random image, so nothing comes from
the prefix cache). Reports text throughput and inter-token latency in both
phases (and their ratios), vision throughput and time to first token; then
the time to first token of new images against the same images asked about
again behind another system prompt (the image feature cache). Default model:
a tiny random-weight one built like the tests' (--family llava, qwen2_vl or
qwen2_5_vl; serving overhead dominates), or with --qwen2-vl-size a larger
random Qwen2-VL (small for a CPU, 2b for a GPU).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import os
import tempfile
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

from tests.bench.load import Client, Result, one_request, pct
from tests.bench.serve_speed import start

TEXT = [{"role": "user", "content": "Write a long story about a lighthouse keeper and the sea."}]


def image_messages(seed: int, size: int, system: str = "") -> list[dict]:
    pixels = (np.random.default_rng(seed).random((size, size, 3)) * 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    url = "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()
    return [{"role": "system", "content": system}] * bool(system) + [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                     {"type": "text", "text": "Describe this picture in detail."}]}]


async def repeated_images(url: str, model: str, args) -> tuple[Result, Result]:
    """Each of `requests // 4` new images asked about alone, then again behind
    another system prompt (so the prefix cache holds nothing past that
    prompt): time to first token without and with the worker's image feature
    cache, nothing else running."""
    first, again = Result(), Result()
    client = Client(url)
    try:
        for i in range(args.requests // 4):
            for system, result in (("Answer briefly.", first), ("Answer at length.", again)):
                extra = {"messages": image_messages(5000 + i, args.image_size, system), "ignore_eos": True}
                await one_request(client, model, 2, extra, result)
    finally:
        client.close()
    return first, again


async def users(client: Client, model: str, count: int, requests: int, tokens: int,
                messages, result: Result) -> None:
    queue = list(range(requests))

    async def user() -> None:
        while queue:
            i = queue.pop()
            extra = {"messages": messages(i), "ignore_eos": True}
            await one_request(client, model, tokens, extra, result)

    await asyncio.gather(*(user() for _ in range(count)))


async def phase(url: str, model: str, args, with_vision: bool) -> tuple[Result, Result]:
    text, vision = Result(), Result()
    client = Client(url)
    jobs = [users(client, model, args.text_users, args.requests, args.tokens, lambda _: TEXT, text)]
    if with_vision:
        # Encoded before the clock starts: PNG-encoding random pixels on the
        # load generator's loop would stall its reading of the text streams.
        bodies = [image_messages(1000 + i, args.image_size) for i in range(args.requests // 2)]
        jobs.append(users(client, model, args.vision_users, args.requests // 2, args.tokens,
                          bodies.__getitem__, vision))
    loop = asyncio.get_running_loop()
    begin = loop.time()
    try:
        await asyncio.gather(*jobs)
    finally:
        client.close()
    text.wall = vision.wall = loop.time() - begin
    return text, vision


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="", help="a vision-language model directory (default: a tiny random one)")
    parser.add_argument("--family", default="llava", help="the tiny random model's family (tests/tiny_vision_model.py)")
    parser.add_argument("--qwen2-vl-size", choices=["small", "2b"],
                        help="a larger random Qwen2-VL instead of a tiny one (tests/tiny_vision_model.py)")
    parser.add_argument("--text-users", type=int, default=8)
    parser.add_argument("--vision-users", type=int, default=4)
    parser.add_argument("--requests", type=int, default=32, help="text requests per phase (vision: half as many)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--image-size", type=int, default=224)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if not model_dir:
            from tests.tiny_vision_model import make_tiny_vision_model

            if args.qwen2_vl_size:
                args.family = "qwen2_vl"
            model_dir = str(make_tiny_vision_model(Path(tmp) / "tiny-vision", family=args.family,
                                                   qwen2_vl_size=args.qwen2_vl_size))
        proc, url, _ = start(model_dir, dict(os.environ))
        try:
            model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
            asyncio.run(phase(url, model, argparse.Namespace(**{**vars(args), "requests": 8}), True))  # warm-up
            alone, _ = asyncio.run(phase(url, model, args, False))
            beside, vision = asyncio.run(phase(url, model, args, True))
            first, again = asyncio.run(repeated_images(url, model, args))
        finally:
            proc.terminate()
            proc.wait()
    size = args.qwen2_vl_size or "tiny"
    print(f"model: {args.model or f'{size} random {args.family} (tests/tiny_vision_model.py)'}; "
          f"{args.tokens} tokens a request; "
          f"{args.text_users} text users, {args.vision_users} vision users ({args.image_size}x{args.image_size} PNG)")
    print("| traffic | text tok/s | vision tok/s | vision requests/s | vision TTFT p50/p99 ms | text ITL p50/p99 ms "
          "| failures |")
    print("|---|---|---|---|---|---|---|")
    print(f"| text alone | {alone.tok_s:.0f} | – | – | – | {pct(alone.itls, .5):.1f} / {pct(alone.itls, .99):.1f} "
          f"| {alone.failures} |")
    vision_requests = len(vision.ttfts) / vision.wall if vision.wall else 0
    print(f"| text + vision | {beside.tok_s:.0f} | {vision.tok_s:.0f} | {vision_requests:.1f} | "
          f"{pct(vision.ttfts, .5):.0f} / {pct(vision.ttfts, .99):.0f} | "
          f"{pct(beside.itls, .5):.1f} / {pct(beside.itls, .99):.1f} | {beside.failures + vision.failures} |")
    print(f"text throughput beside vision: {beside.tok_s / alone.tok_s:.2f}x of text alone; "
          f"all traffic: {(beside.tok_s + vision.tok_s) / alone.tok_s:.2f}x; "
          f"text ITL p99 beside vision: {pct(beside.itls, .99) / pct(alone.itls, .99):.2f}x of text alone")
    print(f"an image seen before, behind another system prompt (image feature cache): TTFT p50 "
          f"{pct(again.ttfts, .5):.1f} ms against {pct(first.ttfts, .5):.1f} ms the first time "
          f"({len(first.ttfts)} images, nothing else running)")


if __name__ == "__main__":
    main()
