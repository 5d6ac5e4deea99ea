"""POST /v1/embeddings: the model's pooled final hidden states, equal to mlx-lm's in-process,
through the OpenAI SDK and plain HTTP, in float and base64."""

from __future__ import annotations

import base64
import json
import shutil
import time

import httpx
import mlx.core as mx
import numpy as np
import openai
import pytest

from tests.conftest import MODEL_NAME, running
from tests.reference import Reference
from tests.test_restarts import StreamReader

TEXTS = ["Once upon a time", "the cat sat on the mat", "x"]


def expected(reference: Reference, token_ids: list[int], pooling: str = "last") -> np.ndarray:
    """mlx-lm in-process: the transformer's last hidden states, pooled and L2-normalized."""
    hidden = reference.model.model(mx.array([token_ids]))[0].astype(mx.float32)
    vector = hidden.mean(axis=0) if pooling == "mean" else hidden[-1]
    return np.array(vector / mx.linalg.norm(vector))


def test_embeddings_equal_mlx_lms_in_process_output(server, reference, validate):
    response = server.http.post("/v1/embeddings", json={"model": MODEL_NAME, "input": TEXTS})
    assert response.status_code == 200, response.text
    body = response.json()
    validate(body, "CreateEmbeddingResponse")
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    prompts = [reference.text_prompt(t) for t in TEXTS]
    for item, prompt in zip(body["data"], prompts):
        np.testing.assert_allclose(item["embedding"], expected(reference, prompt), rtol=0, atol=1e-6)
    assert body["usage"] == {"prompt_tokens": sum(map(len, prompts)), "total_tokens": sum(map(len, prompts))}


def test_the_openai_sdk_gets_the_same_vectors_as_base64(server, reference):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    # The SDK asks for base64 and decodes it to floats itself.
    result = client.embeddings.create(model=MODEL_NAME, input=TEXTS[0])
    np.testing.assert_allclose(result.data[0].embedding, expected(reference, reference.text_prompt(TEXTS[0])),
                               rtol=0, atol=1e-6)
    raw = server.http.post("/v1/embeddings", json={"model": MODEL_NAME, "input": TEXTS[0],
                                                   "encoding_format": "base64"}).json()
    vector = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert vector.tolist() == result.data[0].embedding


def test_token_ids_and_shortened_dimensions(server, reference):
    ids = reference.text_prompt(TEXTS[1])
    body = server.http.post("/v1/embeddings", json={"model": MODEL_NAME, "input": [ids, ids[:3]]}).json()
    np.testing.assert_allclose(body["data"][0]["embedding"], expected(reference, ids), rtol=0, atol=1e-6)
    np.testing.assert_allclose(body["data"][1]["embedding"], expected(reference, ids[:3]), rtol=0, atol=1e-6)
    short = server.http.post("/v1/embeddings", json={"model": MODEL_NAME, "input": ids, "dimensions": 8}).json()
    head = expected(reference, ids)[:8]
    np.testing.assert_allclose(short["data"][0]["embedding"], head / np.linalg.norm(head), rtol=0, atol=1e-6)


