"""NAT traversal on loopback: relay slots, relayed connections, the direct-only tensor policy, dial-backs.

Real hosts on 127.0.0.1. Nothing is behind a NAT here, so reachability is told
(``NatPolicy.reachability``) and hole punching is off (on loopback it would upgrade every
relayed connection at once); the real thing, across real NATs, is in test_netbed_nat.py.
"""

import errno
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
from multiaddr import Multiaddr

from node.algorithms.noloco.pairing import Pairing
from protocol import wire
from protocol.errors import ProtocolError
from protocol.net import dialback, exchange, nat
from protocol.net import host as host_module
from protocol.net.conns import parse_peer_id, socket_stream_of
from protocol.net.exchange import Payload, TensorReceiver, TensorSpec, any_transfer
from protocol.net.host import Host, PeerAddrs, Stream, open_host, parse_dial_addr
from protocol.ratelimit import RateLimit
from protocol.runstate.info import PROTOCOL_ID as INFO_PROTOCOL
from protocol.runstate.info import NodeInfo, ask_info, serve_info

LISTEN = ["/ip4/127.0.0.1/tcp/0"]
RELAY = nat.NatPolicy(mode="on", reachability="public", hole_punch=False)
BEHIND_NAT = nat.NatPolicy(mode="off", reachability="private", hole_punch=False)


def host(seed: int, policy: nat.NatPolicy, preferred: list[str] | None = None) -> AsyncIterator[Host]:
    return open_host(  # type: ignore[return-value]
        identity_seed=bytes([seed]) * 32,
        listen_addrs=LISTEN,
        announce_addrs=[],
        relay=policy,
        preferred_peers=preferred,
    )


async def wait_for(nat_part: nat.Nat, condition: object, timeout_s: float = 20.0) -> None:
    """Until ``condition()`` holds, woken by the NAT part's change events (bounded)."""
    assert callable(condition)
    with trio.fail_after(timeout_s):
        while not condition():
            await nat_part.changed.wait()


@asynccontextmanager
async def relay_and_two_private() -> AsyncIterator[tuple[Host, Host, Host]]:
    """A relay, and two hosts that hold a slot on it (reachable only through it, as far as
    the policy knows)."""
    async with host(1, RELAY) as relay, host(2, BEHIND_NAT) as a, host(3, BEHIND_NAT) as b:
        for private in (a, b):
            private.nat.prefer([relay.peer_id])
            await private.connect(parse_dial_addr(relay.addrs()[0]), timeout_s=5)
            await wait_for(private.nat, lambda p=private: relay.peer_id in p.nat.status.reservations)
        yield relay, a, b


def closed_port() -> int:
    """A loopback port nobody listens on (bound, then let go)."""
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        return int(closed.getsockname()[1])


def circuit_only(target: Host) -> PeerAddrs:
    return PeerAddrs(target.peer_id, tuple(a for a in target.addrs() if nat.is_circuit(a)))


async def test_a_private_node_reserves_a_slot_and_announces_it() -> None:
    async with relay_and_two_private() as (relay, a, _):
        (circuit,) = [addr for addr in a.addrs() if nat.is_circuit(addr)]
        assert circuit.endswith(f"/p2p/{relay.peer_id}/p2p-circuit/p2p/{a.peer_id}")
        assert a.nat.summary()["reservations"] == {relay.peer_id: circuit.rsplit("/p2p/", 1)[0]}
        assert relay.nat.summary()["offering_relay"] and not a.nat.summary()["offering_relay"]
        # The slot lasts our relay's TTL, not libp2p's hour: made within the last 25 s (the
        # connect's 5 s and wait_for's 20 s bounds), its expiry (whole seconds) is at most
        # the TTL away and more than the TTL less a minute.
        (expires,) = [exp for peer, exp in a.nat._transport._reservations.items() if str(peer) == relay.peer_id]
        assert RELAY.reservation_ttl_s - 60 < expires - time.time() <= RELAY.reservation_ttl_s < 3600


def libp2p_slots(node: Host) -> set[str]:
    """The relay slots libp2p's refresher renews for ``node``."""
    return {str(peer) for peer in node.nat._transport._reservations}


async def test_a_slot_libp2p_let_expire_is_asked_for_again_not_announced_dead() -> None:
    """A renewal that failed until the slot expired: libp2p drops it from its table (as
    here), and we held it on in our status and addresses for good, a circuit the relay
    answers NO_RESERVATION on (a second reader's probe, relay refusing for a 60 s TTL)."""
    async with relay_and_two_private() as (relay, a, _):
        before = a.nat.status.reservations[relay.peer_id]
        a.nat._forget_slot(relay.peer_id)  # what libp2p's refresher does at the expiry
        await wait_for(a.nat, lambda: a.nat.status.reservations.get(relay.peer_id) not in (None, before))
        assert libp2p_slots(a) == set(a.nat.status.reservations) == {relay.peer_id}


