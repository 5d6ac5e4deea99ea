"""A worker that is an mx.distributed group: two ranks over MLX's ring backend
on loopback, each holding half of every layer of the tiny model (tensor
parallel), serving through a real gateway. Every answer must equal mlx-lm's
single-process output, token for token."""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import signal
import socket
import subprocess
from pathlib import Path

import httpx
import jsonschema
import numpy as np
import pytest
from mlx.utils import tree_flatten

from protocol import EXIT_LOAD_FAILED
from tests.conftest import MLXD, MODEL_NAME, ROOT, Server, free_port, free_ports, running, wait_for
from tests.reference import Reference
from tests.test_embeddings import expected as expected_embedding
from tests.test_restarts import StreamReader
from tests.test_structured import ASK, SCHEMA, json_schema_format
from tests.tiny_model import QWEN3_NEXT, make_tiny_model

PROMPTS = [
    "The quick brown fox",
    "Paris is the capital of",
    "Once upon a time there was",
    "Tokens flow from the worker",
]
CHUNK = 32  # prompt tokens per prefill step: the long prompt below takes several
LONG_PROMPT = " ".join(["Numbers 0 1 2 3 4 5 6 7 8 9 and symbols ! ? , . : ;"] * 12)


def group_args(model, *extra: str) -> list[str]:
    return ["serve", "--model", str(model), "--served-model-name", MODEL_NAME, "--heartbeat-s", "0.1",
            "--distributed-hosts", "127.0.0.1,127.0.0.1", "--distributed-port", str(free_ports(2)),
            "--max-batch", "4", "--prefill-chunk", str(CHUNK), *extra]


@pytest.fixture(scope="module")
def group(tiny_model, tmp_path_factory):
    with running(group_args(tiny_model), tmp_path_factory.mktemp("distributed") / "serve.log",
                 env={"MLXD_AFFINITY_AUDIT": "1"}) as server:
        yield server


def complete(server: Server, prompt: str, max_tokens: int = 24) -> dict:
    r = server.http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
                                                  "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()


def parameter_bytes(module) -> int:
    return sum(a.nbytes for _, a in tree_flatten(module.parameters()))


def ranks_of(server: Server) -> list[dict]:
    return server.health()["worker"].get("ranks", [])


