"""One outer sync round of a large payload with 4, 8 and 16 nodes: NoLoCo vs all-to-all.

Each node is its own process running the real protocol code (libp2p host, pairing, the
exchange over the direct data channel). The nodes connect, wait at a start line (a barrier
of this bench only), and run one round: NoLoCo pairs with one random peer and swaps
payloads; the DiLoCo baseline sends its payload to every other node and waits for all of
theirs. The round's time is when the last node is done; after one warm-up round (first
touches of the buffers) it is repeated ``--rounds`` times and the median is kept. Prints
one JSON object with each time as a ratio of the smallest N.

All nodes share this machine's CPUs and loopback, so without a cap the total work of a
round grows with N (N payloads hashed, copied and moved) and so does the time: that
measures this machine, not the protocol. ``--link-mbps`` gives every node its own upload
cap (``network.upload_limit_mbps``, the daemon's real limiter), as nodes on separate
machines have, and keeps the machine's total below what it can move; then the time shows
what the algorithm costs per node. The issue's target: 16 nodes ≤ 1.2 × the time of 4.

    python bench/sync_round.py [--mb 100] [--nodes 4,8,16] [--link-mbps 400] [--rounds 3]
"""

import argparse
import json
import logging
import multiprocessing
import os
import statistics
import sys
import time
from typing import Any

import trio

# libp2p's loggers do not propagate; without a handler, Python prints its teardown noise.
logging.getLogger("libp2p").addHandler(logging.NullHandler())
TIMEOUT_S = 600.0


def _node(
    index: int,
    algorithm: str,
    nbytes: int,
    link_mbps: float,
    commands: "multiprocessing.Queue[Any]",
    results: "multiprocessing.Queue[Any]",
) -> None:
    sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (py-libp2p print()s its shutdown noise)
    from node.algorithms.diloco import DilocoExchange
    from node.algorithms.noloco.pairing import Pairing
    from protocol.net.data_channel import DataChannel
    from protocol.net.exchange import TensorReceiver
    from protocol.net.host import open_host, parse_dial_addr
    from protocol.ratelimit import RateLimit

    async def main() -> None:
        seed = index.to_bytes(2, "big") * 16
        async with open_host(identity_seed=seed, listen_addrs=["/ip4/127.0.0.1/tcp/0"], announce_addrs=[]) as host:
            limit = RateLimit.from_mbps(link_mbps)
            pairing = Pairing(host, send_timeout_s=TIMEOUT_S, is_member=lambda _: True, upload_limit=limit)
            diloco = DilocoExchange(host, send_timeout_s=TIMEOUT_S, is_member=lambda _: True, upload_limit=limit)
            diloco.payload_nbytes = nbytes
            channel = DataChannel("127.0.0.1")
            inbox_of = pairing if algorithm == "noloco" else diloco
            async with trio.open_nursery() as nursery:
                await nursery.start(channel.run)
                await nursery.start(pairing.run)
                TensorReceiver(
                    host,
                    inbox_of.accept_payload,
                    authorize=inbox_of.authorize,
                    max_payload_nbytes=nbytes,
                    timeout_s=TIMEOUT_S,
                    channel=channel,
                ).register()
                results.put(("addr", index, host.addrs()[0]))
                addrs: list[str] = await trio.to_thread.run_sync(commands.get)
                others = [parse_dial_addr(a) for i, a in enumerate(addrs) if i != index]
                for target in others[index:]:  # each pair once: we dial those after us
                    await host.connect(target, timeout_s=30)
                results.put(("connected", index, None))
                outbox, inbox = memoryview(bytearray([index % 256]) * nbytes), memoryview(bytearray(nbytes))
                peer_ids = [t.peer_id for t in others]
                while (round_index := await trio.to_thread.run_sync(commands.get)) is not None:
                    started = time.perf_counter()
                    if algorithm == "noloco":
                        partner = await pairing.find_partner(round_index, outbox, inbox, peer_ids, timeout_s=TIMEOUT_S)
                        got = 0 if partner is None else 1
                    else:
                        got = len(await diloco.gather(round_index, outbox, peer_ids, timeout_s=TIMEOUT_S))
                    results.put(("done", index, (time.perf_counter() - started, got)))
                nursery.cancel_scope.cancel()

    trio.run(main)


def _expect(results: "multiprocessing.Queue[Any]", kind: str, count: int) -> list[Any]:
    got: list[Any] = [None] * count
    for _ in range(count):
        message_kind, index, value = results.get(timeout=TIMEOUT_S)
        if message_kind != kind:
            raise RuntimeError(f"node {index} said {message_kind!r}, expected {kind!r}")
        got[index] = value
    return got


def measure(algorithm: str, num_nodes: int, nbytes: int, link_mbps: float, rounds: int) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    results: multiprocessing.Queue[Any] = ctx.Queue()
    commands = [ctx.Queue() for _ in range(num_nodes)]
    processes = [
        ctx.Process(target=_node, args=(i, algorithm, nbytes, link_mbps, commands[i], results), daemon=True)
        for i in range(num_nodes)
    ]
    for process in processes:
        process.start()
    try:
        addrs = _expect(results, "addr", num_nodes)
        for queue in commands:
            queue.put(addrs)
        _expect(results, "connected", num_nodes)
        round_s, partners = [], []
        for round_index in range(rounds + 1):
            for queue in commands:
                queue.put(round_index)
            done = _expect(results, "done", num_nodes)
            if round_index > 0:  # round 0 warms up
                round_s.append(max(elapsed for elapsed, _ in done))
                partners.append(sum(got for _, got in done))
        for queue in commands:
            queue.put(None)
        for process in processes:
            process.join(timeout=30)
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
    expected = num_nodes if algorithm == "noloco" else num_nodes * (num_nodes - 1)
    return {
        "nodes": num_nodes,
        "round_s_median": round(statistics.median(round_s), 3),
        "round_s": [round(s, 3) for s in round_s],
        "payloads_received": partners,
        "all_received": all(p == expected for p in partners),
        "bytes_sent_per_node": nbytes * (1 if algorithm == "noloco" else num_nodes - 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=100.0, help="NoLoCo payload size in MB (default 100)")
    parser.add_argument("--diloco-mb", type=float, default=25.0, help="DiLoCo payload in MB (default 25: memory)")
    parser.add_argument("--nodes", default="4,8,16")
    parser.add_argument("--link-mbps", type=float, default=0.0, help="per-node upload cap in Mbit/s (0: none)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--algorithms", default="noloco,diloco")
    args = parser.parse_args()
    sizes = [int(n) for n in args.nodes.split(",")]
    out: dict[str, Any] = {"bench": "sync_round", **vars(args)}
    for algorithm in args.algorithms.split(","):
        nbytes = int((args.mb if algorithm == "noloco" else args.diloco_mb) * 1e6)
        rows = [measure(algorithm, n, nbytes, args.link_mbps, args.rounds) for n in sizes]
        base = rows[0]["round_s_median"]
        for row in rows:
            row["ratio_vs_smallest"] = round(row["round_s_median"] / base, 3)
        out[algorithm] = rows
        print(json.dumps({algorithm: rows}), flush=True)  # progress: one line per algorithm
    if "noloco" in out:
        ratio = out["noloco"][-1]["ratio_vs_smallest"]
        out["noloco_largest_vs_smallest"] = ratio
        out["target_met"] = ratio <= 1.2
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
