"""The fake network's faults, and the run service converging over it, in virtual time.

Every test runs under an autojump clock: a ``trio.sleep`` here only bounds virtual time
(a delivery is due within the largest delay), and waiting for each other is done on events.
"""

import contextlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace

import pytest
import trio
import trio.testing

from protocol import wire
from protocol.errors import BadMessage, DialError, StreamError
from protocol.net import gossip, memnet
from protocol.net.hostlike import HostLike, PeerAddrs, StreamLike, TensorHostLike
from protocol.net.memnet import Delivery, FakeHost, FakeNetwork, Faults
from protocol.net.peers import BAN_POINTS, PENALTY_DECAY_S
from protocol.runstate.run import ANTI_ENTROPY_IDLE_S, TTL_HEARTBEATS, RunService
from protocol.runstate.state import Manifest, MemberRecord, RunState, sign_member
from tests.conftest import wait_until

TOPIC = "/test/1"
ECHO = "/test/echo/1"
SEEDS = [bytes([i + 1]) * 32 for i in range(6)]
RUN = "fake-abc123"
MAX_DELAY_S = 0.5
# Nodes join a run this far apart; after agreeing they go on this long under faults.
JOIN_SPACING_S = 1.0
SOAK_S = 60.0
Heard = list[list[tuple[str, bytes]]]
"""What each host heard on TOPIC: (sender, data) in order of arrival."""


@pytest.fixture
def autojump_clock() -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=0)


async def collect(host: HostLike, into: list[tuple[str, bytes]]) -> None:
    async with contextlib.aclosing(host.subscribe(TOPIC)) as messages:
        async for message in messages:
            into.append((message.from_peer, message.data))


async def echo(stream: StreamLike) -> None:
    while True:
        frame = await wire.read_frame(stream, max_nbytes=1 << 20)
        await stream.write(wire.frame(frame))


@asynccontextmanager
async def gossiping(net: FakeNetwork, count: int) -> AsyncIterator[tuple[list[FakeHost], Heard]]:
    """``count`` hosts, each collecting what it hears on TOPIC, subscribed once this yields."""
    hosts = [net.add_host(seed) for seed in SEEDS[:count]]
    heard: Heard = [[] for _ in hosts]
    async with net.running():
        for host, into in zip(hosts, heard, strict=True):
            host.set_handler(ECHO, echo)
            net.nursery.start_soon(collect, host, into)
        await trio.testing.wait_all_tasks_blocked()  # every subscription is in place
        yield hosts, heard


async def publish_all(host: HostLike, num_messages: int) -> list[bytes]:
    sent = [f"message {i}".encode() for i in range(num_messages)]
    for data in sent:
        await host.publish(TOPIC, data)
    await trio.sleep(MAX_DELAY_S)  # virtual: every delivery is due by now
    return sent


# --- the fake itself ---


def test_a_fake_host_has_every_member_a_tensor_host_has() -> None:
    """The services typed against ``TensorHostLike`` (pairing, saved-state offers, the expert
    store, payload exchanges) run on a fake host as on a libp2p one."""
    declared = {
        name
        for cls in TensorHostLike.__mro__
        if getattr(cls, "_is_protocol", False)
        for name in vars(cls)
        if not name.startswith("_")
    }
    assert {"peer_id", "open_stream", "private", "tensor_refusal", "forward_data_port"} <= declared
    host = FakeNetwork(1, Faults()).add_host(SEEDS[0])
    assert [name for name in sorted(declared) if not hasattr(host, name)] == []


async def test_gossip_reaches_every_other_subscriber_once_in_order(autojump_clock: trio.testing.MockClock) -> None:
    async with gossiping(FakeNetwork(1, Faults()), 3) as (hosts, heard):
        sent = await publish_all(hosts[0], 20)
    assert heard[0] == []  # our own are skipped
    assert heard[1] == heard[2] == [(hosts[0].peer_id, data) for data in sent]


