"""Vision: images through the real stack (gateway processor, raw ZeroMQ
frames, mlx-vlm on the worker's main thread) beside text, against mlx-vlm
in-process; every test for every family mlxd serves (tests/tiny_vision_model.py)."""

from __future__ import annotations

import base64
import http.server
import io
import json
import os
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import anthropic
import httpx
import numpy as np
import ollama
import openai
import pytest
from PIL import Image

from gateway.images import FETCH_THREADS
from tests.conftest import Server, running, wait_for
from tests.tiny_vision_model import FAMILIES, IMAGE_SIZE, make_tiny_vision_model

MODEL = "tiny-vision"
QUESTION = "What is in this picture?"


def image(seed: int, size: tuple[int, int] = (3 * IMAGE_SIZE, 2 * IMAGE_SIZE)) -> Image.Image:
    """Random pixels, (width, height): not square, so that a Qwen-VL image's
    grid has rows and columns of tokens (and its prompt an mRoPE delta)."""
    pixels = (np.random.default_rng(seed).random((size[1], size[0], 3)) * 255).astype(np.uint8)
    return Image.fromarray(pixels)


def encoded(img: Image.Image, fmt: str = "PNG") -> bytes:
    out = io.BytesIO()
    img.save(out, fmt)
    return out.getvalue()


def data_url(img: Image.Image, fmt: str = "PNG") -> str:
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(encoded(img, fmt)).decode()


def openai_messages(url: str, question: str = QUESTION) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": question}]}]


def template_messages(n_images: int, question: str = QUESTION) -> list[dict]:
    """The same messages as the chat template sees them."""
    return [{"role": "user", "content": [{"type": "image"}] * n_images + [{"type": "text", "text": question}]}]


@pytest.fixture(scope="module", params=FAMILIES)
def vision_model(request, tmp_path_factory):
    return make_tiny_vision_model(tmp_path_factory.mktemp("models") / request.param, family=request.param)


@pytest.fixture(scope="module")
def vision_reference(vision_model):
    from tests.reference import VisionReference

    return VisionReference(vision_model)