async def test_a_slot_on_a_relay_we_lost_is_not_renewed_behind_our_back() -> None:
    """Our status dropped it, libp2p's refresher kept it and dialed the relay again to renew
    it for good, public or not (a second reader's probe)."""
    async with relay_and_two_private() as (relay, a, _):
        await relay.disconnect(a.peer_id)
        await wait_for(a.nat, lambda: relay.peer_id not in a.nat.status.reservations)
        assert libp2p_slots(a) == set(a.nat.status.reservations)


async def test_peers_reach_a_private_node_through_the_relay_for_control_traffic() -> None:
    async with relay_and_two_private() as (relay, a, b):
        serve_info(b, NodeInfo(b.peer_id, "trainer", ("run-abcdef",), "test"))
        await a.connect(circuit_only(b), timeout_s=10)
        assert a.connection_type(b.peer_id) == "relayed"
        info = await ask_info(a, b.peer_id)  # a round trip through the relay
        assert info.peer_id == b.peer_id and info.runs == ("run-abcdef",)
        assert b.connection_type(a.peer_id) == "relayed"
        assert a.connection_type(relay.peer_id) == "direct"
        assert a.nat.connection_types() == {relay.peer_id: "direct", b.peer_id: "relayed"}


async def test_new_streams_take_the_direct_connection_once_there_is_one() -> None:
    """After a hole punch the relayed connection stays open for DCUtR's grace (60 s) beside
    the direct one, often with more streams on it. The direct-only tensor policy asks
    whether a direct connection exists; the bytes then go where libp2p opens the stream,
    which must be the direct connection (0.8.1 types connections and prefers direct ones
    over more streams: what this pins)."""
    async with relay_and_two_private() as (_, a, b):
        serve_info(b, NodeInfo(b.peer_id, "trainer", ("run-abcdef",), "test"))
        await a.connect(circuit_only(b), timeout_s=10)
        held = [await a.open_stream(b.peer_id, INFO_PROTOCOL, timeout_s=10) for _ in range(3)]
        network = a._host.get_network()
        (relayed,) = network.connections[parse_peer_id(b.peer_id)]
        direct_addr = next(x for x in b.transport_addrs() if not nat.is_circuit(x))
        direct = await network.dial_addr(Multiaddr(direct_addr), parse_peer_id(b.peer_id))
        assert socket_stream_of(direct) is not None and socket_stream_of(relayed) is None
        assert len(relayed.get_streams()) > len(direct.get_streams())  # what libp2p's own rule went by
        assert a.connection_type(b.peer_id) == "direct"
        stream = await a.open_stream(b.peer_id, INFO_PROTOCOL, timeout_s=10)
        assert stream._raw.muxed_conn is direct.muxed_conn
        for opened in [*held, stream]:
            await opened.close()


async def test_a_dial_falls_back_to_the_relays_we_hold_slots_on() -> None:
    """A peer found with only unreachable direct addresses is dialed through our relay."""
    async with relay_and_two_private() as (_, a, b):
        dead = f"/ip4/127.0.0.1/tcp/{closed_port()}"
        await a.connect(PeerAddrs(b.peer_id, (dead,)), timeout_s=10)
        assert a.connection_type(b.peer_id) == "relayed"


def payload() -> Payload:
    return Payload(1, (TensorSpec("w", "float32", (256,)),), bytes(range(256)) * 4)


async def test_tensors_never_cross_a_relay_unless_both_sides_opted_in() -> None:
    received: list[bytes] = []

    async def accept(peer_id: str, got: Payload) -> None:
        received.append(bytes(got.data))

    async with relay_and_two_private() as (_, a, b):
        receiver = TensorReceiver(b, accept, authorize=any_transfer, max_payload_nbytes=1 << 20, timeout_s=10)
        receiver.register()
        await a.connect(circuit_only(b), timeout_s=10)
        assert a.tensor_refusal(b.peer_id) is not None
        with pytest.raises(ProtocolError, match="only over direct connections"):
            await exchange.send_tensors(a, b.peer_id, payload(), timeout_s=10)
        a.relayed_tensor_limit = RateLimit.from_mbps(100)  # the sender opts in; the receiver has not
        with pytest.raises(ProtocolError, match="refused the tensors: tensors go only over direct"):
            await exchange.send_tensors(a, b.peer_id, payload(), timeout_s=10)
        assert receiver.num_refused == 1 and not received
        b.relayed_tensor_limit = RateLimit.from_mbps(100)
        await exchange.send_tensors(a, b.peer_id, payload(), timeout_s=10)
        assert received == [bytes(payload().data)]


