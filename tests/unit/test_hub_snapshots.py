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
