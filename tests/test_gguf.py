"""GGUF import: round trips against the model the file was made from, and clear refusals."""

from __future__ import annotations

import json
import os
import struct
import subprocess
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load

from tests.conftest import MLXD, ROOT
from tests.gguf_export import save_float_gguf, save_quantized_gguf, unpermute_from_gguf
from worker.gguf import convert_weights, import_gguf, read_gguf

TEXTS = ["Once upon a time", "héllo wörld 😀 漢字", "Numbers 0 1 2 3 and (symbols)!", "  two  spaces\nnew line"]


def logits(model, token_ids: list[int]) -> np.ndarray:
    return np.array(model(mx.array([token_ids]))[0].astype(mx.float32))


@pytest.fixture(scope="module")
def original(tiny_model):
    return load(str(tiny_model))


def test_float_round_trip_gives_the_same_logits(tiny_model, original, tmp_path):
    imported = import_gguf(save_float_gguf(tiny_model, tmp_path / "tiny.gguf"), tmp_path / "imported")
    config = json.loads((imported / "config.json").read_text())
    assert config["rope_traditional"] is True
    assert "quantization" not in config
    model, tokenizer = load(str(imported))
    ref_model, ref_tokenizer = original
    ids = ref_tokenizer.encode(TEXTS[0])
    np.testing.assert_allclose(logits(model, ids), logits(ref_model, ids), atol=1e-4, rtol=1e-4)
    for text in TEXTS:
        assert tokenizer.encode(text) == ref_tokenizer.encode(text)
        assert tokenizer.decode(tokenizer.encode(text)) == text
    chat = [{"role": "user", "content": "Hi"}]
    assert tokenizer.apply_chat_template(chat, add_generation_prompt=True) == ref_tokenizer.apply_chat_template(
        chat, add_generation_prompt=True
    )
    assert tokenizer.eos_token_ids == ref_tokenizer.eos_token_ids


def test_quantized_round_trip_within_quantization_error(tiny_model, original, tmp_path):
    held = save_quantized_gguf(tiny_model, tmp_path / "tiny-q.gguf")
    imported = import_gguf(tmp_path / "tiny-q.gguf", tmp_path / "imported")
    config = json.loads((imported / "config.json").read_text())
    # Bits come from each tensor's packed shape: 8-bit embeddings, 4-bit elsewhere.
    assert config["quantization"] == {"group_size": 32, "bits": 4, "model.embed_tokens": {"group_size": 32, "bits": 8}}
    model, _ = load(str(imported))
    ref_model, ref_tokenizer = original
    ids = ref_tokenizer.encode(TEXTS[0])
    got = logits(model, ids)

    # Exact reference: the original architecture holding the very values the
    # file holds (dequantized by llama.cpp's own code, Q/K rows un-permuted).
    heads = {"attn_q": 4, "attn_k": 2}
    unpermuted = {
        name: mx.array(unpermute_from_gguf(w, heads[name.split(".")[2]]) if name.split(".")[-2] in heads else w)
        for name, w in held.items()
    }
    same_values, _ = convert_weights(unpermuted)
    dequantized_model, _ = load(str(tiny_model))
    dequantized_model.load_weights(list(same_values.items()))
    np.testing.assert_allclose(got, logits(dequantized_model, ids), atol=0.05, rtol=0.01)

    # And close to the float model it was quantized from.
    float_logits = logits(ref_model, ids)
    relative = np.abs(got - float_logits).mean() / np.abs(float_logits).mean()
    assert relative < 0.25, relative
    assert (got.argmax(-1) == float_logits.argmax(-1)).mean() >= 0.5


def test_bf16_tensors_are_imported_as_they_are(tiny_model, tmp_path):
    """MLX reads a GGUF's BF16 tensors as float16 by value; the import keeps them bfloat16, every bit."""
    held = save_quantized_gguf(tiny_model, tmp_path / "tiny-bf16.gguf", {"default": gguf.GGMLQuantizationType.BF16})
    imported = import_gguf(tmp_path / "tiny-bf16.gguf", tmp_path / "imported")
    got = mx.load(str(imported / "model.safetensors"))
    want, _ = convert_weights({name: mx.array(w) for name, w in held.items()})
    assert got.keys() == want.keys()
    for name, w in want.items():
        assert got[name].dtype == (mx.bfloat16 if w.ndim == 2 else mx.float32), name
        assert mx.array_equal(got[name].astype(mx.float32), w), name