class SlowHost:
    """What the image host's /slow and /slow.png hold: each request answers (404, or the PNG) once
    `release` is set."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.waiting = 0
        self._lock = threading.Lock()

    def hold(self) -> None:
        with self._lock:
            self.waiting += 1
        self.release.wait(60)


SLOW = SlowHost()
FETCHED: list[str] = []  # the image host's paths, as asked for


@pytest.fixture(scope="module")
def image_host():
    """A local HTTP server with one PNG (and a redirect to it), for
    --allow-image-hosts; /slow (a 404) and /slow.png answer only once SLOW.release is set."""
    png = encoded(image(7))

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            FETCHED.append(self.path)
            if self.path.startswith("/slow"):
                SLOW.hold()
                if self.path != "/slow.png":
                    self.send_error(404)
                    return
            if self.path == "/redirect":
                self.send_response(302)
                self.send_header("Location", "/cat.png")
                self.end_headers()
                return
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(png)))
            self.end_headers()
            self.wfile.write(png)

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{httpd.server_port}"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(scope="module")
def vision_server(vision_model, image_host, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "vision.log"
    with running(["serve", "--model", str(vision_model), "--served-model-name", MODEL, "--heartbeat-s", "0.05",
                  "--allow-image-hosts", image_host, "--allow-image-hosts", "localhost",
                  "--max-images-per-request", "3", "--max-image-pixels", "40000",
                  "--max-image-bytes", "300000"], log, env={"MLXD_AFFINITY_AUDIT": "1"}) as srv:
        yield srv


@pytest.fixture
def client(vision_server):
    return openai.OpenAI(base_url=vision_server.url + "/v1", api_key="unused", max_retries=0)


def chat(client, messages, max_tokens=16, **kwargs):
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens,
                                          temperature=kwargs.pop("temperature", 0), **kwargs)


def test_openai_image_answer_equals_mlx_vlm(client, vision_reference):
    img = image(0)
    expected = vision_reference.greedy(template_messages(1), [img], 16)
    response = chat(client, openai_messages(data_url(img)))
    assert response.choices[0].message.content == expected.text
    assert response.choices[0].finish_reason == expected.finish_reason
    assert response.usage.prompt_tokens == vision_reference.inputs(template_messages(1), [img])["input_ids"].size
    # The image decides the answer: another image, another answer.
    other = chat(client, openai_messages(data_url(image(1))))
    assert other.choices[0].message.content == vision_reference.greedy(template_messages(1), [image(1)], 16).text
    assert other.choices[0].message.content != expected.text


def test_jpeg_webp_and_several_images(client, vision_reference):
    for fmt in ("JPEG", "WEBP"):
        img = image(2)
        # What the server decodes is what the reference must see (JPEG is lossy).
        decoded = Image.open(io.BytesIO(encoded(img, fmt))).convert("RGB")
        response = chat(client, openai_messages(data_url(img, fmt)))
        assert response.choices[0].message.content == vision_reference.greedy(template_messages(1), [decoded], 16).text
    images = [image(3), image(4)]
    content = [{"type": "image_url", "image_url": {"url": data_url(i)}} for i in images]
    response = chat(client, [{"role": "user", "content": content + [{"type": "text", "text": QUESTION}]}])
    assert response.choices[0].message.content == vision_reference.greedy(template_messages(2), images, 16).text


def test_anthropic_image_answer_equals_mlx_vlm(vision_server, vision_reference):
    img = image(5)
    expected = vision_reference.greedy(template_messages(1), [img], 12)
    client = anthropic.Anthropic(base_url=vision_server.url, api_key="unused", max_retries=0)
    source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(encoded(img)).decode()}
    message = client.messages.create(
        model=MODEL, max_tokens=12, extra_body={"temperature": 0},
        messages=[{"role": "user", "content": [{"type": "image", "source": source},
                                               {"type": "text", "text": QUESTION}]}],
    )
    assert message.content[0].text == expected.text
    with client.messages.stream(
        model=MODEL, max_tokens=12, extra_body={"temperature": 0},
        messages=[{"role": "user", "content": [{"type": "image", "source": source},
                                               {"type": "text", "text": QUESTION}]}],
    ) as stream:
        assert "".join(stream.text_stream) == expected.text


def test_allowed_host_is_fetched_and_others_are_not(client, vision_reference, image_host):
    expected = vision_reference.greedy(template_messages(1), [image(7)], 16)
    response = chat(client, openai_messages(f"http://{image_host}/cat.png"))
    assert response.choices[0].message.content == expected.text
    with pytest.raises(openai.BadRequestError, match="redirect"):
        chat(client, openai_messages(f"http://{image_host}/redirect"))
    for url in (f"http://user:pass@{image_host}/cat.png", f"http://evil.example@{image_host}/cat.png"):
        with pytest.raises(openai.BadRequestError, match="credentials"):
            chat(client, openai_messages(url))
    # A host allowed alone ("localhost") is allowed on its scheme's port, not on every port it listens on.
    with pytest.raises(openai.BadRequestError, match="not allowed"):
        chat(client, openai_messages(f"http://localhost:{image_host.rpartition(':')[2]}/cat.png"))


def test_image_hosts_that_never_answer_hold_up_no_other_request(vision_model, vision_server, image_host):
    """More image URLs waiting on a host that does not answer than the event
    loop's thread pool has threads: their fetches wait in threads of their
    own, and a long text prompt (tokenized in that pool) is answered
    meanwhile. It waited for the fetches' timeout."""
    if vision_model.name != FAMILIES[0]:
        pytest.skip("fetching images is the gateway's: the same for every family")
    fetches = min(min(32, (os.cpu_count() or 1) + 4) + 1, FETCH_THREADS)  # asyncio's default executor, one more
    content = [{"type": "image_url", "image_url": {"url": f"http://{image_host}/slow"}}] * 3
    slow_body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": content}]}
    long_body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "the " * 1100}]}
    SLOW.release.clear()
    SLOW.waiting = 0
    with ThreadPoolExecutor(fetches // 3 + 1) as pool:
        try:
            slow = [pool.submit(vision_server.http.post, "/v1/chat/completions", json=slow_body)
                    for _ in range(fetches // 3 + 1)]
            wait_for(lambda: SLOW.waiting >= fetches, 10, lambda: f"{fetches} fetches waiting ({SLOW.waiting})")
            started = time.monotonic()
            answered = vision_server.http.post("/v1/chat/completions", json=long_body, timeout=30)
            took = time.monotonic() - started
        finally:
            SLOW.release.set()
        assert answered.status_code == 200, answered.text
        assert took < 5, f"a text request waited {took:.1f}s behind image fetches"
        assert all(f.result().status_code == 400 for f in slow)


def test_a_stored_conversation_keeps_its_fetched_image(vision_model, vision_server, image_host):
    """A Responses turn on a stored one fetched the first turn's image URL again, each turn: the model
    could be shown another image than the first turn's, or a 400 for one gone since."""
    if vision_model.name != FAMILIES[0]:
        pytest.skip("fetching images is the gateway's: the same for every family")
    url = f"http://{image_host}/cat.png?stored"
    first = vision_server.http.post("/v1/responses", json={
        "model": MODEL, "max_output_tokens": 4, "temperature": 0,
        "input": [{"role": "user", "content": [{"type": "input_image", "image_url": url},
                                               {"type": "input_text", "text": QUESTION}]}]})
    assert first.status_code == 200, first.text
    then = vision_server.http.post("/v1/responses", json={
        "model": MODEL, "max_output_tokens": 4, "temperature": 0, "previous_response_id": first.json()["id"],
        "input": "And now?"})
    assert then.status_code == 200, then.text
    assert FETCHED.count("/cat.png?stored") == 1


def _cpu_s(pid: int) -> float:
    """The process's CPU time so far (user and system), from /proc."""
    fields = open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads the gateway's CPU time in /proc")
def test_a_request_whose_client_left_decodes_no_more_of_its_images(vision_model, tmp_path):
    """Eight large images (a second of a core each to decode here) went to one thread as one job, which
    a client's leaving could not stop: the gateway decoded them all, for no one."""
    if vision_model.name != FAMILIES[0]:
        pytest.skip("decoding images is the gateway's: the same for every family")
    png = io.BytesIO()
    Image.new("RGBA", (5000, 5000), (10, 20, 30, 128)).save(png, "PNG")
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    content = [{"type": "image_url", "image_url": {"url": url}}] * 8 + [{"type": "text", "text": QUESTION}]
    body = json.dumps({"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": content}]})
    with running(["serve", "--model", str(vision_model), "--served-model-name", MODEL], tmp_path / "serve.log") as srv:
        with socket.create_connection(("127.0.0.1", srv.port)) as sock:  # the default limits: 8 images of 25M pixels
            sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: "
                         f"application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}".encode())
            time.sleep(1.0)  # its first image is being decoded
        time.sleep(2.5)  # the image then under way is done
        before = _cpu_s(srv.proc.pid)
        time.sleep(2.0)
        assert _cpu_s(srv.proc.pid) - before < 0.5, "the gateway went on decoding the images of a client that left"
        assert srv.health()["worker"]["running"] == 0


