"""One peer of tests/test_netbed_nat.py, run inside a network namespace of the NAT test bed.

    python -m tests.nat_peer public              a reachable node: DHT, relay, dial-backs
    python -m tests.nat_peer private BOOT KEY    behind a NAT: relay slot, DHT, hole punch

It speaks JSON lines: events on stdout, commands on stdin (the test drives every step, so
nobody waits on a timer for anyone else). Stdin closing ends it.
"""

import json
import logging
import sys
from typing import Any

import trio

from protocol.net import exchange
from protocol.net.exchange import Payload, TensorReceiver, TensorSpec, any_transfer
from protocol.net.host import Host, open_host, parse_dial_addr

LISTEN = ["/ip4/0.0.0.0/tcp/4001"]
STEP_TIMEOUT_S = 60.0
PAYLOAD = Payload(7, (TensorSpec("w", "float32", (4096,)),), bytes(range(256)) * 64)


def say(**event: Any) -> None:
    print(json.dumps(event), flush=True)


async def commands() -> Any:
    stdin = trio.lowlevel.FdStream(0)
    buffer = b""
    while True:
        while b"\n" not in buffer:
            chunk = await stdin.receive_some(4096)
            if not chunk:
                return
            buffer += chunk
        line, buffer = buffer.split(b"\n", 1)
        yield json.loads(line)


async def until_direct(host: Host, peer_id: str) -> float:
    """Seconds until our connection to ``peer_id`` is direct (DCUtR works in the background)."""
    start = trio.current_time()
    with trio.fail_after(STEP_TIMEOUT_S):
        while host.connection_type(peer_id) != "direct":
            await host.nat.changed.wait()
    return trio.current_time() - start


async def public() -> None:
    async with open_host(identity_seed=b"\x01" * 32, listen_addrs=LISTEN, announce_addrs=[]) as host:
        say(peer_id=host.peer_id, addrs=host.addrs())
        async for command in commands():
            if command["do"] == "status":
                say(nat=host.nat.summary(), links=host.nat.connection_types())


async def private(boot_addr: str, key: str) -> None:
    boot = parse_dial_addr(boot_addr)
    received = trio.Event()
    got: dict[str, Any] = {}

    async def accept(peer_id: str, payload: Payload) -> None:
        got.update(peer=peer_id, nbytes=len(payload.data), same=bytes(payload.data) == PAYLOAD.data)
        got["connection"] = host.connection_type(peer_id)
        received.set()

    async with open_host(
        identity_seed=key.encode()[:32].ljust(32, b"."),
        listen_addrs=LISTEN,
        announce_addrs=[],
        preferred_peers=[boot.peer_id],
    ) as host:
        TensorReceiver(host, accept, authorize=any_transfer, max_payload_nbytes=1 << 20, timeout_s=30).register()
        await host.connect(boot, timeout_s=10)
        with trio.fail_after(STEP_TIMEOUT_S):
            # The slot comes first (a dial-back server's word that a NAT rewrites our address),
            # the verdict when the dial-back times out.
            while boot.peer_id not in host.nat.status.reservations or host.nat.status.reachability == "unknown":
                await host.nat.changed.wait()
        await host.dht_provide(b"nat-test-key")
        say(peer_id=host.peer_id, nat=host.nat.summary(), addrs=host.addrs())
        async for command in commands():
            if command["do"] == "find":
                found = [p for p in await host.dht_find_providers(b"nat-test-key") if p.peer_id != boot.peer_id]
                say(found=[p.peer_id for p in found], addrs={p.peer_id: list(p.addrs) for p in found})
                for peer in found:
                    await host.connect(peer, timeout_s=20)
                say(connected={p.peer_id: host.connection_type(p.peer_id) for p in found})
            elif command["do"] == "await_direct":
                try:
                    say(direct_after_s=await until_direct(host, command["peer"]))
                except trio.TooSlowError:  # the test's assertion shows what the host saw
                    say(direct_after_s=None, nat=host.nat.summary(), links=host.nat.connection_types())
            elif command["do"] == "send":
                kind = host.connection_type(command["peer"])
                try:
                    await exchange.send_tensors(host, command["peer"], PAYLOAD, timeout_s=30)
                    say(sent=True, connection=kind)
                except Exception as exc:  # the test reads what happened
                    say(sent=False, connection=kind, error=str(exc))
            elif command["do"] == "await_tensor":
                with trio.fail_after(STEP_TIMEOUT_S):
                    await received.wait()
                say(received=got)
            elif command["do"] == "status":
                say(nat=host.nat.summary(), links=host.nat.connection_types())


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")  # stderr: the test's file
    logging.getLogger("protocol").setLevel(logging.DEBUG)
    if sys.argv[1] == "public":
        trio.run(public)
    else:
        trio.run(private, sys.argv[2], sys.argv[3])
