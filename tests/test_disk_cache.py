"""The prefix cache's disk tier (--prefix-cache-dir): KV state outlives the
worker, is read back only for the model that wrote it, and a damaged file
costs a prefill, never an answer."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import threading
import time

import httpx
import openai

from protocol.worker_settings import WorkerSettings
from tests.conftest import MLXD, ROOT, free_port, running, wait_for
from tests.tiny_model import make_tiny_model

SYSTEM = " ".join(f"Rule {i}: be brief." for i in range(80))  # ~1500 tokens: 5 blocks of 256
MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is the capital of France?"}]


def ask(srv) -> openai.types.chat.ChatCompletion:
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    return client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=16, temperature=0)


def serve_args(model, directory) -> list[str]:
    return ["serve", "--model", f"tiny={model}", "--prefix-cache-dir", str(directory), "--heartbeat-s", "0.05"]


def disk_tokens(srv) -> int:
    """The worker's count of prompt tokens read back from disk, once a heartbeat has brought its first lookup."""
    wait_for(lambda: srv.health()["worker"].get("prefix_cache", {}).get("lookups", 0) >= 1, 5, "prefix-cache stats")
    return srv.health()["worker"]["prefix_cache"]["disk_tokens"]


def blocks(directory) -> list:
    return sorted(directory.rglob("*.kv"))