async def test_drop_loses_gossip_and_logs_each_loss(autojump_clock: trio.testing.MockClock) -> None:
    net = FakeNetwork(2, Faults(drop=0.3))
    async with gossiping(net, 2) as (hosts, heard):
        sent = await publish_all(hosts[0], 200)
    dropped = [d.data for d in net.log if d.fate == "dropped"]
    assert 20 < len(dropped) < 120
    assert [data for _, data in heard[1]] == [data for data in sent if data not in dropped]


async def test_duplicate_delivers_twice(autojump_clock: trio.testing.MockClock) -> None:
    async with gossiping(FakeNetwork(3, Faults(duplicate=1.0)), 2) as (hosts, heard):
        sent = await publish_all(hosts[0], 10)
    assert [data for _, data in heard[1]] == [data for data in sent for _ in range(2)]


async def test_delays_take_virtual_time_and_reorder(autojump_clock: trio.testing.MockClock) -> None:
    async with gossiping(FakeNetwork(4, Faults(delay_s=(0.1, MAX_DELAY_S))), 2) as (hosts, heard):
        started = trio.current_time()
        await hosts[0].publish(TOPIC, b"first")
        await trio.sleep(0.1 - 1e-9)  # virtual: just before the lowest delay
        assert heard[1] == []
        sent = await publish_all(hosts[0], 50)
        assert trio.current_time() - started < 1.0
    received = [data for _, data in heard[1]]
    assert sorted(received) == sorted([b"first", *sent])
    assert received != [b"first", *sent]  # independent delays reorder


async def test_corrupt_flips_one_byte(autojump_clock: trio.testing.MockClock) -> None:
    net = FakeNetwork(5, Faults(corrupt=1.0))
    async with gossiping(net, 2) as (hosts, heard):
        sent = await publish_all(hosts[0], 20)
    for original, (_, data) in zip(sent, heard[1], strict=True):
        assert len(data) == len(original) and sum(a != b for a, b in zip(data, original, strict=True)) == 1
    assert net.corrupted(hosts[0].peer_id, hosts[1].peer_id) == 20


async def test_streams_carry_bytes_and_end(autojump_clock: trio.testing.MockClock) -> None:
    async with gossiping(FakeNetwork(6, Faults(delay_s=(0.01, 0.1))), 2) as (hosts, _):
        stream = await hosts[0].open_stream(hosts[1].peer_id, ECHO, timeout_s=5)
        for i in range(5):
            await wire.send(stream, "ping", 1, {"i": i})
        for i in range(5):
            assert (await wire.receive(stream, msg_types=frozenset({"ping"}), version=1, max_nbytes=64))["i"] == i
        await stream.close()  # the echo handler reads the end: StreamError, no penalty; it resets
        with pytest.raises(StreamError):
            await stream.read_exact(1)
        assert hosts[1].peers.penalty(hosts[0].peer_id) == 0
        assert hosts[0].peer_id in hosts[1].connected_peers()


async def test_latency_and_traffic_are_per_link_and_per_label(autojump_clock: trio.testing.MockClock) -> None:
    """Each peer pays for what it sends and receives under the stream's protocol id (its
    bytes, a frame's overhead, the opening) or gossip's label (the mesh's copies)."""
    net = FakeNetwork(3, Faults(), latency=lambda a, b: 0.05, gossip_label=lambda data: f"gossip:{data[:1].decode()}")
    async with gossiping(net, 2) as (hosts, heard):
        a, b = hosts
        began = trio.current_time()
        stream = await a.open_stream(b.peer_id, ECHO, timeout_s=5)
        await wire.send(stream, "ping", 1, {})
        await wire.read_frame(stream, max_nbytes=64)
        assert trio.current_time() - began == pytest.approx(0.1)  # there and back
        await stream.close()
        await a.publish(TOPIC, b"h" * 20)
        await trio.sleep(0.05)  # virtual: the one-way latency
        await trio.testing.wait_all_tasks_blocked()
        assert heard[1] == [(a.peer_id, b"h" * 20)]
    sent = len(wire.frame(wire.encode("ping", 1, {})))
    opening = memnet.STREAM_OPEN_NBYTES + len(ECHO)
    wrote = sent + memnet.STREAM_FRAME_NBYTES
    assert net.traffic[(a.peer_id, ECHO)] == [opening + wrote, opening + wrote]
    assert net.traffic[(b.peer_id, ECHO)] == [opening + wrote, opening + wrote]
    gossiped = memnet.GOSSIP_COPIES * (memnet.GOSSIP_FRAME_NBYTES + 20)
    assert net.traffic[(a.peer_id, "gossip:h")] == [0, gossiped]
    assert net.traffic[(b.peer_id, "gossip:h")] == [gossiped, gossiped]


