"""The link answering Hellos and sending requests: replicas that say Hello
together share one tokenizer load; a worker gone before its answer is not
taken on; a retried Hello with a Goodbye behind it leaves no worker; a Hello
the gateway cannot serve is refused with the reason; a request whose send
fails waits for the next worker; an embedding whose send fails is refused at once;
outputs nobody here reads are aborted in the worker that sent them; a worker
back over a new tcp connection has its requests taken back, one whose retried
Hello crossed its Welcome over ipc keeps them."""

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import zmq
import zmq.auth

from gateway.curve import generate
from gateway.output_processor import RequestState
from gateway.worker_link import WorkerLink, WorkerState, WorkerUnavailable
from protocol import (
    PROTOCOL_VERSION,
    Abort,
    AddRequest,
    Goodbye,
    Hello,
    Refused,
    RequestOutput,
    Sampling,
    StepOutput,
    Welcome,
    decode_to_worker,
    encode,
)
from tests.conftest import free_port


def hello(files: dict[str, bytes], epoch: int, **fields) -> bytes:
    return encode(Hello(PROTOCOL_VERSION, epoch, 1000 + epoch, "tiny", 2048, 384, 8, [2], files, **fields))


@asynccontextmanager
async def link_and_workers(endpoint: str, count: int,
                           keys: Path | None = None) -> AsyncIterator[tuple[WorkerLink, list[zmq.Socket]]]:
    """A started link and `count` connected worker sockets (DEALERs named worker-1...);
    `keys`: a directory to make CURVE keys in, which a tcp endpoint needs."""
    curve: tuple[str | None, str | None] = (None, None)
    if keys is not None:
        gateway_public, gateway_secret = generate(keys / "gateway", "gateway")
        worker_public, worker_secret = generate(keys / "worker", "worker")
        (keys / "allowed").mkdir(mode=0o700)
        (keys / "allowed" / "worker.key").write_bytes(worker_public.read_bytes())
        curve = (str(gateway_secret), str(keys / "allowed"))
    link = WorkerLink(endpoint, worker_timeout_s=30, hung_worker_s=30, worker_wait_s=5,
                      curve_secret_key=curve[0], curve_authorized_keys=curve[1])
    link.bind()
    await link.start()
    context = zmq.Context()
    sockets = []
    try:
        for epoch in range(1, count + 1):
            socket = context.socket(zmq.DEALER)
            socket.setsockopt(zmq.IDENTITY, f"worker-{epoch}".encode())
            if keys is not None:
                socket.curve_publickey, socket.curve_secretkey = zmq.auth.load_certificate(worker_secret)
                socket.curve_serverkey, _ = zmq.auth.load_certificate(gateway_public)
            socket.connect(endpoint)
            sockets.append(socket)
        yield link, sockets
    finally:
        for socket in sockets:
            socket.close(linger=0)
        context.term()
        await link.close()


async def until(condition: Callable[[], bool]) -> None:
    """Every turn of the loop: a state that lasts a few milliseconds is seen."""
    async with asyncio.timeout(30):
        while not condition():
            await asyncio.sleep(0)


async def answer(socket: zmq.Socket):
    """The gateway's next message to this worker."""
    await until(lambda: socket.poll(0))
    return decode_to_worker(socket.recv_multipart())[0]


async def welcomed(link: WorkerLink, socket: zmq.Socket, files: dict[str, bytes], epoch: int) -> WorkerState:
    """The worker on `socket` (worker-`epoch`), once it has said Hello and been welcomed."""
    socket.send(hello(files, epoch))
    assert isinstance(await answer(socket), Welcome)
    return link.workers[f"worker-{epoch}".encode()]


def disconnected(socket: zmq.Socket) -> None:
    """The worker's connection gone: ZeroMQ has dropped it, the link's loop has not heard yet."""
    socket.close(linger=0)
    time.sleep(0.2)


def tokenizer_files(tiny_model) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in tiny_model.iterdir() if p.suffix == ".json"}