def test_a_request_still_fetching_its_image_when_the_drain_ends_is_refused(vision_model, image_host, tmp_path):
    """Past the door before the drain began, its image still on its way when --drain-s ran out (every
    request then ended): it went on to the worker afterwards, for uvicorn's backstop to cut off."""
    if vision_model.name != FAMILIES[0]:
        pytest.skip("draining is the gateway's: the same for every family")
    SLOW.release.clear()
    SLOW.waiting = 0
    srv = Server(["serve", "--model", str(vision_model), "--served-model-name", MODEL, "--allow-image-hosts",
                  image_host, "--drain-s", "0.5"], tmp_path / "serve.log")
    try:
        srv.wait_ready()
        content = [{"type": "image_url", "image_url": {"url": f"http://{image_host}/slow.png"}},
                   {"type": "text", "text": QUESTION}]
        body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": content}]}
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(srv.http.post, "/v1/chat/completions", json=body)
            wait_for(lambda: SLOW.waiting == 1, 10, "the image's fetch")
            os.kill(srv.proc.pid, signal.SIGTERM)
            wait_for(lambda: "draining" in srv.log_path.read_text(), 10, "the drain")
            time.sleep(1)  # past --drain-s
            SLOW.release.set()
            response = answer.result(timeout=30)
        assert response.status_code == 503, response.text
        assert response.json()["error"]["message"] == "the server is shutting down"
    finally:
        SLOW.release.set()
        srv.stop()


def test_mixed_batch_keeps_each_request_its_own_sampling(client, vision_server, vision_reference):
    """Vision and text requests decode in one batch, greedy beside hot
    sampling: every greedy one equals its single-request output."""
    greedy_images = [image(10), image(11)]
    expected_vision = [vision_reference.greedy(template_messages(1), [i], 24).text for i in greedy_images]
    text_messages = [{"role": "user", "content": "Tell me a story about the capital of France."}]
    expected_text = vision_reference.greedy(text_messages, [], 24).text

    def run(job):
        kind, arg, temperature = job
        messages = openai_messages(data_url(arg)) if kind == "vision" else text_messages
        return chat(client, messages, max_tokens=24, temperature=temperature,
                    extra_body={"ignore_eos": temperature > 0}).choices[0].message.content

    jobs = [("vision", greedy_images[0], 0), ("text", None, 2.0), ("vision", image(12), 2.0),
            ("text", None, 0), ("vision", greedy_images[1], 0), ("vision", image(13), 1.5), ("text", None, 1.8)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(run, jobs))
    assert answers[0] == expected_vision[0]
    assert answers[3] == expected_text
    assert answers[4] == expected_vision[1]
    vision_server.wait_idle()