async def test_a_removed_host_is_gone_for_everyone(autojump_clock: trio.testing.MockClock) -> None:
    net = FakeNetwork(4, Faults(), keep_log=False)
    async with gossiping(net, 3) as (hosts, heard):
        a, b, _ = hosts
        stream = await a.open_stream(b.peer_id, ECHO, timeout_s=5)
        net.remove_host(b.peer_id)
        with pytest.raises(StreamError):
            await wire.send(stream, "ping", 1, {})
            await stream.read_exact(1)
        assert b.peer_id not in a.connected_peers()
        with pytest.raises(StreamError, match="unreachable"):
            await a.open_stream(b.peer_id, ECHO, timeout_s=5)
        with pytest.raises(DialError):
            await a.connect(PeerAddrs(b.peer_id, ()), timeout_s=5)
        await a.publish(TOPIC, b"after")
        await trio.testing.wait_all_tasks_blocked()
        assert heard[2] == [(a.peer_id, b"after")] and heard[1] == []
    assert net.log == [] and net.fates["delivered"] >= 1  # counted, not kept


async def test_a_dropped_chunk_breaks_the_stream(autojump_clock: trio.testing.MockClock) -> None:
    net = FakeNetwork(7, Faults(drop=1.0))
    async with gossiping(net, 2) as (hosts, _):
        stream = await hosts[0].open_stream(hosts[1].peer_id, ECHO, timeout_s=5)
        await wire.send(stream, "ping", 1, {})  # lost on the way: the write itself cannot tell
        with pytest.raises(StreamError, match="broken by the network"):
            await stream.read_exact(1)
        with pytest.raises(StreamError):
            await wire.send(stream, "ping", 1, {})
    assert [d.fate for d in net.log if d.kind == "stream"] == ["broken"]


async def test_a_corrupted_chunk_is_judged_like_a_peer_s_bad_bytes(autojump_clock: trio.testing.MockClock) -> None:
    async def strict(stream: StreamLike) -> None:
        frame = await wire.read_frame(stream, max_nbytes=64)
        if frame != b"hello":
            raise BadMessage("not hello")

    net = FakeNetwork(8, Faults(corrupt=1.0))
    async with gossiping(net, 2) as (hosts, _):
        hosts[1].set_handler("/strict", strict)
        stream = await hosts[0].open_stream(hosts[1].peer_id, "/strict", timeout_s=5)
        await stream.write(wire.frame(b"hello"))
        with pytest.raises(StreamError):
            await stream.read_exact(1)  # reset by the guard, or the handler waits out its deadline
    assert hosts[1].peers.penalty(hosts[0].peer_id) == 1  # the sender pays for the network's flip


async def test_handlers_keep_the_boundary_rule(autojump_clock: trio.testing.MockClock) -> None:
    async def silent(stream: StreamLike) -> None:
        await stream.read_exact(1)  # never comes

    async with gossiping(FakeNetwork(9, Faults()), 2) as (hosts, _):
        a, b = hosts
        b.set_handler("/silent", silent, deadline_s=3.0)
        stream = await a.open_stream(b.peer_id, "/silent", timeout_s=5)
        started = trio.current_time()
        with pytest.raises(StreamError):
            await stream.read_exact(1)
        assert trio.current_time() - started == pytest.approx(3.0)  # the deadline, then a reset
        assert b.peers.penalty(a.peer_id) == 1
        assert await b.punish(a.peer_id, "test", points=BAN_POINTS)
        with pytest.raises(StreamError, match="unreachable"):  # a ban closes the connection
            await a.open_stream(b.peer_id, ECHO, timeout_s=5)
        assert a.peer_id not in b.connected_peers()