def test_replicas_saying_hello_together_share_one_tokenizer(tiny_model, tmp_path):
    files = tokenizer_files(tiny_model)

    async def accept_three() -> set[int]:
        """The tokenizer objects of the three accepted workers."""
        async with link_and_workers(f"ipc://{tmp_path}/link/w.sock", 3) as (link, sockets):
            # All three are in before the first tokenizer load (tens of ms) ends.
            for epoch, socket in enumerate(sockets, 1):
                socket.send(hello(files, epoch))
            await until(lambda: len(link.workers) == 3)
            assert link.stats.workers_accepted == 3
            return {id(w.tokenizer) for w in link.workers.values()}

    assert len(asyncio.run(accept_three())) == 1


def test_a_worker_gone_before_its_hello_is_answered_is_not_taken_on(tiny_model, tmp_path):
    """Killed while the gateway loads its tokenizer: no worker is registered
    (nor would waiting requests be resumed on it)."""
    files = tokenizer_files(tiny_model)

    async def run() -> None:
        async with link_and_workers(f"ipc://{tmp_path}/link/w.sock", 1) as (link, (socket,)):
            socket.send(hello(files, 1))
            await until(lambda: link._accepting)
            socket.close(linger=0)
            await until(lambda: not link._accepting)
            assert not link.workers and link.stats.workers_accepted == 0

    asyncio.run(run())


def test_a_retried_hello_with_a_goodbye_behind_it_leaves_no_worker(tiny_model, tmp_path):
    files = tokenizer_files(tiny_model)

    async def run() -> None:
        async with link_and_workers(f"ipc://{tmp_path}/link/w.sock", 1) as (link, (socket,)):
            await welcomed(link, socket, files, 1)
            # Its retry crossed our Welcome; then it stops. Both arrive before the link reads either.
            socket.send(hello(files, 1))
            socket.send(encode(Goodbye("stopping")))
            await until(lambda: not link.workers)
            await asyncio.sleep(0.5)  # a late answer to the retry would register it again by now
            assert not link.workers and link.stats.workers_accepted == 1

    asyncio.run(run())


def test_a_hello_the_gateway_cannot_serve_is_refused_with_the_reason(tiny_model, tmp_path):
    """A tool-call parser module without a parser's parts (mlx-lm's package
    itself): refused, with the reason, not left to say Hello forever."""
    files = tokenizer_files(tiny_model)

    async def run() -> None:
        async with link_and_workers(f"ipc://{tmp_path}/link/w.sock", 1) as (link, (socket,)):
            socket.send(hello(files, 1, tool_parser="__init__"))
            refused = await answer(socket)
            assert isinstance(refused, Refused) and "cannot serve this worker" in refused.reason
            assert not link.workers

    asyncio.run(run())


def test_a_request_whose_send_fails_waits_for_the_next_worker(tiny_model, tmp_path):
    """The worker's connection is gone when a request is sent to it (over tcp
    perhaps a network blip it comes back from): the request is not lost in
    the send, it goes to the next worker that says Hello."""
    files = tokenizer_files(tiny_model)

    async def run() -> None:
        async with link_and_workers(f"ipc://{tmp_path}/link/w.sock", 2) as (link, (first, second)):
            worker = await welcomed(link, first, files, 1)
            disconnected(first)
            state = RequestState("r1", asyncio.Queue(), [1, 2, 3], Sampling(max_tokens=4), worker.tokenizer, [])
            link.submit(state, worker)
            assert link.requests_waiting == 1
            await welcomed(link, second, files, 2)
            request = await answer(second)
            assert isinstance(request, AddRequest) and request.request_id == "r1@1"  # its second attempt
            assert link.requests_waiting == 0 and state.worker == b"worker-2"

    asyncio.run(run())


def test_an_embedding_whose_send_fails_is_refused_at_once(tiny_model, tmp_path):
    """Its Embed never reached the worker: waiting for the answer would be for ever."""
    files = tokenizer_files(tiny_model)

    async def run() -> None:
        async with link_and_workers(f"ipc://{tmp_path}/link/w.sock", 1) as (link, (socket,)):
            worker = await welcomed(link, socket, files, 1)
            disconnected(socket)
            async with asyncio.timeout(5):
                try:
                    await link.embed("e1", [[1, 2, 3]], worker)
                except WorkerUnavailable:
                    return
            raise AssertionError("the embedding was answered")

    asyncio.run(run())


