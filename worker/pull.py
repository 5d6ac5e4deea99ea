"""`mlxd pull SOURCE`: put a model in the cache before serving it.

A Hugging Face repo goes to the hub's own cache (huggingface_hub shows its
progress and resumes its partial files). A .gguf file, on this machine or at
an http(s) URL, is copied into the cache's downloads as NAME.gguf.partial
(a URL's continued from where an interrupted pull stopped), then imported
into models/NAME, which `--model NAME` serves. A URL's download continues only
where its server answers Range requests and names the file's version (an
ETag or Last-Modified, kept beside the partial file and sent back as
If-Range): a file changed on the server since, or a partial file of another
URL, starts over rather than splice two versions together.
"""

from __future__ import annotations

import fcntl
import http.client
import io
import json
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

from protocol.units import format_size
from protocol.worker_settings import cache_dir, is_repo_id
from worker.gguf import GGUFError, import_gguf, is_current_import
from worker.model_source import hugging_face

CHUNK = 1 << 20
# How often the progress line is redrawn on a terminal (elsewhere: a line per tenth).
REDRAW_S = 0.1


class PullError(Exception):
    """The source cannot be pulled; the message says why."""


def pull(source: str, name: str | None = None) -> tuple[Path, str]:
    """(the model's directory, what --model to give to serve it)."""
    if is_repo_id(source) and not Path(source).exists():
        return hugging_face(source), source
    remote = source.startswith(("http://", "https://"))
    # A URL's file name, without its query (Hugging Face's download links end in ?download=true).
    stem = Path(urllib.parse.urlsplit(source).path.rsplit("/", 1)[-1] if remote else source).name
    if not stem.endswith(".gguf"):
        raise PullError(f"{source!r} is not a .gguf file, a .gguf URL or a Hugging Face repo id (owner/name)")
    name = name or stem.removesuffix(".gguf")
    if not name or "/" in name or name.startswith("."):
        raise PullError(f"--name {name!r}: a name is one path component")
    model = cache_dir() / "models" / name
    if (model / "config.json").is_file() and not is_current_import(model):
        # Not removed here: the directory may be a model someone put in the cache by hand.
        raise PullError(f"{name} in the cache ({model}) is not an import of this mlxd's (older ones took K-quant "
                        f"files with wrong scales, stopped at EOS only, and turned BF16 weights into float16): "
                        f"`mlxd rm {name}` and pull again to redo it")
    if (model / "config.json").is_file():
        print(f"{name} is already in the cache ({model})", file=sys.stderr)
        return model, name
    downloads = cache_dir() / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    lock_path = downloads / f"{name}.lock"
    with open(lock_path, "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # let go when the process ends, however it ends
        except BlockingIOError:
            raise PullError(f"another pull of {name} is under way; wait for it (it writes the same files)") from None
        try:
            return _pull_gguf(source, name, remote, downloads, model)
        finally:
            lock_path.unlink(missing_ok=True)  # still held: a pull that opened it meanwhile is refused all the same


def _pull_gguf(source: str, name: str, remote: bool, downloads: Path, model: Path) -> tuple[Path, str]:
    """Download (or copy) and import a .gguf, holding the name's lock."""
    gguf = downloads / f"{name}.gguf"
    origin = downloads / f"{name}.gguf.from"  # the URL a whole download kept there came from
    if not (remote and gguf.is_file() and origin.is_file() and origin.read_text() == source):
        partial = downloads / f"{name}.gguf.partial"
        fetch(source, partial, name)
        partial.rename(gguf)
        origin.write_text(source)
    print(f"importing {name} into {model}", file=sys.stderr)
    kept = False
    try:
        import_gguf(gguf, model)
    except GGUFError as e:
        raise PullError(f"{source} cannot be imported: {e}") from None
    except KeyboardInterrupt:
        kept = remote  # a URL's download is imported by the next pull, not fetched again
        raise
    finally:  # else imported or not, the download is done with (a file nothing lists or removes otherwise)
        if not kept:
            gguf.unlink(missing_ok=True)
            origin.unlink(missing_ok=True)
    return model, name


def fetch(source: str, partial: Path, label: str) -> None:
    """Copy `source` into `partial`, continuing what an earlier pull of it left there."""
    have = partial.stat().st_size if partial.exists() else 0
    src, total, have = _open(source, have, partial.with_suffix(".version"))
    if have:
        print(f"resuming {label} at {format_size(have)}", file=sys.stderr)
    progress = Progress(label, total, have)
    with src, open(partial, "ab" if have else "wb") as dst:
        try:
            while chunk := src.read1(CHUNK):  # what has arrived: a slow link's bytes reach the disk as they come
                dst.write(chunk)
                have += len(chunk)
                progress.show(have)
        except http.client.HTTPException as e:  # a connection dropped mid-chunk (IncompleteRead), not an OSError
            raise PullError(f"{source}: the download broke off after {format_size(have)} ({e!r}); "
                            "pull again to continue") from None
    progress.done(have)
    if total is not None and have != total:
        raise PullError(f"{source} ended after {have} of {total} bytes; pull again"
                        + (" to continue" if source.startswith(("http://", "https://")) else ""))
    partial.with_suffix(".version").unlink(missing_ok=True)


def _open(source: str, have: int, version_file: Path) -> tuple[io.BufferedIOBase, int | None, int]:
    """The source from byte `have` (from 0 if it cannot continue there), its total size, and where it starts."""
    if source.startswith(("http://", "https://")):
        return _download(source, have, version_file)
    path = Path(source).expanduser()
    if not path.is_file():
        raise PullError(f"{source}: no such file")
    # Copied whole: nothing tells that a partial file came from this file as it is now.
    return open(path, "rb"), path.stat().st_size, 0


def _download(url: str, have: int, version_file: Path) -> tuple[io.BufferedIOBase, int | None, int]:
    """The URL's file from byte `have` where the server still has the version
    the partial file came from, else from 0; the version is kept in
    `version_file` for the next pull to continue from."""
    kept = json.loads(version_file.read_text()) if have and version_file.is_file() else {}
    version = kept.get("version") if kept.get("url") == url else None
    response = _get(url, {"Range": f"bytes={have}-", "If-Range": version} if version else {})
    # The part, of the version kept: a server that ignores If-Range sends another version's part all the same.
    if not (version and response.status == 206 and _version(response) == version
            and response.headers.get("Content-Range", f"bytes {have}-").startswith(f"bytes {have}-")):
        have = 0  # the whole file: the server's is another version, or it cannot send that part
        if response.status == 206:
            response.close()
            response = _get(url, {})
    version = _version(response)
    if version:
        version_file.write_text(json.dumps({"url": url, "version": version}))
    else:
        version_file.unlink(missing_ok=True)
    length = response.headers.get("Content-Length")
    return response, (have + int(length)) if length and length.isdigit() else None, have


def _version(response) -> str | None:
    """The version of the file a response holds: its strong ETag, else its Last-Modified."""
    etag = response.headers.get("ETag", "")
    return etag if etag and not etag.startswith("W/") else response.headers.get("Last-Modified")


def _get(url: str, headers: dict[str, str]):
    try:
        return urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=30)
    except OSError as e:
        raise PullError(f"cannot download {url}: {e}") from None