async def test_pairing_never_asks_or_accepts_a_relayed_peer() -> None:
    async with relay_and_two_private() as (_, a, b), trio.open_nursery() as nursery:
        pairings = [Pairing(h, send_timeout_s=5, is_member=lambda _: True) for h in (a, b)]
        for pairing in pairings:
            await nursery.start(pairing.run)
        await a.connect(circuit_only(b), timeout_s=10)
        buffers = [memoryview(bytearray(8)) for _ in range(4)]

        async def seek(i: int, peer: Host) -> None:
            results[i] = await pairings[i].find_partner(
                0, buffers[2 * i], buffers[2 * i + 1], [peer.peer_id], timeout_s=5
            )

        results: list[str | None] = ["unset", "unset"]
        async with trio.open_nursery() as both:
            both.start_soon(seek, 0, b)
            both.start_soon(seek, 1, a)
        assert results == [None, None]
        nursery.cancel_scope.cancel()


async def test_a_relay_offers_slots_only_while_it_is_public() -> None:
    unsure = nat.NatPolicy(mode="auto", reachability="private", hole_punch=False)
    async with host(4, unsure) as relay, host(5, BEHIND_NAT) as a:
        await a.connect(parse_dial_addr(relay.addrs()[0]), timeout_s=5)
        assert not await a.nat.reserve(relay.peer_id)
        assert a.nat.status.reservations == {}


async def test_dial_back_finds_a_loopback_node_public() -> None:
    auto = nat.NatPolicy(hole_punch=False)
    async with host(6, auto) as server, host(7, auto) as client:
        client.nat.prefer([server.peer_id])  # one voice is enough only from our bootstrap, alone
        await client.connect(parse_dial_addr(server.addrs()[0]), timeout_s=5)
        assert await client.nat.check_reachability(client) == "public"
        assert client.nat.status.observed_ip == "127.0.0.1"


async def test_peers_on_one_ip_dial_us_back_as_one_voice_not_enough_to_be_public() -> None:
    auto = nat.NatPolicy(hole_punch=False)
    async with host(12, auto) as first, host(13, auto) as second, host(14, auto) as client:
        for server in (first, second):
            await client.connect(parse_dial_addr(server.addrs()[0]), timeout_s=5)
        assert await client.nat.check_reachability(client) == "unknown"  # both on 127.0.0.1
        assert client.nat.status.observed_ip == "127.0.0.1"  # they did dial us back


async def ask(client: Host, server: Host, fields: dict[str, object]) -> dict[str, object]:
    stream = await client.open_stream(server.peer_id, dialback.PROTOCOL_ID, timeout_s=5)
    with trio.fail_after(15):
        await wire.send(stream, "dialback?", dialback.VERSION, fields)
        return await wire.receive(stream, msg_types=frozenset({"dialback"}), version=dialback.VERSION, max_nbytes=1024)


async def test_dial_back_reports_closed_ports_and_refuses_bad_or_repeated_requests() -> None:
    policy = nat.NatPolicy(reachability="public", hole_punch=False)
    async with host(8, policy) as server, host(9, policy) as client:
        await client.connect(parse_dial_addr(server.addrs()[0]), timeout_s=5)
        port = closed_port()
        reply = await ask(client, server, {"ports": [port]})
        assert reply["ok"] == [] and reply["ip"] == "127.0.0.1"
        again = await ask(client, server, {"ports": [port]})
        assert again["refused"] == "asked too often"
        for bad in ({"ports": list(range(1, 10))}, {"ports": ["x"]}, {"ports": 4001}, {}):
            with pytest.raises(ProtocolError):  # the server resets the stream: no answer
                await ask(client, server, bad)


async def test_a_dial_back_server_says_where_it_sees_us_before_it_dials_only_when_asked() -> None:
    policy = nat.NatPolicy(reachability="public", hole_punch=False)
    async with host(17, policy) as server, host(18, policy) as client:
        await client.connect(parse_dial_addr(server.addrs()[0]), timeout_s=5)
        port = closed_port()
        stream = await client.open_stream(server.peer_id, dialback.PROTOCOL_ID, timeout_s=5)
        with trio.fail_after(15):
            await wire.send(stream, "dialback?", dialback.VERSION, {"ports": [port], "seen": True})
            kinds = frozenset({"seen", "dialback"})
            first = await wire.receive(stream, msg_types=kinds, version=dialback.VERSION, max_nbytes=1024)
            second = await wire.receive(stream, msg_types=kinds, version=dialback.VERSION, max_nbytes=1024)
        assert (first["t"], first["ip"]) == ("seen", "127.0.0.1")
        assert (second["t"], second["ok"], second["ip"]) == ("dialback", [], "127.0.0.1")
        # Not asked for (an older asker's request, as test_dial_back_reports_... sends): the verdict alone.