def test_kv_state_outlives_the_worker_and_a_damaged_file_costs_only_a_prefill(tiny_model, reference, tmp_path):
    directory = tmp_path / "kv"
    prompt = reference.chat_prompt(MESSAGES)
    expected = reference.greedy(prompt, 16).text
    with running(serve_args(tiny_model, directory), tmp_path / "first.log") as srv:
        cold = ask(srv)
        wait_for(lambda: len(blocks(directory)) >= (len(prompt) + 16) // 256, 10, "blocks written")
    assert cold.usage.prompt_tokens_details.cached_tokens == 0 and cold.choices[0].message.content == expected
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert {stat.S_IMODE(f.stat().st_mode) for f in blocks(directory)} == {0o600}

    with running(serve_args(tiny_model, directory), tmp_path / "second.log") as srv:
        warm = ask(srv)
        restored = disk_tokens(srv)
        metrics = srv.http.get("/metrics").text
        worker = srv.health()["worker"]
    assert warm.usage.prompt_tokens_details.cached_tokens >= 0.8 * len(prompt)
    assert restored == warm.usage.prompt_tokens_details.cached_tokens
    labels = f'{{model="{worker["names"][0]}",pid="{worker["pid"]}"}}'
    assert f"mlxd_prefix_cache_disk_tokens_total{labels} {restored}\n" in metrics
    assert f"mlxd_prefix_cache_prefilled_tokens_total{labels} {len(prompt) - restored}\n" in metrics
    assert f"mlxd_prefix_cache_disk_budget_bytes{labels} {WorkerSettings().prefix_cache_disk_bytes}\n" in metrics
    assert warm.choices[0].message.content == expected

    damaged = {}
    for i, path in enumerate(blocks(directory)):
        data = bytearray(path.read_bytes())
        if i % 2:
            data[len(data) // 2] ^= 0xFF  # a flipped bit in the payload
        else:
            data = data[: len(data) // 3]  # truncated
        path.write_bytes(bytes(data))
        damaged[path] = bytes(data)

    def rewritten() -> bool:
        return any(path.exists() and path.read_bytes() != data for path, data in damaged.items())

    with running(serve_args(tiny_model, directory), tmp_path / "third.log") as srv:
        again = ask(srv)
        assert disk_tokens(srv) == 0
        # The first block read was dropped, then written again from this answer's state.
        wait_for(rewritten, 10, "a damaged block written again")
    assert again.usage.prompt_tokens_details.cached_tokens == 0
    assert again.choices[0].message.content == expected


def test_an_mrope_vision_models_blocks_come_back_after_a_restart(tmp_path):
    """Qwen2-VL's cache is mRoPE's kind of KVCache: it was taken for one the tier cannot keep, and its blocks
    were written and never read back."""
    from tests.reference import VisionReference
    from tests.tiny_vision_model import make_tiny_vision_model

    model = make_tiny_vision_model(tmp_path / "qwen2_vl", family="qwen2_vl")
    expected = VisionReference(model).greedy(MESSAGES, [], 16).text
    directory = tmp_path / "kv"
    with running(serve_args(model, directory), tmp_path / "first.log") as srv:
        assert ask(srv).choices[0].message.content == expected
        wait_for(lambda: len(blocks(directory)) >= 5, 10, "blocks written")
    with running(serve_args(model, directory), tmp_path / "second.log") as srv:
        warm = ask(srv)
        assert disk_tokens(srv) >= 5 * 256
    assert warm.usage.prompt_tokens_details.cached_tokens >= 5 * 256 and warm.choices[0].message.content == expected


def test_another_model_never_reads_the_blocks(tiny_model, reference, tmp_path):
    directory = tmp_path / "kv"
    whole_blocks = (len(reference.chat_prompt(MESSAGES)) + 16) // 256
    other = make_tiny_model(tmp_path / "other", seed=1)  # the same tokenizer, other weights
    with running(serve_args(tiny_model, directory), tmp_path / "first.log") as srv:
        ask(srv)
        wait_for(lambda: len(blocks(directory)) >= whole_blocks, 10, "blocks written")
    written = set(blocks(directory))
    with running(serve_args(other, directory), tmp_path / "other.log") as srv:
        response = ask(srv)
        assert disk_tokens(srv) == 0
    assert response.usage.prompt_tokens_details.cached_tokens == 0
    assert written <= set(blocks(directory))  # its blocks are its own, beside the first model's
    # The first model's directory planted as a link elsewhere: its worker, which crashed after each load
    # and was started again and again, fails with the reason.
    model_dir = next(iter(written)).parent
    model_dir.rename(tmp_path / "elsewhere")
    model_dir.symlink_to(tmp_path / "elsewhere")
    result = subprocess.run([*MLXD, *serve_args(tiny_model, directory), "--preload", "--port", str(free_port())],
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
    last = result.stderr.strip().splitlines()[-1]
    assert result.returncode == 1 and "--prefix-cache-dir:" in last and "symbolic link" in last, last


def test_a_stream_resumed_after_a_worker_kill_reads_its_prompt_back_from_disk(tiny_model, reference, tmp_path):
    directory = tmp_path / "kv"
    prompt = reference.text_prompt(SYSTEM)
    expected = reference.greedy(prompt, 300, ignore_eos=True).text
    pieces: list[str] = []
    with running(serve_args(tiny_model, directory), tmp_path / "serve.log") as srv:
        def read() -> None:
            body = {"model": "tiny", "prompt": SYSTEM, "max_tokens": 300, "temperature": 0, "ignore_eos": True,
                    "stream": True}
            with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        pieces.extend(c["text"] for c in json.loads(line[6:])["choices"])

        reader = threading.Thread(target=read)
        reader.start()
        # The prompt's blocks go to disk with its first token, not at its end.
        wait_for(lambda: len(blocks(directory)) >= len(prompt) // 256, 10, "the prompt's blocks written")
        first = srv.health()["worker"]["pid"]
        assert reader.is_alive()  # mid-stream
        os.kill(first, signal.SIGKILL)
        reader.join(120)
        assert "".join(pieces) == expected
        assert srv.health()["worker"]["pid"] != first
        assert disk_tokens(srv) >= 0.8 * len(prompt)


def test_a_request_that_ends_with_its_first_token_costs_no_other_its_answer(tiny_model, reference, tmp_path):
    """max_tokens=1 ends a request in the step that brings its first token,
    when mlx-lm has already let go of its row: its KV state goes to disk as
    it finishes, and the stream beside it carries on."""
    directory = tmp_path / "kv"
    prompt = reference.chat_prompt(MESSAGES)
    client = openai.OpenAI(max_retries=0, api_key="unused")
    with running(serve_args(tiny_model, directory), tmp_path / "serve.log") as srv:
        client = client.with_options(base_url=srv.url + "/v1")
        stream = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Tell me a long story."}], max_tokens=64,
            temperature=0, stream=True, extra_body={"ignore_eos": True})
        chunks = iter(stream)
        text = [next(chunks).choices[0].delta.content or ""]  # the stream is running
        short = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1, temperature=0)
        text += [c.choices[0].delta.content or "" for c in chunks if c.choices]
        wait_for(lambda: len(blocks(directory)) >= len(prompt) // 256, 10, "the short request's blocks written")
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 1
    assert short.choices[0].message.content == reference.greedy(prompt, 1).text
    story = reference.chat_prompt([{"role": "user", "content": "Tell me a long story."}])
    assert "".join(text) == reference.greedy(story, 64, ignore_eos=True).text


def test_a_directory_that_cannot_serve_fails_the_worker_at_once_with_the_reason(tiny_model, tmp_path):
    """Not after loading the model, and not as a crash the supervisor restarts again and again."""
    (tmp_path / "file").write_text("")
    started = time.monotonic()
    result = subprocess.run([*MLXD, *serve_args(tiny_model, tmp_path / "file"), "--preload", "--port",
                             str(free_port())], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and time.monotonic() - started < 30
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("mlxd: error: cannot load the model: --prefix-cache-dir:") and "not a directory" in last
