"""A Hugging Face repo mlxd cannot serve is refused when it is fetched, naming
what it lacks (`mlxd pull` said "pulled" and serving failed later)."""

import pytest

from worker.model_source import ModelNotFound, hugging_face


def cached_repo(hf_home, repo: str, files: dict[str, str]) -> None:
    """A repo in huggingface_hub's cache layout, as a download leaves it."""
    root = hf_home / "hub" / f"models--{repo.replace('/', '--')}"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text("abc123")
    snapshot = root / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    for name, text in files.items():
        (snapshot / name).write_text(text)


@pytest.mark.parametrize("files, lacks", [
    ({"README.md": "the .gguf files were left out by the download's patterns"}, "has no config.json"),
    ({"config.json": "{}", "pytorch_model.bin.index.json": "{}"}, "has no .safetensors weights"),
])
def test_a_repo_without_a_config_or_weights_is_refused_naming_what_it_lacks(tmp_path, monkeypatch, files, lacks):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    cached_repo(tmp_path, "own/repo", files)
    with pytest.raises(ModelNotFound, match=lacks):
        hugging_face("own/repo")
    cached_repo(tmp_path, "own/served", {"config.json": "{}", "model.safetensors": ""})
    assert (hugging_face("own/served") / "model.safetensors").is_file()


@pytest.mark.parametrize("environ", [{}, {"XDG_CACHE_HOME": "/tmp/xdg"}, {"HF_HOME": "~/hf", "XDG_CACHE_HOME": "/x"},
                                     {"HF_HUB_CACHE": "/tmp/hub", "HF_HOME": "/tmp/hf"}, {"HF_HOME": "$HOME/hf"},
                                     {"HUGGINGFACE_HUB_CACHE": "/tmp/legacy"}])
def test_the_hub_cache_is_where_huggingface_hub_keeps_it(environ):
    """mlxd list, mlxd rm and the ledger's sizes look there without importing huggingface_hub."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items()
           if k not in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME")}
    script = ("import huggingface_hub.constants as c; from gateway.ledger import hub_cache; "
              "print(c.HF_HUB_CACHE); print(hub_cache())")
    theirs, ours = subprocess.run([sys.executable, "-c", script], env={**env, **environ}, capture_output=True,
                                  text=True, check=True).stdout.split()
    assert theirs == ours
