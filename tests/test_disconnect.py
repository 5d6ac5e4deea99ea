"""A client that goes away aborts its request in the worker at once."""

from __future__ import annotations

import json
import re
import socket
import sys
from pathlib import Path

import httpx
import pytest

from gateway.output_processor import STUCK_WRITER_S
from tests.conftest import MODEL_NAME, wait_for

LONG = {"model": MODEL_NAME, "max_tokens": 1500, "temperature": 0, "ignore_eos": True}


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_streaming_client_disconnect_aborts(server, endpoint):
    server.wait_idle()
    body = dict(LONG, stream=True)
    body.update({"prompt": "Once upon a time"} if "chat" not in endpoint else {"messages": [{"role": "user", "content": "Hi"}]})
    with httpx.stream("POST", server.url + endpoint, json=body, timeout=30) as r:
        lines = r.iter_lines()
        for _ in range(10):
            next(lines)
        server.wait_running(lambda n: n == 1, timeout=5.0)
        # Leaving the block closes the connection mid-stream.
    took = server.wait_running(lambda n: n == 0, timeout=1.0)
    print(f"\nstreaming disconnect -> running 0 in {took * 1000:.0f} ms (heartbeat every 50 ms)")
    server.assert_steps_stopped()


def test_non_streaming_client_disconnect_aborts(server):
    server.wait_idle()
    body = dict(LONG, prompt="Once upon a time")
    with pytest.raises(httpx.ReadTimeout):
        # The client gives up after 0.5 s and closes its connection.
        httpx.post(server.url + "/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.5))
    took = server.wait_running(lambda n: n == 0, timeout=1.0)
    print(f"\nnon-streaming disconnect -> running 0 in {took * 1000:.0f} ms (heartbeat every 50 ms)")
    server.assert_steps_stopped()


def test_cancel_endpoint_aborts_the_request(server):
    server.wait_idle()
    body = dict(LONG, prompt="Once upon a time", stream=True)
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        request_id = json.loads(first[6:])["id"]
        assert server.http.post(f"/v1/requests/{request_id}/cancel").json() == {"id": request_id, "cancelled": True}
        rest = [line for line in lines if line.startswith("data: ")]
    assert json.loads(rest[-2][6:])["error"]["message"] == "the request was cancelled"
    assert rest[-1] == "data: [DONE]"
    server.wait_running(lambda n: n == 0, timeout=1.0)
    server.assert_steps_stopped()
    # Gone now: cancelling again, or an id that never was, is a 404.
    assert server.http.post(f"/v1/requests/{request_id}/cancel").status_code == 404
    assert server.http.post("/v1/requests/cmpl-nothing/cancel").status_code == 404



def _send_queue(local_port: int, remote_port: int) -> int:
    """The bytes the kernel holds to send on the loopback connection between these ports (/proc/net/tcp's tx_queue)."""
    ends = f"0100007F:{local_port:04X} 0100007F:{remote_port:04X}"
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if f"{fields[1]} {fields[2]}" == ends:
            return int(fields[4].split(":")[0], 16)
    raise LookupError(f"no connection {ends}")


@pytest.mark.skipif(sys.platform != "linux", reason="reads the gateway's send queue in /proc/net/tcp")
def test_a_cancel_stops_the_work_of_a_client_that_stopped_reading(server):
    """Its stream is held at a send to the client (the socket's buffers are full): the cancel ended the
    stream only once it was read again, and meanwhile the worker went on to max_tokens."""
    server.wait_idle()
    # 16 choices with 20 alternatives a token: some 25 KB a step, past loopback's megabytes of buffers at once.
    body = json.dumps({"model": MODEL_NAME, "max_tokens": 1900, "temperature": 0.5, "ignore_eos": True, "n": 16,
                       "stream": True, "logprobs": True, "top_logprobs": 20,
                       "messages": [{"role": "user", "content": "Hi"}]}).encode()
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
        sock.connect(("127.0.0.1", server.port))
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        head = b""
        while (found := re.search(rb'"id":"([^"]+)"', head)) is None:
            head += sock.recv(256)
        request_id = found.group(1).decode()
        # No more reading: the writer fills the buffers and waits. Only then does the cancel find it held at a
        # send; a gateway slower than that (a busy machine) finishes the response, which stays open for reuse.
        queued = [-1]

        def send_queue_full() -> bool:  # the same for half a second
            before, queued[0] = queued[0], _send_queue(server.port, sock.getsockname()[1])
            return queued[0] == before > 0

        wait_for(send_queue_full, 30, "the gateway's send queue to the client to fill", interval=0.5)
        cuts = server.log_path.read_text().count("its response is cut")
        assert server.health()["worker"]["running"] == 16  # still decoding: the cancel has work to stop
        steps = server.health()["worker"]["steps"]
        assert server.http.post(f"/v1/requests/{request_id}/cancel").json()["cancelled"] is True
        server.wait_running(lambda n: n == 0, timeout=1.0)
        server.assert_steps_stopped()
        assert server.health()["worker"]["steps"] - steps < 200, "the worker went on with the request"
        # Its writer never takes the cancel's error: the response is cut, and the request (its slot among
        # those in flight, its entry) is gone, while the client still holds its connection open.
        wait_for(lambda: server.http.post(f"/v1/requests/{request_id}/cancel").status_code == 404,
                 STUCK_WRITER_S + 5, "the stuck stream to be cut")
        sock.settimeout(10)
        while sock.recv(1 << 16):  # what the buffers held, then the end of the connection
            pass
    assert server.log_path.read_text().count("its response is cut") == cuts + 1