def seen_then_no_verdict(ip: str) -> object:
    """A dial-back handler that says it sees the asker on ``ip``, then refuses (no verdict:
    as a NAT's dropped SYNs leave it, seconds before its timeout)."""

    async def handler(stream: Stream) -> None:
        request = await wire.receive(
            stream, msg_types=frozenset({"dialback?"}), version=dialback.VERSION, max_nbytes=1024
        )
        assert request["seen"] is True
        await wire.send(stream, "seen", dialback.VERSION, {"ip": ip})
        await wire.send(stream, "dialback", dialback.VERSION, {"ok": [], "ip": "", "refused": "busy"})

    return handler


async def test_a_node_seen_on_an_ip_not_its_own_reserves_a_relay_slot_before_its_verdict_and_gives_it_up_when_public(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Behind a NAT that drops unsolicited SYNs only the dial-back's timeout gives the verdict
    (3 s): the server's early word that a NAT rewrites our address reserves a slot at once.
    Found public after all (a port forward), the node gives its slot up."""
    monkeypatch.setattr(dialback, "COOLDOWN_S", 0.0)  # the relay is asked again for the verdict
    async with host(19, RELAY) as relay, host(20, nat.NatPolicy(hole_punch=False)) as client:
        relay.set_handler(dialback.PROTOCOL_ID, seen_then_no_verdict("203.0.113.9"))  # type: ignore[arg-type]
        await client.connect(parse_dial_addr(relay.addrs()[0]), timeout_s=5)
        await wait_for(client.nat, lambda: relay.peer_id in client.nat.status.reservations)
        assert client.nat.status.reachability == "unknown" and client.nat.status.translated == "203.0.113.9"
        assert client.nat.status.timeline["translated"] <= client.nat.status.timeline["reserved"]
        assert any(nat.is_circuit(a) for a in client.addrs())
        # The relay's own dial-backs, from our bootstrap alone: public.
        dialback.DialbackServer(relay).register()
        client.nat.prefer([relay.peer_id])
        await client.nat.check_reachability(client)
        await wait_for(client.nat, lambda: client.nat.status.reachability == "public")
        assert client.nat.status.reservations == {} and not any(nat.is_circuit(a) for a in client.addrs())
        assert relay.peer_id not in {str(p) for p in client.nat._transport._reservations}  # libp2p renews it no more


async def test_a_relay_slot_that_comes_after_the_public_verdict_is_not_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reservation asked on the hint was still under way when the node was found public
    (a second reader's probe: it was kept, circuit address and all, renewed for good)."""
    monkeypatch.setattr(dialback, "COOLDOWN_S", 0.0)
    async with host(31, RELAY) as relay, host(32, nat.NatPolicy(hole_punch=False)) as client:
        gate, entered, returned = trio.Event(), trio.Event(), trio.Event()
        real, reserve = client.nat._transport.reserve, client.nat.reserve

        async def held_back(*args: object, **kwargs: object) -> bool:
            entered.set()
            await gate.wait()
            return await real(*args, **kwargs)

        async def reserved(relay_id: str) -> bool:
            try:
                return await reserve(relay_id)
            finally:
                returned.set()

        monkeypatch.setattr(client.nat._transport, "reserve", held_back)
        monkeypatch.setattr(client.nat, "reserve", reserved)
        relay.set_handler(dialback.PROTOCOL_ID, seen_then_no_verdict("203.0.113.9"))  # type: ignore[arg-type]
        await client.connect(parse_dial_addr(relay.addrs()[0]), timeout_s=5)
        with trio.fail_after(10):
            await entered.wait()  # reserving on the hint
        dialback.DialbackServer(relay).register()
        client.nat.prefer([relay.peer_id])
        assert await client.nat.check_reachability(client) == "public"
        gate.set()
        with trio.fail_after(10):
            await returned.wait()
        assert client.nat.status.reservations == {} and not any(nat.is_circuit(a) for a in client.addrs())
        assert relay.peer_id not in {str(p) for p in client.nat._transport._reservations}


@pytest.mark.parametrize("ip", ["127.0.0.1", "not an ip"])
async def test_a_server_seeing_us_on_our_own_ip_or_naming_no_ip_reserves_nothing(ip: str) -> None:
    async with host(21, RELAY) as relay, host(22, nat.NatPolicy(hole_punch=False)) as client:
        relay.set_handler(dialback.PROTOCOL_ID, seen_then_no_verdict(ip))  # type: ignore[arg-type]
        await client.connect(parse_dial_addr(relay.addrs()[0]), timeout_s=5)
        assert await client.nat.check_reachability(client) == "unknown"
        # Asked by this check or the reachability loop's, whichever came first (they share a lock).
        assert client.nat.status.translated is None and "translated" not in client.nat.status.timeline
        assert client.nat._relays_wanted() == 0


async def test_an_ipv4_address_a_server_reports_mapped_into_ipv6_is_the_ipv4_address() -> None:
    """A dual-stack server's socket names an IPv4 asker ``::ffff:a.b.c.d``: the IP we are
    seen on (the hint's and the verdict's) is compared with our own, which are IPv4."""

    async def mapped(stream: Stream) -> None:
        await wire.receive(stream, msg_types=frozenset({"dialback?"}), version=dialback.VERSION, max_nbytes=1024)
        await wire.send(stream, "seen", dialback.VERSION, {"ip": "::ffff:127.0.0.1"})
        await wire.send(stream, "dialback", dialback.VERSION, {"ok": [], "ip": "::ffff:127.0.0.1"})

    async with host(23, RELAY) as server, host(24, nat.NatPolicy(hole_punch=False)) as client:
        server.set_handler(dialback.PROTOCOL_ID, mapped)  # type: ignore[arg-type]
        await client.connect(parse_dial_addr(server.addrs()[0]), timeout_s=5)
        seen: list[str] = []
        assert await dialback.ask(client, server.peer_id, [closed_port()], on_seen=seen.append) == (False, "127.0.0.1")
        assert seen == ["127.0.0.1"]


@pytest.mark.parametrize(
    "answer",
    [{"ok": [[1]], "ip": "127.0.0.1"}, {"ok": [], "ip": "not an ip"}, {"ok": "all", "ip": ""}, {"ok": list(range(9))}],
)
async def test_a_lying_or_broken_dial_back_server_changes_nothing(answer: dict[str, object]) -> None:
    async def liar(stream: Stream) -> None:
        await wire.receive(stream, msg_types=frozenset({"dialback?"}), version=dialback.VERSION, max_nbytes=1024)
        await wire.send(stream, "dialback", dialback.VERSION, answer)

    async with (
        host(10, nat.NatPolicy(reachability="public", hole_punch=False)) as server,
        host(11, nat.NatPolicy(hole_punch=False)) as client,
    ):
        server.set_handler(dialback.PROTOCOL_ID, liar)
        await client.connect(parse_dial_addr(server.addrs()[0]), timeout_s=5)
        assert await client.nat.check_reachability(client) == "unknown"
        assert client.nat.status.observed_ip is None


async def test_a_host_whose_listeners_are_closing_says_its_last_addresses(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stopping, libp2p's TCP transport asks each closed listener socket for its name and
    gets EBADF: ``swarmtrain join`` died on Ctrl-C showing its status (exit 1, a traceback)."""
    async with host(21, BEHIND_NAT) as node:
        announced, listening = node.addrs(), node.transport_addrs()
        assert announced and listening

        def closed() -> list[object]:
            raise OSError(errno.EBADF, "Bad file descriptor")

        monkeypatch.setattr(node._host, "get_transport_addrs", closed)
        assert node.addrs() == announced and node.transport_addrs() == listening
        assert node.nat._listen_ports() == []


def test_a_wildcard_listener_is_announced_on_this_machines_addresses_never_loopback_or_0000() -> None:
    from protocol.net.addrs import announce_for, local_ips

    announced = announce_for(["/ip4/0.0.0.0/tcp/7400"])
    others = [ip for ip in local_ips("ip4") if not ip.startswith("127.")]
    assert announced == [f"/ip4/{ip}/tcp/7400" for ip in others or ["127.0.0.1"]]
    assert announce_for(["/ip4/0.0.0.0/tcp/0"]) == []  # the port is known only once bound
    assert announce_for(["/ip4/127.0.0.1/tcp/7400"]) == []  # a specific address: libp2p's own


def test_retries_double_their_wait_and_stop_at_the_limit() -> None:
    later = nat.Retries(10.0, 3, first_at_once=False)
    assert later.take("p", 0.0) is None  # first seen: the first try is one interval away
    assert [later.take("p", t) for t in (9.9, 10.0, 29.9, 30.0, 69.9, 70.0)] == [None, 1, None, 2, None, 3]
    assert later.exhausted("p") and later.take("p", 1e9) is None
    now = nat.Retries(10.0, 2, first_at_once=True)
    assert now.take("q", 5.0) == 1 and not now.exhausted("q")
    now.forget("q")
    assert now.take("q", 5.0) == 1


def test_a_refused_slot_is_asked_again_sooner_before_our_verdict_never_sooner_after_it() -> None:
    hinted = [nat.reserve_retry_s(None, hinted=True)]
    for _ in range(3):
        hinted.append(nat.reserve_retry_s(hinted[-1], hinted=True))
    assert hinted == [1.0, 2.0, 4.0, 8.0]
    # Found private: the next wait is the usual one, doubling on to the limit.
    assert nat.reserve_retry_s(2.0, hinted=False) == nat.RESERVE_RETRY_S
    assert nat.reserve_retry_s(None, hinted=False) == nat.RESERVE_RETRY_S  # as before the hint
    assert nat.reserve_retry_s(nat.RESERVE_RETRY_S, hinted=False) == 2 * nat.RESERVE_RETRY_S
    assert nat.reserve_retry_s(nat.RESERVE_RETRY_MAX_S, hinted=False) == nat.RESERVE_RETRY_MAX_S


def test_an_address_on_the_internet_is_told_from_a_private_one() -> None:
    from protocol.net.addrs import is_global_addr

    assert is_global_addr("/ip4/8.8.8.8/tcp/4001") and is_global_addr("/dns4/example.org/tcp/4001")
    assert is_global_addr("/ip6/2001:4860:4860::8888/tcp/4001")
    for addr in ("/ip4/10.1.2.3/tcp/4001", "/ip4/127.0.0.1/tcp/1", "/ip6/fe80::1/tcp/1", "/ip4/192.168.0.2/tcp/1"):
        assert not is_global_addr(addr), addr
    assert not is_global_addr("/ip4/8.8.8.8/tcp/4001/p2p/QmRelay/p2p-circuit/p2p/QmUs")
    assert not is_global_addr("/ip4/not-an-ip/tcp/1") and not is_global_addr("garbage")


def test_a_servers_verdict_counts_until_the_recheck_and_it_is_not_asked_again_before() -> None:
    """While reachability stays unknown (every peer on one IP), asking the same peers again
    at each cooldown adds no confirmation and cost a dial-back a second per ten peers."""
    verdicts = nat.Verdicts()
    verdicts.add("a", "10.0.0.1", True, now=100.0)
    assert verdicts.fresh("a", 100.0 + nat.RECHECK_INTERVAL_S) and not verdicts.fresh("b", 100.0)
    assert not verdicts.fresh("a", 100.0 + nat.RECHECK_INTERVAL_S + 1)
    verdicts.forget()  # our addresses changed: ask again
    assert not verdicts.fresh("a", 101.0)


class _Peerstore:
    def __init__(self, addrs: list[str]) -> None:
        self._addrs = addrs

    def addrs(self, peer_id: object) -> list[str]:
        return self._addrs


class _RawHost:
    def __init__(self, addrs: list[str]) -> None:
        self._store = _Peerstore(addrs)

    def get_peerstore(self) -> _Peerstore:
        return self._store


@pytest.mark.parametrize(
    ("known", "dials"),
    [
        (["/ip4/10.0.0.5/tcp/1", "/ip4/1.2.3.4/tcp/1/p2p/QmR/p2p-circuit/p2p/QmA"], False),  # behind a NAT: punch
        (["/ip4/1.2.3.4/tcp/1"], True),  # maybe public: a plain dial first
    ],
)
async def test_a_plain_direct_dial_before_a_punch_only_for_a_peer_without_a_circuit(
    monkeypatch: pytest.MonkeyPatch, known: list[str], dials: bool
) -> None:
    """libp2p's step before a punch (a plain dial, up to 5 s) is skipped for a peer behind a
    NAT (it publishes a circuit: the dial only times out), and kept, shorter, for the others:
    our punch dials as the responder, which stalls against a plain (public) listener."""
    from libp2p.relay.circuit_v2.dcutr import DCUtRProtocol

    assert "_try_unilateral_upgrade" in vars(DCUtRProtocol)  # the libp2p step we override
    called: list[object] = []

    async def plain_dial(self: object, peer_id: object) -> bool:
        called.append(peer_id)
        return True

    monkeypatch.setattr(DCUtRProtocol, "_try_unilateral_upgrade", plain_dial)
    punch = nat._HolePunch.__new__(nat._HolePunch)
    punch.host = _RawHost(known)
    assert await punch._try_unilateral_upgrade("peer") is dials
    assert called == (["peer"] if dials else [])


async def test_a_peer_asked_for_a_dial_back_is_not_asked_again_within_its_cooldown(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """It would refuse ("asked too often"). A server that refused gave no verdict, so only the
    cooldown keeps us from asking it at each check (the reachability loop and callers share it)."""
    monkeypatch.setattr(dialback, "COOLDOWN_S", 3600.0)  # longer than this test, however slow
    requests: list[str] = []

    async def refuses(stream: Stream) -> None:
        await wire.receive(stream, msg_types=frozenset({"dialback?"}), version=dialback.VERSION, max_nbytes=1024)
        requests.append(stream.peer_id)
        await wire.send(stream, "dialback", dialback.VERSION, {"ok": [], "ip": "", "refused": "asked too often"})

    async with (
        host(15, nat.NatPolicy(reachability="public", hole_punch=False)) as server,
        host(16, nat.NatPolicy(hole_punch=False)) as client,
    ):
        server.set_handler(dialback.PROTOCOL_ID, refuses)
        await client.connect(parse_dial_addr(server.addrs()[0]), timeout_s=5)
        for _ in range(3):  # the loop asks it as soon as it is connected, or this call does
            assert await client.nat.check_reachability(client) == "unknown"
        assert requests == [client.peer_id]
        assert client.nat.status.timeline["asked"] >= 0


def test_dial_back_asks_remember_each_server_for_its_cooldown_and_stay_bounded() -> None:
    asks = nat.DialbackAsks()
    asks.note(["a", "b"], 100.0)
    assert not asks.due("a", 100.0 + dialback.COOLDOWN_S - 0.1) and asks.due("c", 100.0)
    assert asks.due("a", 100.0 + dialback.COOLDOWN_S)
    asks.note([f"old{i}" for i in range(nat.MAX_ASKED + 1)], 0.0)
    asks.note(["new"], 50.0)  # past the bound: only those within their cooldown are kept
    assert not asks.due("new", 50.0) and asks.due("old1", 5.0)


def test_hole_punches_are_bounded_per_peer_and_in_all() -> None:
    punches = nat.Punches()
    spacing = nat.PUNCH_AT_ONCE_S
    at_once = [punches.take_at_once("p", t) for t in (0.0, 2 * spacing - 0.1, 2 * spacing, 6 * spacing - 0.1)]
    assert at_once == [True, False, True, False]
    assert punches.take_at_once("p", 6 * spacing) and nat.PUNCHES_AT_ONCE == 3
    assert not punches.take_at_once("p", 1e9)  # a relayed connection that keeps coming back
    punches.running.update(f"peer{i}" for i in range(nat.MAX_PUNCHES_IN_FLIGHT))
    assert not punches.may_start("q") and not punches.take_at_once("q", 0.0)  # a burst waits
    punches.running.discard("peer0")
    assert punches.take_at_once("q", 0.0)  # the refusal above did not use up its budget
    assert not punches.may_start("peer1")  # one at a time per peer


def test_the_connection_watcher_looks_often_only_on_the_way_to_a_hole_punch() -> None:
    direct = {"a": "direct"}
    assert nat.watch_interval_s("public", direct) == nat.POLL_S  # nothing to ask or to punch
    assert nat.watch_interval_s("public", {**direct, "b": "relayed"}) == nat.WATCH_S
    assert nat.watch_interval_s("unknown", direct) == nat.watch_interval_s("private", {}) == nat.WATCH_S


PUNCHING = nat.NatPolicy(mode="off", reachability="private", hole_punch=True)


async def test_only_the_side_whose_id_sorts_first_punches_a_new_relayed_connection_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Both sides see the relayed connection; one starting the punch is enough (two members
    often dial each other through relays at once, so "the inbound side" names both or none).
    libp2p's own driver (every 2 s) is held off, and the punch only recorded: on loopback it
    would succeed at once."""
    punches: list[tuple[str, str]] = []
    punched = trio.Event()

    async def record(self: nat._HolePunch, peer_id: object) -> bool:
        punches.append((self.host.get_id().to_base58(), str(peer_id)))
        punched.set()
        return False

    monkeypatch.setattr(nat._HolePunch, "initiate_hole_punch", record)

    async def no_driver(self: nat._HolePunch) -> None:
        await trio.sleep_forever()

    monkeypatch.setattr(nat._HolePunch, "_auto_drive_loop", no_driver)
    async with host(1, RELAY) as relay, host(17, PUNCHING) as a, host(18, PUNCHING) as b:
        for private in (a, b):
            private.nat.prefer([relay.peer_id])
            await private.connect(parse_dial_addr(relay.addrs()[0]), timeout_s=5)
            await wait_for(private.nat, lambda p=private: relay.peer_id in p.nat.status.reservations)
        await a.connect(circuit_only(b), timeout_s=10)
        for side in (a, b):
            await wait_for(side.nat, lambda s=side: "relayed" in s.nat.status.timeline)
        with trio.fail_after(20):
            await punched.wait()
        first, second = sorted((a, b), key=lambda h: h.peer_id)
        assert punches == [(first.peer_id, second.peer_id)]
        assert "punch" in first.nat.status.timeline and "punch" not in second.nat.status.timeline


async def test_a_dial_that_hung_while_the_peer_reached_us_adds_no_relayed_connection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Our dial of a peer's direct address hangs (a NAT drops the SYNs); meanwhile the peer
    reaches us through the relay. When the direct attempt ends, our dial must not fall back
    to the relay too: that was a second relayed connection, and a relay circuit for nothing."""
    monkeypatch.setattr(host_module, "DIRECT_FIRST_TIMEOUT_S", 600.0)  # only the test ends it
    async with relay_and_two_private() as (_, a, b), trio.open_nursery() as nursery:
        (hole,) = await trio.open_tcp_listeners(0, host="127.0.0.1")  # accepts, then never answers
        held: list[trio.SocketStream] = []
        accepted, done = trio.Event(), trio.Event()

        async def hold() -> None:
            held.append(await hole.accept())
            accepted.set()

        circuits: list[str] = []
        dial_circuit = a.nat.dial_circuit

        async def counted(addr: str) -> None:
            circuits.append(addr)
            await dial_circuit(addr)

        a.nat.dial_circuit = counted  # type: ignore[method-assign]

        async def hung_dial() -> None:
            await a.connect(
                PeerAddrs(b.peer_id, (f"/ip4/127.0.0.1/tcp/{hole.socket.getsockname()[1]}",)), timeout_s=600
            )
            done.set()

        nursery.start_soon(hold)
        nursery.start_soon(hung_dial)
        with trio.fail_after(20):
            await accepted.wait()
            await b.connect(circuit_only(a), timeout_s=10)  # it reached us meanwhile
            await hole.aclose()  # the direct attempt fails now (libp2p's retries too)
            await held[0].aclose()
            await done.wait()
        assert circuits == [] and a.connection_type(b.peer_id) == "relayed"


async def test_a_punch_retry_counts_once_an_exchange_ended_with_the_pair_relayed_and_a_direct_link_forgets_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The simulation calls a relayed pair final once one of our extra punch rounds ended
    with it still relayed. A retry while another exchange with the peer is under way
    (libp2p's own driver, or the peer's punch) returns at once: a second reader saw that
    counted while the peer's punch was still dialing. It counts once that exchange ended,
    not before, and not at all if it outlasts the bound. A count goes once the link is direct."""

    class Dcutr:
        exchanges = 0
        makes_exchange = False
        busy_for = 0  # how many more looks find an exchange under way

        def exchanges_started(self, peer: object) -> int:
            return self.exchanges

        def in_progress(self, peer: object) -> bool:
            self.busy_for -= 1
            return self.busy_for >= 0

        async def initiate_hole_punch(self, peer: object) -> bool:
            self.exchanges += self.makes_exchange
            return False

    async with relay_and_two_private() as (_, a, b):
        fake = Dcutr()
        monkeypatch.setattr(a.nat, "_dcutr", fake)
        monkeypatch.setattr(nat, "PUNCH_POLL_S", 0.01)
        with monkeypatch.context() as relayed:
            relayed.setattr(a.nat, "connection_type", lambda peer_id: "relayed")
            fake.busy_for = 10**9  # an exchange under way past the bound: no round ended
            relayed.setattr(nat, "PUNCH_ROUND_BOUND_S", 0.05)
            await a.nat._punch(b.peer_id, retry=True)
            assert a.nat.status.punch_retries == {}
            fake.busy_for = 3  # under way for three looks, then over: that round counts
            await a.nat._punch(b.peer_id, retry=True)
            assert fake.busy_for < 0 and a.nat.status.punch_retries == {b.peer_id: 1}
            fake.makes_exchange = True
            await a.nat._punch(b.peer_id, retry=False)  # a first punch is no extra round
            await a.nat._punch(b.peer_id, retry=True)  # ours ran
            assert a.nat.status.punch_retries == {b.peer_id: 2}
        await a.connect(parse_dial_addr(next(x for x in b.addrs() if not nat.is_circuit(x))), timeout_s=5)
        await wait_for(a.nat, lambda: b.peer_id not in a.nat.status.punch_retries)