async def test_a_partition_cuts_dials_streams_and_gossip_until_healed(autojump_clock: trio.testing.MockClock) -> None:
    net = FakeNetwork(10, Faults())
    async with gossiping(net, 3) as (hosts, heard):
        a, b, c = hosts
        across = await a.open_stream(c.peer_id, ECHO, timeout_s=5)
        net.partition([a.peer_id, b.peer_id], [c.peer_id])
        with pytest.raises(StreamError, match="partitioned"):
            await across.read_exact(1)
        with pytest.raises(StreamError):
            await a.open_stream(c.peer_id, ECHO, timeout_s=5)
        with pytest.raises(DialError):
            await c.connect(PeerAddrs(a.peer_id, ()), timeout_s=5)
        await publish_all(a, 1)
        assert heard[1] == [(a.peer_id, b"message 0")] and heard[2] == []
        net.heal()
        await c.connect(PeerAddrs(a.peer_id, ()), timeout_s=5)
        await publish_all(a, 1)
        assert heard[2] == [(a.peer_id, b"message 0")]


async def scenario(seed: int) -> list[Delivery]:
    """Gossip and a stream exchange under every fault; the log, with times from the start."""
    net = FakeNetwork(seed, Faults(drop=0.1, duplicate=0.2, corrupt=0.1, delay_s=(0.01, MAX_DELAY_S)))
    async with gossiping(net, 3) as (hosts, _):
        started = trio.current_time()
        await publish_all(hosts[0], 30)
        await publish_all(hosts[2], 30)
        for attempt in range(5):
            try:
                stream = await hosts[1].open_stream(hosts[0].peer_id, ECHO, timeout_s=5)
                for i in range(5):
                    await wire.send(stream, "ping", 1, {"attempt": attempt, "i": i})
                    await stream.read_exact(16)
            except StreamError:
                continue
    return [replace(d, at=round(d.at - started, 9)) for d in net.log]


async def test_one_seed_gives_one_delivery_log(autojump_clock: trio.testing.MockClock) -> None:
    first, again, other = await scenario(11), await scenario(11), await scenario(12)
    assert first == again
    assert first != other
    fates = {(d.kind, d.fate) for d in first}
    assert {("gossip", "dropped"), ("gossip", "corrupted"), ("stream", "delivered")} <= fates


def test_faults_are_checked() -> None:
    with pytest.raises(ValueError, match="probability"):
        Faults(drop=1.5)
    with pytest.raises(ValueError, match="range"):
        Faults(delay_s=(1.0, 0.5))


# --- the run service over the fake network ---


def record(host: FakeHost, *, seq: int = 1) -> MemberRecord:
    unsigned = MemberRecord(host.peer_id, ("/ip4/10.0.0.1/tcp/4001",), "trainer", "cpu", 1 << 30, 1.7e9, seq)
    return sign_member(unsigned, host.seed, RUN)


@asynccontextmanager
async def run_services(net: FakeNetwork, count: int) -> AsyncIterator[list[RunService]]:
    """``count`` nodes joining one run a second apart (the first created it), each announcing
    its own record as the daemon does."""
    hosts = [net.add_host(seed, peer_ttl_s=5.0) for seed in SEEDS[:count]]
    async with net.running(), trio.open_nursery() as nursery:
        services: list[RunService] = []
        for host in hosts:
            state = RunState(RUN)
            if not services:
                state.create_manifest(Manifest(RUN, "fake", host.peer_id, 1.7e9), host.seed)
            else:
                await trio.sleep(JOIN_SPACING_S)  # virtual: the next node starts later
            service = RunService(
                host,
                state,
                host.peers,
                role="trainer",
                heartbeat_interval_s=1.0,
                anti_entropy_interval_s=2.0,
                dial_timeout_s=5.0,
            )
            await nursery.start(service.run)
            await service.push(state.put_member(record(host)))
            services.append(service)
        yield services
        nursery.cancel_scope.cancel()