@pytest.mark.parametrize("body, param", [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": ["a", 1]}, "input"),
    ({"input": [[1, 2], "a"]}, "input"),
    ({"input": [10**9]}, "input"),
    ({"input": [1] * 3000}, "input"),  # longer than the context
    ({"input": "a", "dimensions": 100000}, "dimensions"),
    ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "a", "keep_alive": "later"}, "keep_alive"),
])
def test_bad_input_is_a_400_naming_its_parameter(server, body, param):
    response = server.http.post("/v1/embeddings", json={"model": MODEL_NAME, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] in (param, f"$.{param}") or param in error["message"]
    unknown = server.http.post("/v1/embeddings", json={"model": "nope", "input": "a"})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize("normalize", [True, False])
def test_sentence_transformers_pooling_is_read_from_the_model(tiny_model, tmp_path, normalize):
    """A model directory with modules.json and a mean-pooling module pools by the mean, and
    normalizes where a Normalize module says so; Ollama's /api/embed always does, as Ollama does."""
    model = tmp_path / "mean"
    shutil.copytree(tiny_model, model)
    (model / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        *[{"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}] * normalize]))
    (model / "1_Pooling").mkdir()
    (model / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    with running(["serve", "--model", f"mean={model}"], tmp_path / "serve.log") as srv:
        vector = np.array(srv.http.post("/v1/embeddings", json={"model": "mean", "input": TEXTS[0]}).json()[
            "data"][0]["embedding"])
        ollamas = srv.http.post("/api/embed", json={"model": "mean", "input": TEXTS[0]}).json()["embeddings"][0]
    reference = Reference(model)
    unit = expected(reference, reference.text_prompt(TEXTS[0]), "mean")
    assert (abs(np.linalg.norm(vector) - 1) < 1e-5) == normalize
    np.testing.assert_allclose(vector / np.linalg.norm(vector), unit, rtol=0, atol=1e-6)
    np.testing.assert_allclose(ollamas, unit, rtol=0, atol=1e-6)


def test_pooling_mlxd_does_not_do_is_refused_not_done_otherwise(tiny_model, tmp_path):
    """A weighted mean (SGPT's) was pooled as the last token, with no word: other vectors than the
    model's. The model still generates; its embeddings are refused, and the worker's log says why."""
    model = tmp_path / "weighted"
    shutil.copytree(tiny_model, model)
    (model / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (model / "1_Pooling").mkdir()
    (model / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_weightedmean_tokens": True,
                                                                "pooling_mode_lasttoken": False}))
    with running(["serve", "--model", f"weighted={model}"], tmp_path / "serve.log") as srv:
        refused = srv.http.post("/v1/embeddings", json={"model": "weighted", "input": TEXTS[0]})
        generated = srv.http.post("/v1/completions", json={"model": "weighted", "prompt": "Hi", "max_tokens": 2})
        log = srv.log_path.read_text()
    assert refused.status_code == 400 and "cannot embed" in refused.json()["error"]["message"]
    assert generated.status_code == 200
    assert "pooling_mode_weightedmean_tokens" in log


def test_a_large_embeddings_request_goes_in_pieces_between_a_streams_steps(tiny_model, reference, tmp_path):
    """--prefill-chunk 64: a piece is one input of ~60 tokens; the stream gets tokens while they are embedded."""
    with running(["serve", "--model", str(tiny_model), "--served-model-name", MODEL_NAME, "--prefill-chunk", "64"],
                 tmp_path / "serve.log") as srv:
        stream = StreamReader(srv.url, max_tokens=1500)
        stream.start()
        stream.wait_for_pieces(5, timeout=60)
        ids = [(7 * i) % 380 + 3 for i in range(60)]
        inputs = [ids[i % 7:] for i in range(120)]
        before = len(stream.pieces)
        response = srv.http.post("/v1/embeddings", json={"model": MODEL_NAME, "input": inputs}, timeout=120)
        during = len(stream.pieces) - before
        assert response.status_code == 200, response.text
        data = response.json()["data"]
        assert len(data) == len(inputs)
        for i in (0, 1, 6, 119):
            np.testing.assert_allclose(data[i]["embedding"], expected(reference, inputs[i]), rtol=0, atol=1e-6)
        assert stream.is_alive() and during >= 30, during  # run whole, the embedding left the stream no step
        stream.join(120)
        assert stream.failure is None and stream.errors == [] and stream.done


def test_a_long_input_goes_in_parts_between_a_streams_steps(server, reference):
    """An input was one forward pass however long: one of a whole context held every stream for all
    of it (some 0.5 s for these 1,500 tokens here). Now it goes a part a turn, each part continuing
    the KV state of the parts before, and its vector is the one of a single pass."""
    stream = StreamReader(server.url, max_tokens=1000)
    stream.start()
    stream.wait_for_pieces(5, timeout=60)
    ids = [(7 * i) % 380 + 3 for i in range(1500)]
    before = len(stream.pieces)
    response = server.http.post("/v1/embeddings", json={"model": MODEL_NAME, "input": [ids, ids[:40]]}, timeout=120)
    during = len(stream.pieces) - before
    assert response.status_code == 200, response.text
    data = response.json()["data"]
    np.testing.assert_allclose(data[0]["embedding"], expected(reference, ids), rtol=0, atol=1e-5)
    np.testing.assert_allclose(data[1]["embedding"], expected(reference, ids[:40]), rtol=0, atol=1e-6)
    assert stream.is_alive() and during >= 20, during
    stream.join(120)
    assert stream.failure is None and stream.errors == [] and stream.done


def test_a_client_that_gives_up_on_its_embeddings_costs_the_next_request_nothing(server):
    """The worker embeds requests one after another: one whose client left went on to its last input
    (some 15 s of work here) while the next request waited behind it."""
    ids = [(7 * i) % 380 + 3 for i in range(200)]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/embeddings", json={"model": MODEL_NAME, "input": [ids] * 2000},
                   timeout=httpx.Timeout(30, read=0.5))
    started = time.monotonic()
    response = server.http.post("/v1/embeddings", json={"model": MODEL_NAME, "input": "x"})
    assert response.status_code == 200
    assert time.monotonic() - started < 4


def test_embeddings_past_the_request_timeout_are_a_504_and_dropped(tiny_model, tmp_path):
    """There was no limit: a request of many inputs held its client and the worker to its last input."""
    ids = [(7 * i) % 380 + 3 for i in range(200)]
    with running(["serve", "--model", str(tiny_model), "--served-model-name", MODEL_NAME, "--request-timeout-s", "2"],
                 tmp_path / "serve.log") as srv:
        started = time.monotonic()
        response = srv.http.post("/v1/embeddings", json={"model": MODEL_NAME, "input": [ids] * 2000})
        assert response.status_code == 504 and response.json()["error"]["code"] == "timeout"
        assert time.monotonic() - started < 6
        started = time.monotonic()
        assert srv.http.post("/v1/embeddings", json={"model": MODEL_NAME, "input": "x"}).status_code == 200
        assert time.monotonic() - started < 4