class Progress:
    """`pulling NAME  42%  11.0 MiB / 26.2 MiB  8.4 MiB/s` on stderr: redrawn in
    place on a terminal, a line per tenth of the file elsewhere (logs)."""

    def __init__(self, label: str, total: int | None, start: int) -> None:
        self.label, self.total, self.start = label, total, start
        self.began = time.monotonic()
        self.tty = sys.stderr.isatty()
        self._shown_at = 0.0
        self._tenth = -1

    def line(self, have: int) -> str:
        rate = (have - self.start) / max(time.monotonic() - self.began, 1e-3)
        if self.total:
            return (f"pulling {self.label}  {100 * have // self.total:3d}%  {format_size(have)} / "
                    f"{format_size(self.total)}  {format_size(int(rate))}/s")
        return f"pulling {self.label}  {format_size(have)}  {format_size(int(rate))}/s"

    def show(self, have: int) -> None:
        if self.tty:
            if time.monotonic() - self._shown_at >= REDRAW_S:
                self._shown_at = time.monotonic()
                print("\r" + self.line(have), end="", file=sys.stderr, flush=True)
        elif self.total and (tenth := 10 * have // self.total) != self._tenth:
            self._tenth = tenth
            print(self.line(have), file=sys.stderr, flush=True)

    def done(self, have: int) -> None:
        if self.tty or not self.total or self._tenth != 10:  # elsewhere the 100% line may be out already
            print(("\r" if self.tty else "") + self.line(have), file=sys.stderr, flush=True)
