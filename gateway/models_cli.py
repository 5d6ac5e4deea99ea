"""Model commands that need no MLX: `mlxd list` and `mlxd rm` (the cache),
`mlxd ps` and `mlxd run` (a running server, over its HTTP API). `mlxd pull`
imports GGUF files, so it runs in the worker program (worker/pull.py)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from gateway.health import served_name
from gateway.ledger import hub_cache
from gateway.model_facts import model_facts
from protocol.units import format_size
from protocol.worker_settings import cache_dir


def server_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=f"http://127.0.0.1:{os.environ.get('MLXD_PORT', '8000')}",
                        help="the gateway's address (default: http://127.0.0.1:$MLXD_PORT, or port 8000)")
    parser.add_argument("--api-key", default=os.environ.get("MLXD_API_KEYS", "").split(",")[0].strip() or None,
                        help="an API key, when the gateway has keys [env MLXD_API_KEYS: its first]")


def server_request(args: argparse.Namespace, path: str, body: dict | None = None) -> urllib.request.Request:
    headers = {"Content-Type": "application/json"} if body is not None else {}
    if args.api_key:
        headers["Authorization"] = f"Bearer {args.api_key}"
    return urllib.request.Request(args.url.rstrip("/") + path, data=None if body is None else json.dumps(body).encode(),
                                  headers=headers)


def table(rows: Sequence[tuple[str, ...]]) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())


def ps_main(argv: list[str]) -> int:
    """The workers a running gateway has, one line each (its /health, which needs a key when keys are set)."""
    parser = argparse.ArgumentParser(prog="mlxd ps", description="List the workers of a running mlxd.")
    server_arguments(parser)
    args = parser.parse_args(argv)
    try:
        with urllib.request.urlopen(server_request(args, "/health"), timeout=10) as response:
            health = json.load(response)
    except (OSError, ValueError) as e:
        print(f"mlxd ps: cannot read {args.url}/health: {e}", file=sys.stderr)
        return 1
    if "workers" not in health:
        print("mlxd ps: the gateway shows its workers only with an API key"
              + (": it did not take this one" if args.api_key else " (--api-key)"), file=sys.stderr)
        return 1
    models = health.get("pool", {}).get("models", {})

    def until(w: dict) -> str:
        """When the pool unloads the worker's model: in N s, once idle (-), never (pinned, or kept by a
        keep_alive of -1), or not the pool's (remote)."""
        if w.get("remote", True):
            return "remote"
        model: dict = next((models[name] for name in w.get("names", []) if name in models), {})
        if model.get("stays_loaded"):
            return "never"
        return "-" if model.get("unloads_in_s") is None else f"{model['unloads_in_s']:.0f}s"

    rows = [("MODEL", "PID", "STATE", "RUNNING", "WAITING", "STEPS", "CONTEXT", "MEMORY", "UNLOADS", "UP")]
    rows += [(served_name(w), str(w["pid"]), w["state"], str(w["running"]), str(w["waiting"]), str(w["steps"]),
              str(w["context_length"]), format_size(w["memory"]["active"]).replace(" ", "") if "memory" in w else "-",
              until(w), f"{w['up_s']:.0f}s") for w in health["workers"]]
    table(rows)
    return 0


def cached_models() -> dict[str, Path]:
    """The models on this machine that `--model NAME` serves without a download, by that NAME:
    those `mlxd pull` (or a .gguf import) put in mlxd's cache, and Hugging Face repos in the hub's cache."""
    found: dict[str, Path] = {}
    models = cache_dir() / "models"
    if models.is_dir():
        # Not an import's staging directory (.NAME-xxxx), which a killed import leaves behind.
        found.update({d.name: d for d in sorted(models.iterdir())
                      if not d.name.startswith(".") and (d / "config.json").is_file()})
    hub = hub_cache()
    if hub.is_dir():
        for repo in sorted(hub.glob("models--*--*")):
            snapshots = [s for s in (repo / "snapshots").glob("*") if (s / "config.json").is_file()]
            if snapshots:
                found[repo.name.removeprefix("models--").replace("--", "/", 1)] = repo
    return found


def list_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="mlxd list", description="List the models in the cache: what "
                                     "`mlxd serve --model NAME` can serve without downloading.")
    parser.parse_args(argv)
    rows = [("NAME", "SIZE", "FORMAT", "QUANTIZATION", "CONTEXT", "FAMILY")]
    for name, path in cached_models().items():
        # mlxd's own by their directory: the NAME alone would be read as a path from here first.
        facts = model_facts(str(path) if (path / "config.json").is_file() else name)
        rows.append((name, format_size(facts.size), facts.format or "-", facts.quantization or "-",
                     str(facts.context_length or "-"), facts.family or "-"))
    table(rows)
    return 0


