"""Bytes per zeroth-order update: the signed batch alone, and on the wire with everything.

For H updates per batch (one batch per node and round), prints per update:
- ``payload``: the msgpack batch (node/algorithms/zo/zolog.py), before any framing;
- ``gossip_wire`` and ``pull_wire``: TCP payload bytes the sender's socket actually wrote
  to deliver the batches by gossip, and by a pull, between two real libp2p hosts on
  loopback (our frame, GossipSub's signed message, Yamux, Noise), with the same idle
  interval measured first and subtracted (heartbeats and gossip control traffic).
The issue's target: ≤ 16 bytes of payload per update.

    python bench/zo_bytes.py [--batches 20] [--sizes 1,10,32,50,256]
"""

import argparse
import contextlib
import json
import logging

import trio

from node.algorithms.zo import zolog, zosync
from protocol.net import gossip
from protocol.net.host import open_host, parse_dial_addr

logging.getLogger("libp2p").addHandler(logging.NullHandler())
RUN = "bench-zo-abcdef"
SEEDS = [bytes([1]) * 32, bytes([2]) * 32]


class Counter:
    def __init__(self) -> None:
        self.nbytes = 0


def count_sends(stream: trio.SocketStream, counter: Counter) -> None:
    original = stream.send_all

    async def send_all(data: bytes | bytearray | memoryview) -> None:
        counter.nbytes += len(data)
        await original(data)

    stream.send_all = send_all  # type: ignore[method-assign]


async def measure(size: int, batches: int) -> dict[str, float]:
    members = {zolog.peer_id_of(s) for s in SEEDS}
    async with (
        open_host(identity_seed=SEEDS[0], listen_addrs=["/ip4/127.0.0.1/tcp/0"], announce_addrs=[]) as a,
        open_host(identity_seed=SEEDS[1], listen_addrs=["/ip4/127.0.0.1/tcp/0"], announce_addrs=[]) as b,
    ):
        logs = [zolog.UpdateLog(RUN, is_member=members.__contains__) for _ in range(2)]
        syncs = [zosync.ZoLogSync(host, log, current_round=lambda: 0) for host, log in zip((a, b), logs, strict=True)]
        for sync in syncs:
            sync.register()
        await b.connect(parse_dial_addr(a.addrs()[0]), timeout_s=10)
        topic = gossip.topic(RUN)
        received = trio.Event()
        got = 0

        async def listen() -> None:
            nonlocal got
            async with contextlib.aclosing(b.subscribe(topic)) as messages:
                async for message in messages:
                    await syncs[1].receive_hint(message.from_peer, gossip.decode(message.data).batch)  # type: ignore[union-attr]
                    got += 1
                    if got == batches:
                        received.set()

        counter = Counter()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(listen)
            await trio.sleep(2.0)  # the mesh forms (GossipSub heartbeats)
            for stream in a.socket_streams(b.peer_id):
                count_sends(stream, counter)
            raws = []
            for k in range(batches):
                rounds = [k] * size
                raws.append(zolog.sign_batch(SEEDS[0], RUN, k * size, rounds, bytes(size)).encode())
            for raw in raws:  # the publisher's own log holds them too (for the pull below)
                await syncs[0].add(zolog.decode_batch(raw, RUN))
            started, before = trio.current_time(), counter.nbytes
            for raw in raws:
                await a.publish(topic, gossip.encode(gossip.ZoBatch(raw)))
            with trio.fail_after(30):
                await received.wait()
            elapsed = trio.current_time() - started
            gossip_bytes = counter.nbytes - before
            idle_before = counter.nbytes
            await trio.sleep(elapsed)  # the same interval with nothing published
            idle = counter.nbytes - idle_before
            # The pull path: a fresh log on b asks a for everything.
            syncs[1].log = zolog.UpdateLog(RUN, is_member=members.__contains__)
            pull_before = counter.nbytes
            await syncs[1].pull(a.peer_id)
            pull_bytes = counter.nbytes - pull_before
            nursery.cancel_scope.cancel()
    updates = size * batches
    return {
        "updates_per_batch": size,
        "payload": round(sum(len(r) for r in raws) / updates, 2),
        "gossip_wire": round((gossip_bytes - idle) / updates, 2),
        "pull_wire": round(pull_bytes / updates, 2),
        "idle_bytes_subtracted": idle,
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--sizes", default="1,10,32,50,256")
    args = parser.parse_args()
    rows = [await measure(int(s), args.batches) for s in args.sizes.split(",")]
    for row in rows:
        row["payload_target_met"] = row["payload"] <= 16
    print(json.dumps({"bench": "zo_bytes", **vars(args), "results": rows}, indent=2))


if __name__ == "__main__":
    trio.run(main)
