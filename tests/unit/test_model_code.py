"""A model directory's own Python code for its tokenizer never runs, on one Mac or split across several."""

import json

import mlx.core as mx
import pytest

from tests.tiny_model import make_tiny_model
from worker.model import Sharding, load_model


@pytest.mark.parametrize("sharding", [None, "pipeline"])
def test_a_tokenizers_auto_map_code_is_not_run(tmp_path, sharding):
    """mlx-lm loads a sharded model's tokenizer with remote code trusted unless told otherwise: an
    auto_map in a repo's tokenizer_config ran its code on every Mac of the group."""
    model = make_tiny_model(tmp_path / "model", model_type="qwen2", weight_index=True)
    marker = tmp_path / "ran"
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "auto_map": {"AutoTokenizer": [None, "own.Tok"]}}))
    (model / "own.py").write_text(f"open({str(marker)!r}, 'w')\nfrom transformers import PreTrainedTokenizerFast as Tok\n")
    split = Sharding(mx.distributed.init(), pipeline=True) if sharding else None
    loaded = load_model(str(model), sharding=split)
    assert loaded.tokenizer_files and not marker.exists()