def test_images_of_different_sizes_in_one_batch_each_answer_as_alone(client, vision_reference):
    """With mRoPE (Qwen-VL) each image size gives its prompt another position
    delta; decoded side by side, each request keeps its own."""
    images = [image(60, (84, 56)), image(61, (28, 112)), image(62, (112, 112)), image(63, (28, 28))]
    expected = [vision_reference.greedy(template_messages(1), [i], 24).text for i in images]
    with ThreadPoolExecutor(len(images)) as pool:
        answers = list(pool.map(lambda i: chat(client, openai_messages(data_url(i)), max_tokens=24)
                                .choices[0].message.content, images))
    assert answers == expected


def test_an_image_seen_before_skips_the_vision_tower(client, vision_server, vision_reference):
    """Other text before the same image: the prefix cache holds nothing past
    the system prompt, the feature cache has the image's features."""
    img = image(70)

    def ask(system: str) -> tuple[str, str]:
        answer = chat(client, [{"role": "system", "content": system}] + openai_messages(data_url(img)))
        expected = vision_reference.greedy([{"role": "system", "content": system}] + template_messages(1), [img], 16)
        return answer.choices[0].message.content, expected.text

    def image_hits() -> int:
        return vision_server.health()["worker"]["prefix_cache"]["image_hits"]

    answer, expected = ask("Answer in one word.")
    assert answer == expected
    time.sleep(0.2)  # past the heartbeat after that request
    before = image_hits()
    answer, expected = ask("Take your time and describe everything.")
    assert answer == expected
    wait_for(lambda: image_hits() == before + 1, 2, "the feature cache's hit")
    metrics = vision_server.http.get("/metrics").text
    worker = vision_server.health()["worker"]
    assert f'mlxd_image_feature_cache_hits_total{{model="{worker["names"][0]}",pid="{worker["pid"]}"}} {before + 1}\n' in metrics


def test_an_api_key_never_reuses_the_features_of_anothers_image(vision_model, tmp_path):
    """Each key has a cache of its own, the vision features' too: a feature
    cache hit shows in the time to the first token, so one key could tell
    whether another had sent an image it guesses at."""
    if vision_model.name != FAMILIES[0]:
        pytest.skip("the cache's scopes are the engine's: the same for every family")
    srv = Server(["serve", "--model", str(vision_model), "--served-model-name", MODEL, "--heartbeat-s", "0.05",
                  "--api-key", "alice-key", "--api-key", "bob-key"], tmp_path / "serve.log")
    try:
        srv.wait_ready()
        img = image(71)

        def ask(key: str, system: str) -> int:
            """The feature cache's hits once the key's request is answered."""
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0)
            chat(client, [{"role": "system", "content": system}] + openai_messages(data_url(img)))
            time.sleep(0.2)  # past the heartbeat after that request
            return srv.http.get("/health", headers={"x-api-key": key}).json()["worker"]["prefix_cache"]["image_hits"]

        hits = ask("alice-key", "Answer in one word.")
        assert ask("bob-key", "Take your time.") == hits
        assert ask("alice-key", "Describe everything.") == hits + 1
    finally:
        srv.stop()


