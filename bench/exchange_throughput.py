"""Tensor-exchange throughput vs a raw TCP socket, same run, loopback.

Each side is its own process (as two nodes would be). Measures the exchange protocol with
its bytes on the libp2p stream (Noise + Yamux) and on the direct data channel
(protocol/net/data_channel.py), and plain trio TCP as the baseline. Prints one JSON object;
the issue's target is exchange ≥ 50% of raw TCP.

    python bench/exchange_throughput.py [--mib 256] [--repeats 2]
"""

import argparse
import json
import logging
import multiprocessing
import time

import trio

MIB = 1 << 20
# libp2p's loggers do not propagate; without a handler, Python prints its teardown noise.
logging.getLogger("libp2p").addHandler(logging.NullHandler())


def _exchange_receiver(addr_queue: "multiprocessing.Queue[str]", done_queue: "multiprocessing.Queue[int]") -> None:
    from protocol.net.data_channel import DataChannel
    from protocol.net.exchange import Payload, TensorReceiver, any_transfer
    from protocol.net.host import open_host

    async def main() -> None:
        async with open_host(
            identity_seed=b"\x02" * 32, listen_addrs=["/ip4/127.0.0.1/tcp/0"], announce_addrs=[]
        ) as host:

            async def accept(peer_id: str, payload: Payload) -> None:
                done_queue.put(len(payload.data))

            async with trio.open_nursery() as nursery:
                channel = DataChannel("127.0.0.1")
                await nursery.start(channel.run)
                receiver = TensorReceiver(
                    host, accept, authorize=any_transfer, max_payload_nbytes=8 << 30, timeout_s=600, channel=channel
                )
                receiver.register()
                addr_queue.put(host.addrs()[0])

    trio.run(main)


def _tcp_receiver(port_queue: "multiprocessing.Queue[int]") -> None:
    async def main() -> None:
        async def handle(stream: trio.SocketStream) -> None:
            total = 0
            while chunk := await stream.receive_some(MIB):
                total += len(chunk)
            await stream.send_all(total.to_bytes(8, "big"))

        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        port_queue.put(listeners[0].socket.getsockname()[1])
        await trio.serve_listeners(handle, listeners)

    trio.run(main)


async def _send_exchange(addr: str, data: bytes, done_queue: "multiprocessing.Queue[int]", direct: bool) -> float:
    from protocol.net.exchange import Payload, TensorSpec, send_tensors
    from protocol.net.host import open_host, parse_dial_addr

    async with open_host(identity_seed=b"\x01" * 32, listen_addrs=["/ip4/127.0.0.1/tcp/0"], announce_addrs=[]) as host:
        target = parse_dial_addr(addr)
        await host.connect(target, timeout_s=10)
        payload = Payload(0, (TensorSpec("w", "uint8", (len(data),)),), data)
        started = time.perf_counter()
        await send_tensors(host, target.peer_id, payload, timeout_s=600, direct=direct)
        elapsed = time.perf_counter() - started
    assert done_queue.get(timeout=60) == len(data)
    return elapsed


async def _send_tcp(port: int, data: bytes) -> float:
    started = time.perf_counter()
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    view = memoryview(data)
    for offset in range(0, len(data), MIB):
        await stream.send_all(view[offset : offset + MIB])
    await stream.send_eof()
    reply = await stream.receive_some(8)
    elapsed = time.perf_counter() - started
    await stream.aclose()
    assert int.from_bytes(reply, "big") == len(data)
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    data = bytes(range(256)) * (args.mib * MIB // 256)
    ctx = multiprocessing.get_context("spawn")
    addr_queue: multiprocessing.Queue[str] = ctx.Queue()
    done_queue: multiprocessing.Queue[int] = ctx.Queue()
    port_queue: multiprocessing.Queue[int] = ctx.Queue()
    receivers = [
        ctx.Process(target=_exchange_receiver, args=(addr_queue, done_queue), daemon=True),
        ctx.Process(target=_tcp_receiver, args=(port_queue,), daemon=True),
    ]
    for process in receivers:
        process.start()
    try:
        addr, port = addr_queue.get(timeout=60), port_queue.get(timeout=60)
        stream_s = min(trio.run(_send_exchange, addr, data, done_queue, False) for _ in range(args.repeats))
        direct_s = min(trio.run(_send_exchange, addr, data, done_queue, True) for _ in range(args.repeats))
        tcp_s = min(trio.run(_send_tcp, port, data) for _ in range(args.repeats))
    finally:
        for process in receivers:
            process.terminate()

    def mb_per_s(seconds: float) -> float:
        return round(len(data) / seconds / 1e6, 1)

    print(
        json.dumps(
            {
                "bench": "exchange_throughput",
                "payload_mib": args.mib,
                "raw_tcp_mb_per_s": mb_per_s(tcp_s),
                "exchange_direct_mb_per_s": mb_per_s(direct_s),
                "exchange_stream_mb_per_s": mb_per_s(stream_s),
                "ratio_direct_vs_tcp": round(tcp_s / direct_s, 4),
                "ratio_stream_vs_tcp": round(tcp_s / stream_s, 4),
                "target_ratio": 0.5,
                "note": "best of repeats; exchange includes the header, BLAKE3 on both sides and the verdict",
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
