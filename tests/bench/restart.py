"""What a worker restart costs clients, under `mlxd serve`.

    python -m tests.bench.restart [--model M] [--signal KILL|TERM] [--tokens N]

Starts `mlxd serve`, opens a greedy streaming request, sends the worker the
signal after a few tokens, and reports the time from the signal until /ready
answers 200 again (restart to ready) and the longest gap between two chunks
the client saw (its pause). The answer is checked against an uninterrupted run.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time

import httpx

from tests.bench.serve_speed import PROMPT, start


def stream(url: str, model: str, tokens: int, pieces: list, times: list) -> None:
    body = {"model": model, "messages": PROMPT, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                if "error" in event:
                    raise SystemExit(f"the stream failed: {event['error']}")
                if event["choices"] and event["choices"][0]["delta"].get("content"):
                    pieces.append(event["choices"][0]["delta"]["content"])
                    times.append(time.monotonic())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="")
    parser.add_argument("--signal", default="KILL", choices=["KILL", "TERM"])
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    proc, url, _ = start(args.model, dict(os.environ))
    try:
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        uninterrupted: list = []
        stream(url, model, args.tokens, uninterrupted, [])
        pieces: list = []
        times: list = []
        reader = threading.Thread(target=stream, args=(url, model, args.tokens, pieces, times))
        reader.start()
        while len(pieces) < 5:
            time.sleep(0.01)
        worker_pid = httpx.get(url + "/health").json()["worker"]["pid"]
        os.kill(worker_pid, getattr(signal, f"SIG{args.signal}"))
        signalled = time.monotonic()
        while httpx.get(url + "/ready").status_code == 200 and time.monotonic() - signalled < 30:
            time.sleep(0.01)  # until the gateway has noticed
        while httpx.get(url + "/ready").status_code != 200:
            time.sleep(0.01)
        ready_after = time.monotonic() - signalled
        reader.join()
        pause = max(b - a for a, b in zip(times, times[1:]))
        same = "".join(pieces) == "".join(uninterrupted)
        print(f"model: {model}; SIG{args.signal} to the worker after 5 of {args.tokens} streamed tokens")
        print(f"restart to ready: {ready_after:.2f} s; longest pause the client saw: {pause:.2f} s; "
              f"answer identical to an uninterrupted run: {same}")
        if not same:
            sys.exit(1)
    finally:
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    main()