def test_outputs_nobody_reads_are_aborted_in_the_worker(tiny_model, tmp_path):
    """A request that ended here while its Abort could not reach the worker (a
    tcp connection down), and a request of a worker the link does not know
    (lost, or a gateway's before a restart): the worker is told to stop them."""
    files = tokenizer_files(tiny_model)

    async def run() -> None:
        async with link_and_workers(f"ipc://{tmp_path}/link/w.sock", 2) as (link, (known, stranger)):
            await welcomed(link, known, files, 1)
            known.send(encode(StepOutput(7, [RequestOutput("ended-here", [5]), RequestOutput("done", [5], "length")])))
            assert await answer(known) == Abort(["ended-here"])
            stranger.send(encode(StepOutput(3, [RequestOutput("old-1", [5]), RequestOutput("old-2", [6])])))
            assert await answer(stranger) == Abort(["old-1", "old-2"])
            assert list(link.workers) == [b"worker-1"]

    asyncio.run(run())


def test_a_worker_back_over_a_new_tcp_connection_has_its_requests_resumed_as_new_attempts(tiny_model, tmp_path):
    """What a worker sends while its tcp connection is down is lost (ZeroMQ drops it): its
    requests are taken back and resumed from what arrived, and the old attempt's
    outputs, still on the way, reach nobody."""
    files = tokenizer_files(tiny_model)

    async def run() -> None:
        async with link_and_workers(f"tcp://127.0.0.1:{free_port()}", 1, tmp_path / "keys") as (link, (socket,)):
            worker = await welcomed(link, socket, files, 1)
            state = RequestState("r1", asyncio.Queue(), [1, 2, 3], Sampling(max_tokens=8), worker.tokenizer, [])
            link.outputs.add(state)
            link.submit(state, worker)
            assert (await answer(socket)).request_id == "r1"
            socket.send(encode(StepOutput(1, [RequestOutput("r1", [5])])))
            await until(lambda: state.generated == [5])
            socket.send(hello(files, 1))  # its connection dropped (outputs lost with it) and came back
            assert isinstance(await answer(socket), Welcome)
            assert await answer(socket) == Abort(["r1"])
            resumed = await answer(socket)
            assert isinstance(resumed, AddRequest) and resumed.request_id == "r1@1"
            assert resumed.prompt_token_ids == [1, 2, 3, 5] and resumed.generated_tokens == 1
            socket.send(encode(StepOutput(2, [RequestOutput("r1", [6])])))  # the old attempt's, late
            assert await answer(socket) == Abort(["r1"])
            socket.send(encode(StepOutput(3, [RequestOutput("r1@1", [7])])))
            await until(lambda: state.generated == [5, 7])

    asyncio.run(run())


def test_a_retried_hello_over_ipc_leaves_the_workers_requests_where_they_run(tiny_model, tmp_path):
    """Over ipc a connection lives as long as its worker: a second Hello is one whose retry crossed
    the Welcome (a gateway slow to load the tokenizer). Its requests were taken back and sent again,
    their work redone, and counted as resumed a second time."""
    files = tokenizer_files(tiny_model)

    async def run() -> None:
        async with link_and_workers(f"ipc://{tmp_path}/link/w.sock", 1) as (link, (socket,)):
            worker = await welcomed(link, socket, files, 1)
            state = RequestState("r1", asyncio.Queue(), [1, 2, 3], Sampling(max_tokens=8), worker.tokenizer, [])
            link.outputs.add(state)
            link.submit(state, worker)
            assert (await answer(socket)).request_id == "r1"
            socket.send(hello(files, 1))
            assert isinstance(await answer(socket), Welcome)
            await asyncio.sleep(0.2)
            assert not socket.poll(0)  # no Abort, no request sent again
            socket.send(encode(StepOutput(1, [RequestOutput("r1", [5])])))
            await until(lambda: state.generated == [5])
            assert state.worker == worker.identity and link.stats.requests_resumed == 0

    asyncio.run(run())
