"""The link answering Hellos: replicas that say Hello together share one tokenizer load."""

import asyncio

import zmq

from gateway.worker_link import WorkerLink
from protocol import PROTOCOL_VERSION, Hello, encode


def test_replicas_saying_hello_together_share_one_tokenizer(tiny_model, tmp_path):
    files = {p.name: p.read_bytes() for p in tiny_model.iterdir() if p.suffix == ".json"}
    endpoint = f"ipc://{tmp_path}/link/w.sock"

    async def accept_three() -> set[int]:
        """The tokenizer objects of the three accepted workers."""
        link = WorkerLink(endpoint, worker_timeout_s=30, hung_worker_s=30, worker_wait_s=5)
        link.bind()
        await link.start()
        context = zmq.Context()
        sockets = []
        try:
            for epoch in (1, 2, 3):
                socket = context.socket(zmq.DEALER)
                socket.setsockopt(zmq.IDENTITY, f"worker-{epoch}".encode())
                socket.connect(endpoint)
                sockets.append(socket)
            # All three are in before the first tokenizer load (tens of ms) ends.
            for epoch, socket in enumerate(sockets, 1):
                socket.send(encode(Hello(PROTOCOL_VERSION, epoch, 1000 + epoch, "tiny", 2048, 384, 8, [2], files)))
            async with asyncio.timeout(30):
                while len(link.workers) < 3:
                    await asyncio.sleep(0.01)
            assert link.stats.workers_accepted == 3
            return {id(w.tokenizer) for w in link.workers.values()}
        finally:
            for socket in sockets:
                socket.close(linger=0)
            context.term()
            await link.close()

    assert len(asyncio.run(accept_three())) == 1
