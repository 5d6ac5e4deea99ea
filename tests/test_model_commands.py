"""`mlxd pull`, `list`, `rm` and `run` as a user runs them: real processes,
a real HTTP download (from a local server that sends slowly, so that a pull
can be killed halfway), a real `mlxd serve` of the pulled model, and the
terminal chat in a pseudo-terminal."""

from __future__ import annotations

import fcntl
import hashlib
import os
import signal
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import gguf as gguf_types
import pexpect
import pytest

from tests.conftest import MLXD, MODEL_NAME, ROOT, running, wait_for
from tests.gguf_export import save_float_gguf, save_quantized_gguf
from tests.scripted_model import make_scripted_model
from tests.test_tools import SCRIPTS

SLOW_CHUNK = 16 << 10


@pytest.fixture(scope="module")
def gguf(tiny_model, tmp_path_factory):
    return save_float_gguf(tiny_model, tmp_path_factory.mktemp("gguf") / "tinyp.gguf")


@pytest.fixture
def cache(tmp_path):
    return {"XDG_CACHE_HOME": str(tmp_path / "cache"), "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}


def mlxd(*args, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([*MLXD, *args], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})


class SlowFileServer:
    """Serves one file over HTTP with Range support (for the version its ETag
    names, sent back as If-Range), a chunk every few milliseconds; with
    `cut`, the connection drops after that many bytes of the file."""

    def __init__(self, data: bytes, delay_s: float) -> None:
        self.ranges: list[str | None] = []
        self.data = data
        self.cut: int | None = None
        self.honours_if_range = True  # False: a part of whatever version it has now, as some servers send
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                data, etag = outer.data, f'"{hashlib.sha256(outer.data).hexdigest()[:16]}"'
                wanted = self.headers.get("Range")
                if self.headers.get("If-Range") != etag and outer.honours_if_range:
                    wanted = None
                outer.ranges.append(wanted)
                start = int(wanted.removeprefix("bytes=").rstrip("-")) if wanted else 0
                self.send_response(206 if wanted else 200)
                self.send_header("ETag", etag)
                self.send_header("Content-Length", str(len(data) - start))
                self.end_headers()
                try:
                    for offset in range(start, outer.cut or len(data), SLOW_CHUNK):
                        self.wfile.write(data[offset:min(offset + SLOW_CHUNK, outer.cut or len(data))])
                        time.sleep(delay_s)
                except (BrokenPipeError, ConnectionResetError):
                    pass

            def log_message(self, *args) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/tinyp.gguf"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()


def test_a_pull_killed_halfway_continues_where_it_stopped(gguf, cache, tmp_path, reference):
    data = gguf.read_bytes()
    server = SlowFileServer(data, delay_s=0.05)
    partial = tmp_path / "cache" / "mlxd" / "downloads" / "tinyp.gguf.partial"
    try:
        first = subprocess.Popen([*MLXD, "pull", server.url], cwd=ROOT, env={**os.environ, **cache},
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        wait_for(lambda: partial.exists() and partial.stat().st_size >= len(data) // 4, 60, "a quarter of the file")
        os.kill(first.pid, signal.SIGKILL)
        first.wait(10)
        kept = partial.stat().st_size
        assert 0 < kept < len(data)
        second = mlxd("pull", server.url, env=cache)
    finally:
        server.close()
    assert second.returncode == 0, second.stderr
    assert "resuming tinyp at" in second.stderr and "100%" in second.stderr
    assert server.ranges[-1] == f"bytes={kept}-"
    assert "mlxd serve --model tinyp" in second.stdout
    assert not partial.exists()
    imported = tmp_path / "cache" / "mlxd" / "models" / "tinyp"
    assert (imported / "config.json").is_file()

    # The pulled model serves under its name, with the original's answers.
    with running(["serve", "--model", "tinyp"], tmp_path / "serve.log", env=cache) as srv:
        answer = srv.http.post("/v1/completions", json={"model": "tinyp", "prompt": "Once upon a time",
                                                        "max_tokens": 8, "temperature": 0}).json()
    assert answer["choices"][0]["text"] == reference.greedy(reference.text_prompt("Once upon a time"), 8).text


def test_pull_of_a_local_file_list_and_rm(gguf, cache, tmp_path):
    downloads = tmp_path / "cache" / "mlxd" / "downloads"
    downloads.mkdir(parents=True)
    data = gguf.read_bytes()
    # What an interrupted pull of another file of that name left: a local file is copied whole (it was
    # continued, spliced onto the other's bytes: garbage weights, imported without a word).
    (downloads / "mine.gguf.partial").write_bytes(bytes(len(data) // 2))
    pulled = mlxd("pull", str(gguf), "--name", "mine", env=cache)
    assert pulled.returncode == 0, pulled.stderr
    assert "resuming" not in pulled.stderr and list(downloads.iterdir()) == []
    again = mlxd("pull", str(gguf), "--name", "mine", env=cache)
    assert "already in the cache" in again.stderr
    # Two pulls of one name wrote the same partial file at once (one truncating what the other wrote).
    with open(downloads / "other.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        busy = mlxd("pull", str(gguf), "--name", "other", env=cache)
    assert busy.returncode == 1 and "another pull of other is under way" in busy.stderr, busy.stderr

    listed = mlxd("list", env=cache)
    assert listed.returncode == 0
    header, row = listed.stdout.splitlines()
    assert header.split() == ["NAME", "SIZE", "FORMAT", "QUANTIZATION", "CONTEXT", "FAMILY"]
    assert row.split()[0] == "mine" and row.split()[-2:] == ["2048", "llama"]

    assert mlxd("rm", "nothing", env=cache).returncode == 1
    removed = mlxd("rm", "mine", env=cache)
    assert removed.returncode == 0 and removed.stdout.startswith("removed mine")
    assert mlxd("list", env=cache).stdout.splitlines()[1:] == []
    refused = mlxd("pull", str(tmp_path / "notes.txt"), env=cache)
    assert refused.returncode == 1 and "not a .gguf file" in refused.stderr and "Traceback" not in refused.stderr


def test_run_chats_in_a_terminal(server, reference):
    first_question, second_question = "Tell me about the sea.", "And the sky?"
    first = reference.greedy(reference.chat_prompt([{"role": "user", "content": first_question}]), 8)
    second = reference.greedy(reference.chat_prompt([
        {"role": "user", "content": first_question}, {"role": "assistant", "content": first.text},
        {"role": "user", "content": second_question}]), 8)

    chat = pexpect.spawn(MLXD[0], ["run", MODEL_NAME, "--url", server.url, "--temperature", "0", "--max-tokens", "8"],
                         cwd=str(ROOT), encoding="utf-8", timeout=60)

    def answers(expected) -> None:
        chat.expect_exact(expected.text.replace("\n", "\r\n") + "\r\n")
        if expected.finish_reason == "length":
            chat.expect_exact("mlxd run: the answer was cut short")
        chat.expect_exact(">>> ")

    try:
        chat.expect_exact(">>> ")
        chat.sendline(first_question)
        chat.expect_exact(first_question + "\r\n")
        answers(first)
        chat.sendline(second_question)
        chat.expect_exact(second_question + "\r\n")
        answers(second)
        chat.sendline("/bye")
        chat.expect(pexpect.EOF)
    finally:
        chat.close()
    assert chat.exitstatus == 0


def test_run_shows_a_reasoning_models_thinking_dimmed_before_its_answer(tmp_path):
    """The thinking came as reasoning_content, which `mlxd run` did not print: a long blank pause."""
    markers, script = SCRIPTS["reasoning"]
    path = make_scripted_model(tmp_path / "model", script, markers)
    with running(["serve", "--model", str(path), "--served-model-name", "scripted"], tmp_path / "serve.log") as srv:
        chat = pexpect.spawn(MLXD[0], ["run", "scripted", "--url", srv.url, "--temperature", "0"], cwd=str(ROOT),
                             encoding="utf-8", timeout=60)
        try:
            chat.expect_exact(">>> ")
            chat.sendline("What is the capital of France?")
            chat.expect_exact("\x1b[2m")
            chat.expect_exact("The user wants the capital.")
            chat.expect_exact("\x1b[0m\r\nParis.\r\n>>> ")
            chat.sendeof()
            chat.expect(pexpect.EOF)
        finally:
            chat.close()
    assert chat.exitstatus == 0


def test_run_names_an_unknown_model_and_goes_on(server):
    chat = pexpect.spawn(MLXD[0], ["run", "no-such-model", "--url", server.url], cwd=str(ROOT), encoding="utf-8",
                         timeout=60)
    try:
        chat.expect_exact(">>> ")
        chat.sendline("hello")
        chat.expect_exact("mlxd run: The model 'no-such-model' does not exist")
        chat.expect_exact(">>> ")
        chat.sendeof()
        chat.expect(pexpect.EOF)
    finally:
        chat.close()
    assert chat.exitstatus == 0


def test_a_pull_that_cannot_be_imported_leaves_no_download_behind(tiny_model, cache, tmp_path):
    """The download was kept, a file of the model's size that neither `mlxd list` shows nor `mlxd rm` removes."""
    path = tmp_path / "q5.gguf"
    save_quantized_gguf(tiny_model, path, {"default": gguf_types.GGMLQuantizationType.Q5_0})
    pulled = mlxd("pull", str(path), env=cache)
    assert pulled.returncode == 1 and "cannot be imported" in pulled.stderr and "Q5_0" in pulled.stderr
    assert "Traceback" not in pulled.stderr
    assert list((tmp_path / "cache" / "mlxd" / "downloads").iterdir()) == []


def test_a_url_with_a_query_is_named_by_its_path(gguf, cache):
    """Hugging Face's download links end in ?download=true."""
    server = SlowFileServer(gguf.read_bytes(), delay_s=0)
    try:
        pulled = mlxd("pull", server.url + "?download=true", env=cache)
    finally:
        server.close()
    assert pulled.returncode == 0, pulled.stderr
    assert "mlxd serve --model tinyp" in pulled.stdout


def test_a_sha_of_the_pulled_download_matches_the_source(gguf, cache, tmp_path):
    """Nothing is lost or doubled across a resume: the assembled file is the source, byte for byte."""
    data = gguf.read_bytes()
    downloads = tmp_path / "cache" / "mlxd" / "downloads"
    downloads.mkdir(parents=True)
    partial = downloads / "whole.gguf.partial"
    partial.write_bytes(data[:12345])
    from worker.pull import fetch

    fetch(str(gguf), partial, "whole")
    assert hashlib.sha256(partial.read_bytes()).hexdigest() == hashlib.sha256(data).hexdigest()


def test_a_download_continues_only_the_version_it_began(gguf, tmp_path):
    """A file changed on the server since the pull stopped is downloaded again
    whole, not spliced onto the old version's bytes; an unchanged one continues."""
    from worker.pull import PullError, fetch

    old, new = b"old version " * 5000, gguf.read_bytes()
    server = SlowFileServer(old, delay_s=0)
    partial = tmp_path / "tinyp.gguf.partial"

    def dropped_at(cut: int) -> None:
        server.cut = cut
        with pytest.raises(PullError, match="pull again to continue"):
            fetch(server.url, partial, "tinyp")
        server.cut = None
        assert partial.stat().st_size == cut

    try:
        dropped_at(SLOW_CHUNK)
        fetch(server.url, partial, "tinyp")
        assert server.ranges[-1] == f"bytes={SLOW_CHUNK}-" and partial.read_bytes() == old
        partial.unlink()
        dropped_at(SLOW_CHUNK)
        server.data = new
        fetch(server.url, partial, "tinyp")
        assert server.ranges[-1] is None
        assert hashlib.sha256(partial.read_bytes()).hexdigest() == hashlib.sha256(new).hexdigest()
        # A server that sends the asked part of whatever version it has now: its ETag says which.
        partial.unlink()
        server.data = old
        dropped_at(SLOW_CHUNK)
        server.data, server.honours_if_range = new, False
        fetch(server.url, partial, "tinyp")
        assert server.ranges[-2:] == [f"bytes={SLOW_CHUNK}-", None]
    finally:
        server.close()
    assert hashlib.sha256(partial.read_bytes()).hexdigest() == hashlib.sha256(new).hexdigest()


def test_rm_removes_what_it_names_once_and_only_that(cache, tmp_path):
    models = tmp_path / "cache" / "mlxd" / "models"
    downloads = tmp_path / "cache" / "mlxd" / "downloads"
    downloads.mkdir(parents=True)
    for name in ("m[1]", "m1"):
        (models / name).mkdir(parents=True)
        (models / name / "config.json").write_text('{"model_type": "llama"}')
    (downloads / "m1.gguf.partial").write_bytes(b"another pull's")
    removed = mlxd("rm", "m[1]", "m[1]:latest", env=cache)  # a glob's brackets, and the name twice
    assert removed.returncode == 0 and removed.stdout.count("removed m[1]") == 1, removed.stderr
    assert (models / "m1").is_dir() and (downloads / "m1.gguf.partial").exists()


def test_list_reads_the_cache_not_a_directory_of_the_same_name_here(cache, tmp_path):
    model = tmp_path / "cache" / "mlxd" / "models" / "mine"
    model.mkdir(parents=True)
    (model / "config.json").write_text('{"model_type": "llama", "max_position_embeddings": 2048}')
    here = tmp_path / "here"
    (here / "mine").mkdir(parents=True)
    (here / "mine" / "config.json").write_text('{"model_type": "qwen2", "max_position_embeddings": 32768}')
    listed = subprocess.run([*MLXD, "list"], cwd=here, capture_output=True, text=True, timeout=60,
                            env={**os.environ, **cache, "PYTHONPATH": str(ROOT)})
    assert listed.stdout.splitlines()[1].split()[-2:] == ["2048", "llama"], listed.stdout


def test_keys_generate_never_replaces_a_pair_unasked(tmp_path):
    def generate(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([*MLXD, "keys", "generate", str(tmp_path / "keys"), *extra], capture_output=True,
                              text=True, timeout=60)

    assert generate("--name", "gateway").returncode == 0
    first = (tmp_path / "keys" / "gateway.key").read_text()
    again = generate("--name", "gateway")
    assert again.returncode == 2 and "exists" in again.stderr and "Traceback" not in again.stderr
    assert (tmp_path / "keys" / "gateway.key").read_text() == first
    assert generate("--name", "gateway", "--force").returncode == 0
    assert (tmp_path / "keys" / "gateway.key").read_text() != first
    assert generate("--name", "../escaped").returncode == 2 and not (tmp_path / "escaped.key").exists()


def test_an_import_interrupted_keeps_the_download_for_the_next_pull(gguf, monkeypatch, tmp_path):
    """Ctrl-C while a pulled URL's file is imported: the download was removed, and the message said a pull
    would go on where it stopped (a model of tens of GB downloaded again)."""
    import worker.pull

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    server = SlowFileServer(gguf.read_bytes(), delay_s=0)
    try:
        with monkeypatch.context() as patched:
            def interrupted(*args):
                raise KeyboardInterrupt
            patched.setattr(worker.pull, "import_gguf", interrupted)
            with pytest.raises(KeyboardInterrupt):
                worker.pull.pull(server.url)
        downloads = tmp_path / "cache" / "mlxd" / "downloads"
        assert sorted(f.name for f in downloads.iterdir()) == ["tinyp.gguf", "tinyp.gguf.from"]
        directory, name = worker.pull.pull(server.url)
    finally:
        server.close()
    assert server.ranges == [None]  # one download
    assert name == "tinyp" and (directory / "config.json").is_file()
    assert list((tmp_path / "cache" / "mlxd" / "downloads").iterdir()) == []


def test_rm_removes_a_download_whose_import_was_interrupted(cache, tmp_path):
    """No model of that name is in the cache, only what its pull kept: mlxd list does not show it."""
    downloads = tmp_path / "cache" / "mlxd" / "downloads"
    downloads.mkdir(parents=True)
    (downloads / "big.gguf").write_bytes(b"GGUF" + bytes(1000))
    (downloads / "big.gguf.from").write_text("http://example.invalid/big.gguf")
    removed = mlxd("rm", "big", env=cache)
    assert removed.returncode == 0 and "removed big" in removed.stdout
    assert list(downloads.iterdir()) == []
    assert mlxd("rm", "big", env=cache).returncode == 1


def test_a_pull_over_an_older_import_fails_saying_how_to_redo_it(gguf, cache, tmp_path):
    """It said so, then "pulled" and exit 0, leaving the older import in place."""
    older = tmp_path / "cache" / "mlxd" / "models" / "tinyp"
    older.mkdir(parents=True)
    (older / "config.json").write_text('{"model_type": "llama"}')
    pulled = mlxd("pull", str(gguf), env=cache)
    assert pulled.returncode == 1 and "is not an import of this mlxd's" in pulled.stderr
    assert "mlxd rm tinyp" in pulled.stderr and "pulled" not in pulled.stdout
    # A config.json of another shape, or a version that is no number: the same, not a traceback.
    for config in ('{"mlxd_gguf_import": "3"}', "[]"):
        (older / "config.json").write_text(config)
        pulled = mlxd("pull", str(gguf), env=cache)
        assert pulled.returncode == 1 and "is not an import of this mlxd's" in pulled.stderr, pulled.stderr
    # A file named just ".gguf" names no model: the import went into the models directory itself.
    nameless = tmp_path / ".gguf"
    nameless.write_bytes(gguf.read_bytes())
    refused = mlxd("pull", str(nameless), env=cache)
    assert refused.returncode == 1 and "one path component" in refused.stderr, refused.stderr