def test_images_one_pixel_apart_never_share_cached_state(client, vision_reference):
    """The prefix cache keys image positions by the images' content."""
    a = image(20)
    pixels = np.array(a)
    pixels[IMAGE_SIZE // 2, IMAGE_SIZE // 2] ^= 0xFF
    b = Image.fromarray(pixels)
    question = "Describe the colours you see."
    prompt = vision_reference.inputs(template_messages(1, question), [a])["input_ids"][0].tolist()
    prompt_length = len(prompt)
    before_image = prompt.index(vision_reference.image_token_id)

    first = chat(client, openai_messages(data_url(a), question))
    again = chat(client, openai_messages(data_url(a), question))
    other = chat(client, openai_messages(data_url(b), question))
    assert again.usage.prompt_tokens_details.cached_tokens == prompt_length - 1  # the image's state reused
    assert other.usage.prompt_tokens_details.cached_tokens <= before_image  # nothing past the image
    assert first.choices[0].message.content == again.choices[0].message.content
    assert other.choices[0].message.content == vision_reference.greedy(template_messages(1, question), [b], 16).text


@pytest.mark.parametrize(
    "url, status, words",
    [
        ("http://example.com/cat.png", 400, "not allowed"),
        ("https://10.0.0.1/cat.png", 400, "not allowed"),
        ("file:///etc/passwd", 400, "never reads local files"),
        ("http://[bad/cat.png", 400, "not a valid URL"),
        ("http://localhost:99999/cat.png", 400, "not a port"),
        ("/etc/passwd", 400, "never reads local files"),
        ("cat.png", 400, "never reads local files"),
        ("data:image/png;base64,!!!not base64!!!", 400, "base64"),
        ("data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\0" * 64).decode(), 400, "PNG"),
        ("data:image/png;base64," + base64.b64encode(encoded(image(0))[:150]).decode(), 400, "corrupt"),
        ("data:image/bmp;base64," + base64.b64encode(encoded(image(0), "BMP")).decode(), 400, "PNG, JPEG, WebP"),
        (data_url(image(0, (300, 300))), 413, "pixels"),  # 90,000 > --max-image-pixels 40000
        ("data:image/png;base64," + base64.b64encode(b"\0" * 400_000).decode(), 413, "larger"),
    ],
    ids=["http-not-allowed", "https-not-allowed", "file-url", "bad-url", "bad-port", "absolute-path", "bare-path", "bad-base64",
         "not-an-image", "truncated", "bmp", "too-many-pixels", "too-many-bytes"],
)
def test_bad_images_get_a_clear_4xx(vision_server, url, status, words):
    body = {"model": MODEL, "max_tokens": 4, "messages": openai_messages(url)}
    response = vision_server.http.post("/v1/chat/completions", json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert words in error["message"]
    assert error["param"] == "messages[0].content[0]"


def test_image_limits_per_request(vision_server):
    url = data_url(image(0))
    content = [{"type": "image_url", "image_url": {"url": url}}] * 4 + [{"type": "text", "text": QUESTION}]
    response = vision_server.http.post("/v1/chat/completions", json={
        "model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": content}]})
    assert response.status_code == 400
    assert "at most 3" in response.json()["error"]["message"]
    anthropic_body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "file:///etc/passwd"}}]}]}
    response = vision_server.http.post("/v1/messages", json=anthropic_body)
    assert response.status_code == 400
    assert response.json()["type"] == "error"
    assert "never reads local files" in response.json()["error"]["message"]


def test_bad_image_costs_no_other_request_its_answer(client, vision_server, vision_reference):
    img = image(30)
    expected = vision_reference.greedy(template_messages(1), [img], 24).text

    def good():
        return chat(client, openai_messages(data_url(img)), max_tokens=24).choices[0].message.content

    def bad(i):
        url = ["file:///etc/passwd", "data:image/png;base64,AAAA", "http://example.com/x.png"][i % 3]
        return vision_server.http.post("/v1/chat/completions", json={
            "model": MODEL, "max_tokens": 4, "messages": openai_messages(url)}).status_code

    with ThreadPoolExecutor(8) as pool:
        goods = [pool.submit(good) for _ in range(3)]
        bads = [pool.submit(bad, i) for i in range(9)]
        assert [f.result() for f in goods] == [expected] * 3
        assert all(f.result() == 400 for f in bads)