async def new_records(net: FakeNetwork, services: list[RunService], seq: int) -> None:
    """Each node writes a newer record of itself (as after an address change) and pushes it."""
    for host, service in zip(net.hosts.values(), services, strict=True):
        await service.push(service.state.put_member(record(host, seq=seq)))


def agreed(services: list[RunService], seqs: dict[str, int]) -> bool:
    """One digest and the manifest everywhere, the members of ``seqs`` and no others, each at its seq."""
    everyone = {s.state.members.get(p) for s in services for p in seqs}
    return (
        len({s.state.digest for s in services}) == 1
        and all(s.state.manifest is not None and set(s.state.members) == set(seqs) for s in services)
        and all(r is not None and r.seq == seqs[r.peer_id] for r in everyone)
    )


def changes(services: list[RunService]) -> list[trio.Event]:
    return [s.state.changed for s in services] + [s.peers.changed for s in services]


async def test_five_nodes_converge_through_every_fault(autojump_clock: trio.testing.MockClock) -> None:
    net = FakeNetwork(21, Faults(drop=0.1, duplicate=0.1, corrupt=0.02, delay_s=(0.01, MAX_DELAY_S)))
    async with run_services(net, 5) as services:
        ids = list(net.hosts)
        await wait_until(lambda: agreed(services, dict.fromkeys(ids, 1)), lambda: changes(services), timeout_s=60)
        await new_records(net, services, 2)
        await wait_until(lambda: agreed(services, dict.fromkeys(ids, 2)), lambda: changes(services), timeout_s=60)
        await trio.sleep(SOAK_S)  # virtual: heartbeats, pulls and faults go on
        await wait_until(lambda: agreed(services, dict.fromkeys(ids, 2)), lambda: changes(services), timeout_s=60)
        assert trio.current_time() < PENALTY_DECAY_S  # no point was forgiven: penalties below are all there were
    hosts = list(net.hosts.values())
    assert {"dropped", "corrupted", "delivered"} <= {d.fate for d in net.log}
    penalized = 0
    for judge in hosts:
        assert judge.guard.num_faults == 0  # corrupted bytes met clean refusals, never a bug
        for peer in hosts:
            if peer is judge:
                continue
            corrupted = net.corrupted(judge.peer_id, peer.peer_id)
            points = judge.peers.penalty(peer.peer_id) + BAN_POINTS * judge.peers.is_banned(peer.peer_id)
            penalized += points
            # The guard blames whoever sent the bad bytes (on a real link Noise's MAC turns a
            # flipped bit into a broken connection, so bad bytes are the peer's own): here the
            # network corrupts them, and an honest peer pays at most a point per corrupted
            # message on the link between the two (either way: a mangled reply can leave the
            # asker silent until the responder's deadline blames it). A ban takes BAN_POINTS
            # of those within PENALTY_DECAY_S, which a low rate makes rare, and never less.
            assert points <= corrupted
    assert penalized > 0  # corrupted messages did get their senders penalized


