"""An agent's conversation replayed against the prefix cache's tiers.

    python -m tests.bench.agent_replay [--model M] [--turns 20] [--rules 1000]

A coding agent resends its whole context every turn: a long system prompt
(`--rules` short rules, about 10 tokens each) and the growing history. The
same greedy conversation is replayed through `mlxd serve` three times, and
each turn's time to first token is reported: cold (`--prefix-cache-bytes 0`,
every turn prefilled whole), warm in RAM (the RAM tier, with a disk
directory being written), and warm from disk (a new server on that directory
with no RAM tier, so every reuse is read back from disk, as after a
restart). Then the time a stream with that context stands still when its
worker is killed (SIGKILL) mid-answer, until the restarted worker carries
on: without and with the disk tier. Default model: the embedded SmolLM2
(an 8k context).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import tempfile
import threading
import time

import httpx

from tests.bench.serve_speed import start


def system_prompt(rules: int) -> str:
    return "You are a careful coding agent. " + " ".join(f"Rule {i}: keep edits small." for i in range(rules))


def ask(url: str, model: str, messages: list[dict], tokens: int) -> tuple[float, str, int]:
    """One streamed chat turn: time to first token, the answer, the prompt tokens reused."""
    body = {"model": model, "messages": messages, "max_tokens": tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    started, first, text, cached = time.perf_counter(), None, [], 0
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        if r.status_code != 200:
            raise SystemExit(f"{r.status_code}: {r.read().decode()}")
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                cached = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            for choice in chunk["choices"]:
                if choice["delta"].get("content"):
                    first = first or time.perf_counter()
                    text.append(choice["delta"]["content"])
    return (first or time.perf_counter()) - started, "".join(text), cached


def replay(url: str, model: str, system: str, turns: int) -> list[tuple[float, int]]:
    """Each turn's time to first token and reused tokens; the history grows by each answer."""
    messages, out = [{"role": "system", "content": system}], []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"Step {turn}: what do you change next, and why?"})
        ttft, answer, cached = ask(url, model, messages, 16)
        messages.append({"role": "assistant", "content": answer})
        out.append((ttft, cached))
    return out


def stall_on_kill(url: str, model: str, system: str) -> float:
    """Seconds between two tokens of a stream whose worker is killed between them."""
    body = {"model": model, "messages": [{"role": "system", "content": system}, {"role": "user", "content": "Go on."}],
            "max_tokens": 120, "temperature": 0, "ignore_eos": True, "stream": True}
    times: list[float] = []

    def read() -> None:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
            for line in r.iter_lines():
                if line.startswith("data: {") and any(c["delta"].get("content") for c in json.loads(line[6:])["choices"]):
                    times.append(time.perf_counter())

    reader = threading.Thread(target=read)
    reader.start()
    while len(times) < 10:
        if not reader.is_alive():
            raise SystemExit("the stream ended before its worker could be killed")
        time.sleep(0.005)
    os.kill(httpx.get(url + "/health").json()["worker"]["pid"], signal.SIGKILL)
    reader.join()
    return max(b - a for a, b in zip(times, times[1:]))


def served(model: str, flags: list[str]):
    proc, url, _ = start(model, dict(os.environ), flags)
    name = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    return proc, url, name


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="", help="default: the embedded SmolLM2")
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--rules", type=int, default=700, help="about 10 tokens each (700: 7k tokens)")
    args = parser.parse_args()
    system = system_prompt(args.rules)
    runs: dict[str, list[tuple[float, int]]] = {}
    stalls: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        directory = f"{tmp}/kv"
        for label, flags in (("cold", ["--prefix-cache-bytes", "0"]),
                             ("warm in RAM", ["--prefix-cache-dir", directory]),
                             ("warm from disk", ["--prefix-cache-dir", directory, "--prefix-cache-bytes", "0"])):
            proc, url, name = served(args.model, flags)
            try:
                runs[label] = replay(url, name, system, args.turns)
            finally:
                stop(proc)
        for label, flags in (("without the disk tier", []),
                             ("with the disk tier", ["--prefix-cache-dir", f"{tmp}/resume"])):
            proc, url, name = served(args.model, flags)
            try:
                stalls[label] = stall_on_kill(url, name, system)
            finally:
                stop(proc)
    print(f"model: {args.model or 'the embedded SmolLM2'}; a system prompt of {args.rules} rules, {args.turns} turns "
          "of 16 tokens")
    print("| replay | TTFT turn 1 s | TTFT turns 2.. median s | max s | prompt tokens reused, last turn |")
    print("|---|---|---|---|---|")
    for label, turns in runs.items():
        rest = [t for t, _ in turns[1:]]
        print(f"| {label} | {turns[0][0]:.3f} | {statistics.median(rest):.3f} | {max(rest):.3f} | {turns[-1][1]} |")
    cold = statistics.median(t for t, _ in runs["cold"])
    disk = statistics.median(t for t, _ in runs["warm from disk"])
    print(f"TTFT median over all turns, warm from disk against cold: {disk / cold:.2f}x")
    for label, seconds in stalls.items():
        print(f"a worker killed mid-stream, {label}: the stream stood still {seconds:.2f} s")


if __name__ == "__main__":
    main()