def test_affinity_audit_across_vision_and_text_with_aborts(vision_server):
    wait_for(lambda: "affinity" in vision_server.health()["worker"], 5, "the audit's first report")
    before = vision_server.health()["worker"]["affinity"]["evaluations"]

    def stream(i: int) -> None:
        content = openai_messages(data_url(image(40 + i))) if i % 2 else "Count to a hundred."
        if isinstance(content, str):
            content = [{"role": "user", "content": content}]
        body = {"model": MODEL, "messages": content, "max_tokens": 200, "temperature": 0.9, "seed": i,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", vision_server.url + "/v1/chat/completions", json=body, timeout=60) as r:
            for n, _ in enumerate(r.iter_lines()):
                if i % 3 == 0 and n >= 10:
                    return  # the client leaves: an abort

    with ThreadPoolExecutor(6) as pool:
        list(pool.map(stream, range(6)))
    vision_server.wait_idle()
    affinity = vision_server.health()["worker"]["affinity"]
    assert affinity["evaluations"] > before + 100
    assert affinity["off_main_thread"] == 0


def test_image_request_resumes_on_the_next_worker(vision_server, vision_reference):
    """kill -9 mid-stream: the request, images included, continues on the
    restarted worker and the client gets the uninterrupted answer."""
    img = image(50)
    expected = vision_reference.greedy(template_messages(1), [img], 400, ignore_eos=True)
    body = {"model": MODEL, "messages": openai_messages(data_url(img)), "max_tokens": 400, "temperature": 0,
            "ignore_eos": True, "stream": True}
    pid = vision_server.health()["worker"]["pid"]
    text = ""
    with httpx.stream("POST", vision_server.url + "/v1/chat/completions", json=body, timeout=120) as r:
        for n, line in enumerate(r.iter_lines()):
            if n == 20:
                os.kill(pid, signal.SIGKILL)
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                text += choice["delta"].get("content") or ""
    assert text == expected.text
    health = vision_server.health()
    assert health["supervisor"]["restarts"] == 1
    assert health["worker"]["requests_resumed"] == 1


def test_ollama_image_answer_equals_mlx_vlm(vision_server, vision_reference):
    img = image(6)
    expected = vision_reference.greedy(template_messages(1), [img], 12)
    client = ollama.Client(host=vision_server.url)
    message = {"role": "user", "content": QUESTION, "images": [base64.b64encode(encoded(img)).decode()]}
    answer = client.chat(model=MODEL, messages=[message], options={"temperature": 0, "num_predict": 12})
    assert answer.message.content == expected.text
    assert "vision" in client.show(MODEL).capabilities


def test_ministral3_scales_each_requests_attention_by_its_own_position(tmp_path):
    """Ministral 3's text model scales its queries by how far past its
    original context a position lies (Llama 4's scaling). mlx-vlm's takes the
    batch's first row's position for every row: batched, a request was
    scaled by another's position. Each must answer as it does alone."""
    model = make_tiny_vision_model(tmp_path / "ministral3", family="mistral3", ministral3=True)
    prompts = ["Hi.", "Count the waves. " * 6, "Tell me about the lighthouse keeper and the sea. " * 4, "Go on."]
    with running(["serve", "--model", str(model), "--served-model-name", MODEL], tmp_path / "serve.log") as server:
        def ask(prompt: str) -> str:
            body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 24,
                    "temperature": 0, "ignore_eos": True}
            return server.http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]

        alone = [ask(p) for p in prompts]
        with ThreadPoolExecutor(len(prompts)) as pool:
            together = list(pool.map(ask, prompts))
    from tests.reference import VisionReference

    reference = VisionReference(model)
    assert alone == [reference.greedy([{"role": "user", "content": p}], [], 24, ignore_eos=True).text
                     for p in prompts]
    assert together == alone


def test_ollama_chat_past_the_context_leaves_out_the_old_turns_images(vision_model, vision_server, vision_reference):
    """The turns left out to fit the context (Ollama's way) take their images
    with them: the kept turn's image is the one the model sees."""
    if vision_model.name != FAMILIES[0]:
        pytest.skip("leaving out turns is the gateway's: the same for every family")
    old, new = image(70), image(71)
    filler = "The keeper counted the ships that passed the rocks, one by one, night after night. " * 6
    turns = [([old], "Look at this first."), ([], filler), ([], filler), ([], filler), ([new], QUESTION)]
    history, template = [], []
    for i, (images, text) in enumerate(turns):
        encoded_images = [base64.b64encode(encoded(img)).decode() for img in images]
        history += [{"role": "user", "content": text, "images": encoded_images}]
        template += [{"role": "user", "content": [{"type": "image"}] * len(images) + [{"type": "text", "text": text}]}]
        if i < len(turns) - 1:
            history.append({"role": "assistant", "content": filler})
            template.append({"role": "assistant", "content": filler})

    def length(start: int) -> int:
        kept_images = [img for images, _ in turns[start // 2:] for img in images]
        return vision_reference.inputs(template[start:], kept_images)["input_ids"].size

    assert length(0) >= 2048
    start = next(s for s in range(2, len(template), 2) if length(s) < 2048)
    kept_images = [img for images, _ in turns[start // 2:] for img in images]
    expected = vision_reference.greedy(template[start:], kept_images, 12)
    answer = ollama.Client(host=vision_server.url).chat(model=MODEL, messages=history,
                                                        options={"temperature": 0, "num_predict": 12})
    assert answer.message.content == expected.text
    assert answer.prompt_eval_count == length(start)