def test_the_group_is_one_worker_of_two_ranks(group, reference):
    worker = group.health()["worker"]
    assert [r["rank"] for r in worker["ranks"]] == [0, 1]
    pids = [r["pid"] for r in worker["ranks"]]
    assert len(set(pids)) == 2 and worker["pid"] not in pids  # the gateway knows the group by its launcher
    for pid in pids:
        os.kill(pid, 0)  # alive, on this host
        # The two ranks share this machine's cores: each gets its part for its BLAS threads.
        environment = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        threads = os.environ.get("OPENBLAS_NUM_THREADS", str(max(1, os.cpu_count() // 2)))
        assert f"OPENBLAS_NUM_THREADS={threads}".encode() in environment
    wait_for(lambda: "affinity" in group.health()["worker"], 5, "rank 0's first heartbeat")
    assert group.health()["worker"]["affinity"]["off_main_thread"] == 0
    # Its weights are its ranks' summed: half of every layer each, the embeddings and head on both.
    whole = parameter_bytes(reference.model)
    assert whole < worker["weights_bytes"] < 2 * whole
    (ledger,) = group.health()["pool"]["models"].values()
    assert ledger["memory"]["weights"] == worker["weights_bytes"]


def test_four_concurrent_requests_equal_one_process(group, reference):
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        answers = list(pool.map(lambda p: complete(group, p)["choices"][0]["text"], PROMPTS))
    for prompt, answer in zip(PROMPTS, answers):
        assert answer == reference.greedy(reference.text_prompt(prompt), 24, ignore_eos=True).text


def test_a_prompt_longer_than_a_prefill_chunk_equals_one_process(group, reference):
    prompt = reference.text_prompt(LONG_PROMPT)
    assert len(prompt) > 3 * CHUNK
    answer = complete(group, LONG_PROMPT, 16)
    assert answer["usage"]["prompt_tokens"] == len(prompt)
    assert answer["choices"][0]["text"] == reference.greedy(prompt, 16, ignore_eos=True).text


def test_pipeline_sharding_equals_one_process(tmp_path_factory):
    """--sharding pipeline: each rank holds a run of the layers (mlx-lm's
    pipeline() of qwen2) and passes its hidden state on to the next rank."""
    model = make_tiny_model(tmp_path_factory.mktemp("models") / "qwen2", model_type="qwen2", layers=4,
                            weight_index=True)
    reference = Reference(model)
    with running(group_args(model, "--sharding", "pipeline"), tmp_path_factory.mktemp("pipeline") / "serve.log") \
            as server:
        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            answers = list(pool.map(lambda p: complete(server, p)["choices"][0]["text"], PROMPTS))
        for prompt, answer in zip(PROMPTS, answers):
            assert answer == reference.greedy(reference.text_prompt(prompt), 24, ignore_eos=True).text
        long_prompt = reference.text_prompt(LONG_PROMPT)
        assert complete(server, LONG_PROMPT, 16)["choices"][0]["text"] == \
            reference.greedy(long_prompt, 16, ignore_eos=True).text
        # Each rank holds its layers whole, and both the embeddings, the final norm and the head (tensor
        # sharding would hold every layer's norms twice too).
        shared = reference.model.model.embed_tokens, reference.model.model.norm, reference.model.lm_head
        assert server.health()["worker"]["weights_bytes"] == \
            parameter_bytes(reference.model) + sum(map(parameter_bytes, shared))


def test_a_pipeline_of_hybrid_layers_reuses_only_what_every_rank_holds(tmp_path_factory):
    """Qwen3-Next's layers (Qwen 3.5's kind) split by --sharding pipeline: one
    rank holds the full-attention layer, whose KV cache can be cut shorter,
    the other the linear-attention layer, whose fixed-size state cannot. A
    prompt sharing only the start of a cached one was a hit on the first rank
    alone: the ranks prefilled different lengths, answered wrongly and then
    crashed. They agree on what they reuse now: nothing there, and the whole
    of the last turn for a conversation's next one."""
    model = make_tiny_model(tmp_path_factory.mktemp("models") / "qwen3_next", model_type="qwen3_next", layers=2,
                            weight_index=True, extra_config=QWEN3_NEXT)
    reference = Reference(model)
    first = list(range(10, 50))

    def answer(prompt: list[int]) -> dict:
        r = server.http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 8,
                                                      "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == reference.greedy(prompt, 8, ignore_eos=True).text
        return r.json()["usage"]

    with running(group_args(model, "--sharding", "pipeline"), tmp_path_factory.mktemp("hybrid") / "serve.log") \
            as server:
        worker = server.health()["worker"]["pid"]
        answer(first)
        assert answer(first[:30] + list(range(60, 70)))["prompt_tokens_details"]["cached_tokens"] == 0
        next_turn = first + reference.greedy(first, 8, ignore_eos=True).token_ids + list(range(70, 80))
        assert answer(next_turn)["prompt_tokens_details"]["cached_tokens"] >= len(first)
        assert server.health()["worker"]["pid"] == worker
        assert "Traceback" not in server.log_path.read_text()


def test_a_model_over_this_machines_budget_loads_as_a_group(tiny_model, tmp_path, reference):
    """The memory budget is this machine's, and a group's ranks split the
    model: the pool charges this machine its share, so a model one byte
    larger than the budget loads and serves. The pool still shows the
    group's whole memory."""
    size = (tiny_model / "model.safetensors").stat().st_size
    args = group_args(tiny_model, "--memory-budget", str(size - 1), "--prefix-cache-bytes", "0")
    with running(args, tmp_path / "serve.log") as server:
        assert complete(server, PROMPTS[0])["choices"][0]["text"] == \
            reference.greedy(reference.text_prompt(PROMPTS[0]), 24, ignore_eos=True).text
        pool = server.health()["pool"]
        (entry,) = pool["models"].values()
        assert entry["memory"]["weights"] == server.health()["worker"]["weights_bytes"] > pool["budget"]
        assert 0 < pool["used"] == entry["memory"]["here"] <= pool["budget"] < entry["memory"]["total"]


def test_structured_output_and_logprobs_equal_one_process(group, server):
    """Every rank runs the grammar engine and the logprobs as one worker does:
    a schema-constrained answer equals a single worker's, and so do an
    answer's top logprobs (to the rounding of a sum over two shards)."""
    body = {"model": MODEL_NAME, "messages": ASK, "max_tokens": 120, "temperature": 0,
            "response_format": json_schema_format(SCHEMA)}
    mine, theirs = (s.http.post("/v1/chat/completions", json=body).json()["choices"][0] for s in (group, server))
    assert mine["message"]["content"] == theirs["message"]["content"]
    jsonschema.validate(json.loads(mine["message"]["content"]), SCHEMA)
    body = {"model": MODEL_NAME, "messages": ASK, "max_tokens": 16, "temperature": 0, "logprobs": True,
            "top_logprobs": 3, "ignore_eos": True}
    mine, theirs = (s.http.post("/v1/chat/completions", json=body).json()["choices"][0]["logprobs"]["content"]
                    for s in (group, server))
    assert len(mine) == 16
    for a, b in zip(mine, theirs, strict=True):
        assert [t["token"] for t in a["top_logprobs"]] == [t["token"] for t in b["top_logprobs"]]
        np.testing.assert_allclose([t["logprob"] for t in a["top_logprobs"]],
                                   [t["logprob"] for t in b["top_logprobs"]], rtol=0, atol=1e-4)


def test_sampled_requests_agree_across_ranks(group):
    """Every rank must draw the same tokens, or the shards hold different
    histories and the answers turn to garbage: rank 0 sends a checksum of
    its last step's tokens with every broadcast, and a rank that drew others
    fails the group. Sampled requests, seeded or not, leave it standing."""
    ranks = ranks_of(group)
    body = {"model": MODEL_NAME, "prompt": PROMPTS[0], "max_tokens": 48, "temperature": 1.0, "seed": 7}
    first, second = (group.http.post("/v1/completions", json=body).json() for _ in range(2))
    assert first["choices"][0]["text"] == second["choices"][0]["text"]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        statuses = list(pool.map(lambda _: group.http.post("/v1/completions", json={**body, "seed": None}).status_code,
                                 range(4)))
    assert statuses == [200] * 4
    assert ranks_of(group) == ranks and group.health()["supervisor"]["restarts"] == 0


def test_embeddings_beside_a_stream_equal_one_process(group, reference):
    """Every rank runs the embedding (its shard's layers), between the stream's steps; a long
    input a part a turn on every rank, each rank carrying its shard's KV state to the next part."""
    reader = StreamReader(group.url, max_tokens=200)
    reader.start()
    reader.wait_for_pieces(5)
    inputs = [reference.text_prompt(p) for p in PROMPTS] + [[(7 * i) % 380 + 3 for i in range(1000)]]
    body = group.http.post("/v1/embeddings", json={"model": MODEL_NAME, "input": inputs}).json()
    assert len(body["data"]) == len(inputs)
    for item, ids in zip(body["data"], inputs):
        # Summed over two shards, the hidden states round apart from one process's by a float's last bits.
        np.testing.assert_allclose(item["embedding"], expected_embedding(reference, ids), rtol=0, atol=1e-5)
    reader.join(60)
    assert reader.failure is None and reader.done


def test_an_abort_frees_the_slot_on_every_rank(group, reference):
    """Four long streams fill the batch; one client goes away. The request that
    takes its slot is batched with the other three on both ranks: a rank that
    kept the aborted one would run another batch than its peer and the group
    would fail or answer wrongly."""
    readers = [StreamReader(group.url, max_tokens=400) for _ in range(3)]
    for r in readers:
        r.start()
    with httpx.stream("POST", group.url + "/v1/completions", timeout=60,
                      json={"model": MODEL_NAME, "prompt": PROMPTS[1], "max_tokens": 400, "stream": True,
                            "temperature": 0, "ignore_eos": True}) as gone:
        for _ in zip(range(5), gone.iter_lines()):
            pass
    group.wait_running(lambda running: running <= 3, 10)
    answer = complete(group, PROMPTS[2])["choices"][0]["text"]
    assert answer == reference.greedy(reference.text_prompt(PROMPTS[2]), 24, ignore_eos=True).text
    for r in readers:
        r.join(120)
        assert r.failure is None and r.errors == [] and r.done
    assert len({r.text for r in readers}) == 1
    assert group.health()["supervisor"]["restarts"] == 0


def stream_through(server: Server, reference, tokens: int, hurt) -> list[dict]:
    """A greedy stream during which `hurt(ranks)` is done to the group: it
    completes with one process's text, and every rank it had is gone (no
    half-alive group). Returns those ranks."""
    expected = reference.greedy(reference.text_prompt("Once upon a time"), tokens, ignore_eos=True).text
    reader = StreamReader(server.url, max_tokens=tokens)
    reader.start()
    reader.wait_for_pieces(20)
    before = ranks_of(server)
    hurt(before)
    reader.join(120)
    assert reader.failure is None and reader.errors == [] and reader.done
    assert reader.text == expected
    for gone in before:
        wait_for(lambda pid=gone["pid"]: not os.path.exists(f"/proc/{pid}"), 10, f"rank pid {gone['pid']} to end")
    return before


@pytest.mark.parametrize("rank", [1, 0])
def test_kill_9_of_a_rank_restarts_the_group_and_the_stream_completes(group, reference, rank):
    """Rank 1 (the gateway sees nothing until the group's process exits) or
    rank 0 (the gateway's peer)."""
    restarts, resumed = group.health()["supervisor"]["restarts"], group.health()["worker"]["requests_resumed"]
    before = stream_through(group, reference, 300, lambda ranks: os.kill(ranks[rank]["pid"], signal.SIGKILL))
    health = group.health()
    assert health["supervisor"]["restarts"] == restarts + 1 and health["worker"]["requests_resumed"] > resumed
    after = ranks_of(group)
    assert len(after) == 2 and {r["pid"] for r in after}.isdisjoint(r["pid"] for r in before)


def test_a_group_leaves_no_files_in_its_hosts_temporary_directory(tiny_model, tmp_path):
    """MLX's launch script writes each rank's pid file and hostfile (mktemp), for its own launcher: every
    start of a group left them, on every host."""
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    with running(group_args(tiny_model), tmp_path / "serve.log", env={"TMPDIR": str(temporary)}) as server:
        assert len(ranks_of(server)) == 2
        # The gateway's own socket directory (mlxd-*) and MLX's cache of CPU kernels (mlx/) aside.
        assert [p.name for p in temporary.iterdir() if not p.name.startswith("mlxd-") and p.name != "mlx"] == []


def test_a_frozen_rank_is_hung_and_the_group_is_replaced(tiny_model, tmp_path, reference):
    """SIGSTOP on rank 1: rank 0 waits in a collective, its heartbeats go on
    and its step counter stalls; the supervisor kills the group's process
    group, stopped rank included, and starts it again."""
    with running(group_args(tiny_model, "--hung-worker-s", "1.5"), tmp_path / "serve.log") as server:
        stream_through(server, reference, 200, lambda ranks: os.kill(ranks[1]["pid"], signal.SIGSTOP))
        assert "is hung" in server.log_path.read_text()


def test_a_rank_frozen_while_idle_is_found_out_by_the_next_request(tiny_model, tmp_path, reference):
    """Rank 0 waits in its idle turn's collective, reading nothing: the request
    sent to it counts as its work, so the stalled step counter makes it hung
    (its heartbeats said nothing was running) and the group is replaced."""
    with running(group_args(tiny_model, "--hung-worker-s", "1.5"), tmp_path / "serve.log") as server:
        os.kill(ranks_of(server)[1]["pid"], signal.SIGSTOP)
        expected = reference.greedy(reference.text_prompt("Once upon a time"), 8).text
        answer = server.http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "Once upon a time",
                                                           "max_tokens": 8, "temperature": 0}, timeout=120)
        assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == expected
        assert "is hung" in server.log_path.read_text()


@pytest.mark.parametrize("stop", ["launchd", "ctrl-c"])
def test_a_drain_stops_every_rank(tiny_model, tmp_path, stop):
    """`mlxd worker` stopped by launchd (SIGTERM to it) or by a terminal's
    Ctrl-C (SIGINT to its whole process group): rank 0 drains and tells rank
    1 to exit; the group's process exits 0 with both ranks gone."""
    endpoint = f"ipc://{tmp_path}/run/worker.sock"
    gateway = Server(["gateway", "--worker-endpoint", endpoint, "--served-model-name", MODEL_NAME],
                     tmp_path / "gateway.log")
    worker = subprocess.Popen(
        [*MLXD, "worker", "--model", str(tiny_model), "--worker-endpoint", endpoint, "--drain-s", "0.5",
         "--distributed-hosts", "127.0.0.1,127.0.0.1", "--distributed-port", str(free_ports(2))],
        cwd=ROOT, stdout=open(tmp_path / "worker.log", "wb"), stderr=subprocess.STDOUT, process_group=0,
    )
    try:
        gateway.wait_ready()
        ranks = ranks_of(gateway)
        assert gateway.health()["worker"]["pid"] == worker.pid
        if stop == "launchd":
            os.kill(worker.pid, signal.SIGTERM)
        else:
            os.killpg(worker.pid, signal.SIGINT)
        assert worker.wait(30) == 0
        for r in ranks:
            assert not os.path.exists(f"/proc/{r['pid']}")
    finally:
        if worker.poll() is None:
            worker.kill()  # its ranks follow: they watch their parent
        gateway.stop()


@pytest.mark.parametrize("differing", ["tokenizer files", "engine flags", "weights"])
def test_ranks_that_would_run_other_steps_do_not_start(tiny_model, tmp_path, differing):
    """Two ranks started by hand, as each Mac's own launchd job starts one,
    alike but for one thing: the second's copy of the model has a
    generation_config.json that adds an end-of-sequence id (a request that
    drew it would have ended on that rank alone), or the second batches fewer
    requests. Either way the ranks' batches would part ways: both refuse to
    start, and say in what they differ. So for a model of another shape at
    the same path, whose first sharded run (before the ranks compared their
    setups) crashed both ranks instead."""
    other, flags = tiny_model, ()
    if differing == "weights":
        other = make_tiny_model(tmp_path / "wider", hidden=128)
    elif differing == "tokenizer files":
        other = tmp_path / "other"
        shutil.copytree(tiny_model, other)
        eos = json.loads((tiny_model / "config.json").read_text())["eos_token_id"]
        (other / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, 5]}))
    else:
        flags = ("--max-batch", "2")
    hostfile = tmp_path / "hosts.json"
    first = free_ports(2)
    hostfile.write_text(json.dumps([[f"127.0.0.1:{first}"], [f"127.0.0.1:{first + 1}"]]))
    ranks = [subprocess.Popen([*MLXD, "worker", "--model", str(model), "--worker-endpoint", f"ipc://{tmp_path}/w.sock",
                               "--distributed-hosts", "127.0.0.1,127.0.0.1", *extra],
                              cwd=ROOT, env={**os.environ, "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank, (model, extra) in enumerate(((tiny_model, ()), (other, flags)))]
    try:
        for rank in ranks:
            output = rank.communicate(timeout=120)[0]
            assert rank.returncode == EXIT_LOAD_FAILED, output
            assert f"differ in their {differing}" in output, output
            assert differing == "weights" or "weights (" not in output  # the weights are the same
    finally:
        for rank in ranks:
            rank.kill()
            rank.wait()


@pytest.mark.parametrize("failing", [1, 0])
def test_a_rank_that_cannot_load_its_model_says_why_on_every_rank(tiny_model, tmp_path, failing):
    """Ranks started by hand, one of them given a model its host does not
    have: rank 0, which alone tells the gateway, said only that the
    connection to a peer was lost; the reason was in the other rank's log."""
    hostfile = tmp_path / "hosts.json"
    first = free_ports(2)
    hostfile.write_text(json.dumps([[f"127.0.0.1:{first}"], [f"127.0.0.1:{first + 1}"]]))
    missing = tmp_path / "not-on-this-host"
    ranks = [subprocess.Popen([*MLXD, "worker", "--model", str(missing if rank == failing else tiny_model),
                               "--worker-endpoint", f"ipc://{tmp_path}/w.sock",
                               "--distributed-hosts", "127.0.0.1,127.0.0.1"],
                              cwd=ROOT, env={**os.environ, "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in (0, 1)]
    try:
        for rank in ranks:
            output = rank.communicate(timeout=120)[0]
            assert rank.returncode == EXIT_LOAD_FAILED, output
            assert f"rank {failing} (" in output and str(missing) in output, output
            assert "connection to a peer was lost" not in output, output
    finally:
        for rank in ranks:
            rank.kill()
            rank.wait()


@pytest.mark.parametrize("dies", [1, 0])
def test_ranks_started_by_hand_exit_when_another_dies_while_idle(tiny_model, tmp_path, dies):
    """Each Mac's launchd job starts a rank: a rank killed while the group was idle left rank 0 waiting in
    MLX's collective for good (alive and "ready", so never started again, nor the group formed anew), and
    rank 1 ended on a traceback of garbled bytes."""
    hostfile = tmp_path / "hosts.json"
    first = free_ports(2)
    hostfile.write_text(json.dumps([[f"127.0.0.1:{first}"], [f"127.0.0.1:{first + 1}"]]))
    logs = [tmp_path / f"rank{rank}.log" for rank in (0, 1)]
    ranks = [subprocess.Popen([*MLXD, "worker", "--model", str(tiny_model), "--worker-endpoint",
                               f"ipc://{tmp_path}/w.sock", "--distributed-hosts", "127.0.0.1,127.0.0.1",
                               "--group-stall-s", "2"],
                              cwd=ROOT, env={**os.environ, "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile)},
                              stdout=open(log, "wb"), stderr=subprocess.STDOUT)
             for rank, log in enumerate(logs)]
    try:
        wait_for(lambda: all("serving: it exits" in log.read_text() for log in logs), 120, "the group to form")
        ranks[dies].kill()
        survivor = ranks[1 - dies]
        assert survivor.wait(timeout=30) == 1
        assert "is gone" in logs[1 - dies].read_text()
    finally:
        for rank in ranks:
            rank.kill()
            rank.wait()


@pytest.mark.parametrize(("hosts", "message"), [
    ("127.0.0.1", "at least two hosts"),
    ("mac-a,mac-b", "IP addresses"),
    ("127.0.0.1,", "cannot be empty"),
])
def test_hosts_that_make_no_group_are_refused(hosts, message):
    done = subprocess.run([*MLXD, "worker", "--distributed-hosts", hosts], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == EXIT_LOAD_FAILED and message in done.stderr


def test_a_rank_that_cannot_join_the_group_gives_its_reason(tiny_model):
    """Rank 1's port is taken: it cannot join the group, and logs why, while
    rank 0 waits for it. Rank 0 alone speaks to the gateway, so the group's
    launcher tells the reason: `mlxd serve` stops with it (it said only "see
    the worker's log")."""
    with socket.socket() as taken:
        port = free_ports(2)
        taken.bind(("127.0.0.1", port + 1))  # rank 1's
        taken.listen()
        done = subprocess.run([*MLXD, "serve", "--preload", "--model", str(tiny_model), "--port", str(free_port()),
                               "--distributed-hosts", "127.0.0.1,127.0.0.1", "--distributed-port", str(port)],
                              cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "cannot load the model: rank 1 (127.0.0.1): cannot join the distributed group" in done.stderr, done.stderr
    assert "restarting" not in done.stderr


def test_a_host_ssh_cannot_reach_stops_mlxd_serve_with_ssh_s_reason(tiny_model):
    """The commonest mistake (no passwordless ssh, a host that is off): ssh's own words were hidden (its
    LogLevel QUIET), the log said only "exited with status 255", and `mlxd serve --preload` retried for good."""
    done = subprocess.run([*MLXD, "serve", "--preload", "--model", str(tiny_model), "--port", str(free_port()),
                           "--distributed-hosts", "127.0.0.1,127.0.0.2", "--distributed-port", str(free_ports(2))],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "rank 1 (127.0.0.2) could not be started over ssh" in done.stderr, done.stderr
    assert "127.0.0.2" in done.stderr.partition("over ssh")[2]  # ssh's words, naming the host it could not reach
    assert "restarting" not in done.stderr


def test_jaccl_without_rdma_devices_is_refused():
    done = subprocess.run([*MLXD, "worker", "--distributed-hosts", "10.0.0.1,10.0.0.2",
                           "--distributed-backend", "jaccl"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == EXIT_LOAD_FAILED and "RDMA" in done.stderr


def test_mlxd_serve_stops_with_the_reason_hosts_make_no_group(tiny_model, tmp_path):
    """Not a crash to retry: the load fails, and `mlxd serve` says why."""
    done = subprocess.run([*MLXD, "serve", "--preload", "--model", str(tiny_model), "--port", str(free_port()),
                           "--distributed-hosts", "127.0.0.1"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode != 0 and "at least two hosts" in done.stderr
    assert "restarting" not in done.stderr