async def test_a_partition_diverges_then_heals_and_converges(autojump_clock: trio.testing.MockClock) -> None:
    net = FakeNetwork(31, Faults(drop=0.05, delay_s=(0.01, MAX_DELAY_S)))
    async with run_services(net, 5) as services:
        ids = list(net.hosts)
        seqs = dict.fromkeys(ids, 1)
        await wait_until(lambda: agreed(services, seqs), lambda: changes(services), timeout_s=60)

        left, right = services[:3], services[3:]
        net.partition(ids[:3], ids[3:])
        for service, author in ((left[0], ids[0]), (right[0], ids[3])):  # one new record on each side
            await service.push(service.state.put_member(record(net.hosts[author], seq=2)))
        left_seqs, right_seqs = {**seqs, ids[0]: 2}, {**seqs, ids[3]: 2}
        await wait_until(
            lambda: agreed(left, left_seqs) and agreed(right, right_seqs), lambda: changes(services), timeout_s=60
        )
        assert left[0].state.digest != right[0].state.digest

        net.heal()
        both = {**seqs, ids[0]: 2, ids[3]: 2}
        await wait_until(lambda: agreed(services, both), lambda: changes(services), timeout_s=60)
    for host in net.hosts.values():
        assert not any(host.peers.is_banned(p) or host.peers.penalty(p) for p in ids)  # no corruption: no blame


async def test_a_heartbeat_announcing_an_hour_buys_no_more_than_our_view_allows(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A heartbeat's interval is believed up to twice what ours would be: in a run of three
    a peer claiming an hour between heartbeats is live for 3 such intervals of ours, not 3
    hours (it would hold a pairing window or a ZO wait that long after it left)."""
    net = FakeNetwork(5, Faults())
    async with run_services(net, 3) as services:
        ids = list(net.hosts)
        liar = net.add_host(SEEDS[5])
        await wait_until(lambda: agreed(services, dict.fromkeys(ids, 1)), lambda: changes(services), timeout_s=60)
        beat = gossip.Heartbeat(digest=services[0].state.digest, role="trainer", every_s=3600)
        await liar.publish(gossip.topic(RUN), gossip.encode(beat))
        await trio.testing.wait_all_tasks_blocked()
        watcher = services[0]
        assert watcher.peers.is_live(liar.peer_id)
        believed = TTL_HEARTBEATS * 2 * watcher.heartbeat_every_s()
        await trio.sleep(max(watcher.peers.ttl_s, believed) + 0.1)
        assert not watcher.peers.is_live(liar.peer_id)


async def test_a_settled_run_pulls_once_a_minute_not_every_few_seconds(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Anti-entropy pulls from a peer whose digest differs from ours; while all agree, once
    in ANTI_ENTROPY_IDLE_S (each pull sends our state vector: ~10 bytes per author)."""
    net = FakeNetwork(6, Faults())
    async with run_services(net, 4) as services:
        ids = list(net.hosts)
        await wait_until(lambda: agreed(services, dict.fromkeys(ids, 1)), lambda: changes(services), timeout_s=60)
        await trio.sleep(10.0)  # virtual: the last joiner's pulls are over
        before = [s.num_pulls for s in services]
        await trio.sleep(10 * ANTI_ENTROPY_IDLE_S)
        pulls = [s.num_pulls - b for s, b in zip(services, before, strict=True)]
        # Every anti_entropy_interval_s (2 s here) before: 300 pulls each.
        assert all(p <= 11 for p in pulls), pulls
        assert agreed(services, dict.fromkeys(ids, 1))


async def test_strangers_heartbeating_do_not_stretch_our_interval(autojump_clock: trio.testing.MockClock) -> None:
    """The interval grows with live members of the document, not with whoever heartbeats:
    40 strangers announcing an hour would otherwise slow every node's heartbeats and each
    stay live for minutes after they stopped."""
    net = FakeNetwork(7, Faults())
    async with run_services(net, 3) as services:
        ids = list(net.hosts)
        await wait_until(lambda: agreed(services, dict.fromkeys(ids, 1)), lambda: changes(services), timeout_s=60)
        strangers = [net.add_host(bytes([200 + i]) * 32) for i in range(40)]
        for stranger in strangers:
            beat = gossip.Heartbeat(digest=services[0].state.digest, role="trainer", every_s=3600)
            await stranger.publish(gossip.topic(RUN), gossip.encode(beat))
        await trio.testing.wait_all_tasks_blocked()
        watcher = services[0]
        assert len(watcher.peers.live()) >= 40
        assert watcher.heartbeat_every_s() == 1  # run_services' interval: 2 live members