def test_bf16_values_past_float16s_range_are_kept(tmp_path):
    values = np.array([[1.5, 1e30, -3.25, 70000.0], [1e-30, 0.0, -1e20, 2.0]], dtype=np.float32)
    packed = gguf.quants.quantize(values, gguf.GGMLQuantizationType.BF16)
    writer = gguf.GGUFWriter(str(tmp_path / "range.gguf"), "llama")
    writer.add_tensor("before", np.ones(3, dtype=np.float32))  # so that the BF16 tensor's data does not start at 0
    writer.add_tensor("w", packed, raw_dtype=gguf.GGMLQuantizationType.BF16)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    weights, _ = read_gguf(tmp_path / "range.gguf")
    assert weights["w"].dtype == mx.bfloat16
    np.testing.assert_array_equal(
        np.array(weights["w"].astype(mx.float32)), gguf.quants.dequantize(packed, gguf.GGMLQuantizationType.BF16)
    )


def run_mlxd(*args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*MLXD, *args], cwd=ROOT, capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})}
    )


def assert_clear_error(result, fragment: str) -> None:
    assert result.returncode == 1
    assert fragment in result.stderr
    assert "Traceback" not in result.stderr


def test_non_llama_gguf_is_refused_by_name(tiny_model, tmp_path):
    path = save_float_gguf(tiny_model, tmp_path / "qwen.gguf", architecture="qwen2")
    assert_clear_error(run_mlxd("import-gguf", str(path), str(tmp_path / "out")), "architecture 'qwen2' is not supported")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("keep", [0.5, 0.01])
def test_truncated_gguf_is_refused(tiny_model, tmp_path, keep):
    whole = save_float_gguf(tiny_model, tmp_path / "whole.gguf").read_bytes()
    path = tmp_path / "truncated.gguf"
    path.write_bytes(whole[: int(len(whole) * keep)])
    assert_clear_error(run_mlxd("import-gguf", str(path), str(tmp_path / "out")), "truncated or corrupt")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kind", ["Q5_0", "Q5_1"])
def test_a_tensor_type_mlx_does_not_read_as_it_is_is_refused_by_name(tiny_model, tmp_path, kind):
    """Refused by its type, read from the file's header: MLX fails on Q5_0 as if the file were corrupt, and
    turns the K-quants into float16 with wrong scales for half their sub-blocks (the import 'worked'; the tiny
    model's rows are too short for a K-quant's 256-weight blocks, so the header check is shown with these)."""
    path = tmp_path / f"tiny-{kind}.gguf"
    save_quantized_gguf(tiny_model, path, {"default": getattr(gguf.GGMLQuantizationType, kind)})
    assert_clear_error(run_mlxd("import-gguf", str(path), str(tmp_path / "out")), f"holds tensors of type {kind}")
    assert not (tmp_path / "out").exists()


def test_a_chat_ends_at_the_end_of_turn_token_as_well(tiny_model, original, tmp_path):
    """Older Llama 3 GGUFs give <|end_of_text|> as EOS and <|eot_id|> as EOT: a chat turn never ended."""
    eos = original[1].eos_token_ids
    eot = next(i for i in range(16) if i not in eos)
    path = save_float_gguf(tiny_model, tmp_path / "eot.gguf",
                           extra={"tokenizer.ggml.eot_token_id": mx.array(eot, dtype=mx.uint32)})
    _, tokenizer = load(str(import_gguf(path, tmp_path / "imported")))
    assert tokenizer.eos_token_ids == set(eos) | {eot}


