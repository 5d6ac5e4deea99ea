"""The weights' digest, kept in mlxd's cache: workers that start together read
each other's cached digest, and must never read one half written (a group's
ranks on one host then refused to start, their digests differing)."""

import hashlib
import threading
import time
from pathlib import Path

from worker.model import model_digest


def test_a_digest_being_written_is_never_read_half_written(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"weights" * 1000)
    expected = hashlib.sha256()
    for name in ("config.json", "model.safetensors"):
        expected.update(name.encode() + b"\0" + hashlib.sha256((model / name).read_bytes()).digest())

    # The first worker writes its digest slowly (a busy disk): half of it, then the rest.
    write_text = Path.write_text

    def slowly(path: Path, text: str) -> int:
        with path.open("w") as f:
            f.write(text[:10])
            f.flush()
            time.sleep(0.5)
            f.write(text[10:])
        return len(text)

    monkeypatch.setattr(Path, "write_text", slowly)
    first: list[str] = []
    writer = threading.Thread(target=lambda: first.append(model_digest(model)))
    writer.start()
    time.sleep(0.25)  # the file being written
    second = model_digest(model)  # another worker, starting meanwhile
    writer.join()
    monkeypatch.setattr(Path, "write_text", write_text)
    assert first == [expected.hexdigest()] and second == expected.hexdigest()
    assert model_digest(model) == expected.hexdigest()  # and the cached one, once written
    assert all("." not in p.name for p in (tmp_path / "cache" / "mlxd" / "digests").iterdir())  # nothing left aside