def rm_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="mlxd rm", description="Remove a model from the cache (as `mlxd list` "
                                     "names it). A server that has it loaded keeps running it.")
    parser.add_argument("name", nargs="+")
    args = parser.parse_args(argv)
    cached = cached_models()
    names = list(dict.fromkeys(n.removesuffix(":latest") for n in args.name))  # `rm a a:latest` removes a once
    missing = [n for n in names if n not in cached and not downloads_of(n)]
    if missing:
        print(f"mlxd rm: not in the cache: {', '.join(missing)} (see mlxd list)", file=sys.stderr)
        return 1
    for name in names:
        path = cached.get(name)
        # A hub repo's snapshots link to its blobs: each file counted once.
        files = [f for f in path.rglob("*") if f.is_file() and not f.is_symlink()] if path is not None else []
        left = downloads_of(path.name if path is not None else name)
        size = sum(f.stat().st_size for f in [*files, *left])
        try:
            if path is not None:
                shutil.rmtree(path)
            for file in left:
                file.unlink(missing_ok=True)
        except OSError as e:  # not the user's files, say (a cache shared with root)
            print(f"mlxd rm: cannot remove {name}: {e}", file=sys.stderr)
            return 1
        print(f"removed {name} ({format_size(size)})")
    return 0


def downloads_of(name: str) -> list[Path]:
    """What a pull of the GGUF named `name` left in the cache's downloads: a
    partial download, or a whole one whose import was interrupted."""
    downloads = cache_dir() / "downloads"
    # Not a glob: names may hold [ ].
    return [f for suffix in (".gguf", ".gguf.from", ".gguf.partial", ".gguf.version")
            if "/" not in name and (f := downloads / f"{name}{suffix}").is_file()]


def run_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="mlxd run", description="Chat with a model of a running mlxd in the "
                                     "terminal, its answers streamed. /bye or Ctrl-D ends it; Ctrl-C stops an "
                                     "answer.")
    parser.add_argument("model", help="a model the server serves (see /v1/models, or mlxd ps)")
    parser.add_argument("--system", help="a system prompt")
    parser.add_argument("--temperature", type=float, help="default: the model's")
    parser.add_argument("--max-tokens", type=int, help="per answer (default: as many as the context leaves)")
    server_arguments(parser)
    args = parser.parse_args(argv)
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass
    history = [{"role": "system", "content": args.system}] if args.system else []
    while True:
        try:
            text = input(">>> ")
        except EOFError:
            print()
            return 0
        except KeyboardInterrupt:
            print()
            continue
        if text.strip() in ("/bye", "/exit"):
            return 0
        if not text.strip():
            continue
        history.append({"role": "user", "content": text})
        body = {"model": args.model, "messages": history, "stream": True}
        body.update({k: v for k, v in (("temperature", args.temperature), ("max_tokens", args.max_tokens))
                     if v is not None})
        try:
            answer = stream_answer(server_request(args, "/v1/chat/completions", body))
        except urllib.error.HTTPError as e:
            print(f"mlxd run: {_error_message(e)}", file=sys.stderr)
            history.pop()
            continue
        except OSError as e:
            print(f"mlxd run: cannot reach {args.url}: {e}", file=sys.stderr)
            return 1
        history.append({"role": "assistant", "content": answer})


# A reasoning model's thinking, shown dimmed on a terminal (as ollama run shows it) and kept out of the history.
DIM, PLAIN = ("\x1b[2m", "\x1b[0m") if sys.stdout.isatty() else ("", "")


def stream_answer(request: urllib.request.Request) -> str:
    """Print an answer as it streams, its reasoning first (dimmed); the answer
    printed (up to a Ctrl-C, which ends the request)."""
    printed: list[str] = []
    thinking = cut = False
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            for raw in response:
                if not raw.startswith(b"data: ") or raw.strip() == b"data: [DONE]":
                    continue
                event = json.loads(raw[6:])
                if "error" in event:
                    print(f"\nmlxd run: {event['error'].get('message')}", file=sys.stderr)
                    break
                for choice in event.get("choices", []):
                    delta = choice.get("delta", {})
                    if reasoning := delta.get("reasoning_content") or "":
                        print(DIM + reasoning + PLAIN, end="", flush=True)
                        thinking = True
                    if text := delta.get("content") or "":
                        if thinking:  # the answer on a line of its own
                            print(flush=True)
                            thinking = False
                        printed.append(text)
                        print(text, end="", flush=True)
                    cut = cut or choice.get("finish_reason") == "length"
    except KeyboardInterrupt:
        pass  # closing the connection ends the request in the worker
    print()
    if cut:
        print("mlxd run: the answer was cut short (--max-tokens, or the model's context, ran out)", file=sys.stderr)
    return "".join(printed)


def _error_message(error: urllib.error.HTTPError) -> str:
    try:
        return json.load(error)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return f"HTTP {error.code}"