@pytest.mark.parametrize("header", [
    struct.pack("<4sIQQQ", b"GGUF", 3, 0, 1, 2**63),  # a key 2^63 bytes long
    struct.pack("<4sIQQQ", b"GGUF", 3, 1, 0, 2**33),  # a tensor name of 8 GiB
    struct.pack("<4sIQQQ7sIIQ", b"GGUF", 3, 0, 1, 7, b"general", 9, 8, 2**40),  # an array of 2^40 strings
])
def test_a_header_whose_lengths_run_past_the_file_is_refused_at_once(tmp_path, header):
    """A length is checked against the bytes left before anything is read: it was a traceback, or a read of 8 GiB."""
    path = tmp_path / "broken.gguf"
    path.write_bytes(header + bytes(64))
    assert_clear_error(run_mlxd("import-gguf", str(path), str(tmp_path / "out")), "runs past the file's end")


@pytest.mark.parametrize("alignment", [0, 3])
def test_an_alignment_that_is_no_power_of_two_is_refused(tmp_path, alignment):
    """MLX's own reader divides by it: 0 ended the process (SIGFPE), on every later pull of a kept download too."""
    path = tmp_path / "aligned.gguf"
    path.write_bytes(struct.pack("<4sIQQQ17sII", b"GGUF", 3, 0, 1, 17, b"general.alignment", 4, alignment))
    assert_clear_error(run_mlxd("import-gguf", str(path), str(tmp_path / "out")), "not a power of two")


def test_metadata_it_cannot_use_is_refused_clearly(tmp_path):
    """Arrays nested past Python's stack, or no vocabulary: a traceback (RecursionError, KeyError)."""
    nested = tmp_path / "nested.gguf"
    nesting = b"".join(struct.pack("<IQ", 9, 1) for _ in range(2000))  # an array of arrays of ... of one uint8
    nested.write_bytes(struct.pack("<4sIQQQ7sI", b"GGUF", 3, 0, 1, 7, b"general", 9) + nesting
                       + struct.pack("<IQB", 0, 1, 0))
    assert_clear_error(run_mlxd("import-gguf", str(nested), str(tmp_path / "out")), "nests arrays")
    wordless = tmp_path / "wordless.gguf"
    mx.save_gguf(str(wordless), {"token_embd.weight": mx.zeros((4, 4))},
                 {"general.architecture": "llama", "tokenizer.ggml.model": "gpt2"})
    assert_clear_error(run_mlxd("import-gguf", str(wordless), str(tmp_path / "out")), "cannot be imported")


def test_not_a_gguf_is_refused(tmp_path):
    path = tmp_path / "fake.gguf"
    path.write_bytes(b"PK\x03\x04 definitely a zip")
    assert_clear_error(run_mlxd("import-gguf", str(path), str(tmp_path / "out")), "not a GGUF file")


def test_gguf_model_is_imported_once_into_the_cache(tiny_model, tmp_path):
    path = save_float_gguf(tiny_model, tmp_path / "tiny.gguf")
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    first = run_mlxd("prepare-model", "--model", str(path), env=env)
    assert first.returncode == 0, first.stderr
    assert "importing" in first.stderr
    second = run_mlxd("prepare-model", "--model", str(path), env=env)
    assert second.returncode == 0
    assert "importing" not in second.stderr
    assert first.stdout == second.stdout
    assert first.stdout.startswith(str(tmp_path / "cache" / "mlxd" / "models"))
    # An older mlxd's import (its checks and end tokens were fewer) is done again.
    config = Path(first.stdout.strip()) / "config.json"
    config.write_text(json.dumps({k: v for k, v in json.loads(config.read_text()).items() if k != "mlxd_gguf_import"}))
    third = run_mlxd("prepare-model", "--model", str(path), env=env)
    assert third.returncode == 0 and "importing" in third.stderr and third.stdout == first.stdout
    assert "mlxd_gguf_import" in json.loads(config.read_text())


def test_unknown_model_is_a_clear_error(tmp_path):
    env = {"HF_HUB_OFFLINE": "1", "XDG_CACHE_HOME": str(tmp_path / "cache"), "HF_HOME": str(tmp_path / "hf")}
    assert_clear_error(run_mlxd("prepare-model", "--model", str(tmp_path / "nothing-here")), "no such file or directory")
    assert_clear_error(run_mlxd("prepare-model", "--model", "someone/no-such-model", env=env), "HF_HUB_OFFLINE")
