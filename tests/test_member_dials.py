"""Member dials (protocol/runstate/dials.py): a member whose record gets new addresses is
dialed at once, and the dial of its old addresses, still hanging, is cancelled; a member
reached some other way has its dial cancelled; fresh addresses in every record do not dodge
the back-off.

Behind NATs a member's first record names only its private address (dials of it hang until
their timeout: the NAT drops the SYNs) and its next one, a second later, its relay circuit.
The loop used to wait for every dial of a sweep to end, then back off from the failed
member: in the NAT test bed its first relayed connection came 9 s after its relay slot.
"""

import trio
import trio.testing

from protocol.errors import DialError
from protocol.net import gossip
from protocol.net.hostlike import PeerAddrs
from protocol.net.memnet import FakeHost, FakeNetwork, Faults
from protocol.runstate.dials import MAX_DIALS_PER_MEMBER
from protocol.runstate.run import RunService
from protocol.runstate.state import Manifest, MemberRecord, RunState, sign_member

RUN = "dials-abc123"
PRIVATE = ("/ip4/192.168.3.2/tcp/4001",)
WITH_CIRCUIT = (*PRIVATE, "/ip4/10.0.0.2/tcp/4001/p2p/relay/p2p-circuit")
DIAL_TIMEOUT_S = 10.0
PEER_TTL_S = 30.0


class NatDialer(FakeHost):
    """Dials of addresses without a relay circuit hang until their timeout, as a NAT makes them."""

    def __init__(self, net: FakeNetwork, seed: bytes) -> None:
        super().__init__(net, seed, peer_ttl_s=PEER_TTL_S)
        self.dialed: list[tuple[str, ...]] = []
        self.num_cancelled = 0
        self.num_timed_out = 0
        self.hung = trio.Event()
        self.cancelled = trio.Event()
        self.reached = trio.Event()

    async def connect(self, peer: PeerAddrs, *, timeout_s: float) -> None:
        self.dialed.append(peer.addrs)
        if not any("/p2p-circuit" in a for a in peer.addrs):
            self.hung.set()
            try:
                await trio.sleep(timeout_s)  # virtual time: only the timeout tells
            except trio.Cancelled:
                self.num_cancelled += 1
                self.cancelled.set()
                raise
            self.num_timed_out += 1
            raise DialError(f"dial {peer.peer_id} timed out after {timeout_s:g} s")
        await super().connect(peer, timeout_s=timeout_s)
        self.reached.set()


def member(host: FakeHost, addrs: tuple[str, ...], seq: int) -> MemberRecord:
    return sign_member(MemberRecord(host.peer_id, addrs, "trainer", "cpu", 1 << 30, 1.7e9, seq), host.seed, RUN)


def run_service(host: FakeHost, state: RunState, *, anti_entropy_interval_s: float = 2.0) -> RunService:
    return RunService(
        host,
        state,
        host.peers,
        role="trainer",
        heartbeat_interval_s=1.0,
        anti_entropy_interval_s=anti_entropy_interval_s,
        dial_timeout_s=DIAL_TIMEOUT_S,
    )


def setup() -> tuple[FakeNetwork, NatDialer, FakeHost, RunState, RunService]:
    net = FakeNetwork(5, Faults())
    us = NatDialer(net, bytes([1]) * 32)
    net.hosts[us.peer_id] = us
    them = net.add_host(bytes([2]) * 32)
    state = RunState(RUN)
    state.create_manifest(Manifest(RUN, "dials", us.peer_id, 1.7e9), us.seed)
    state.put_member(member(them, PRIVATE, 1))
    return net, us, them, state, run_service(us, state)


async def test_a_member_with_new_addresses_is_dialed_at_once_and_the_old_dial_cancelled(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The old dial held a dial slot until its timeout and then, falling back to our relays,
    could make a second (relayed) connection to a member already reached."""
    net, us, them, state, service = setup()
    async with net.running(), trio.open_nursery() as nursery:
        await nursery.start(service.run)
        with trio.fail_after(DIAL_TIMEOUT_S):
            await us.hung.wait()
        state.put_member(member(them, WITH_CIRCUIT, 2))  # its relay slot came
        with trio.fail_after(DIAL_TIMEOUT_S):  # not after the old dial gave up
            await us.reached.wait()
            await us.cancelled.wait()
        assert us.dialed == [PRIVATE, WITH_CIRCUIT]
        assert (us.num_cancelled, us.num_timed_out) == (1, 0)
        nursery.cancel_scope.cancel()


async def test_the_dial_of_a_member_that_reached_us_is_cancelled(autojump_clock: trio.testing.MockClock) -> None:
    net, us, them, _, service = setup()
    async with net.running(), trio.open_nursery() as nursery:
        await nursery.start(service.run)
        with trio.fail_after(DIAL_TIMEOUT_S):
            await us.hung.wait()
        await them.connect(PeerAddrs(us.peer_id, ()), timeout_s=DIAL_TIMEOUT_S)  # it dialed us
        with trio.fail_after(DIAL_TIMEOUT_S):  # the next sweep, not the dial's timeout
            await us.cancelled.wait()
        assert us.dialed == [PRIVATE] and us.num_timed_out == 0
        nursery.cancel_scope.cancel()


async def test_fresh_addresses_in_every_record_do_not_dodge_the_back_off(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A member that names new (unreachable) addresses in each record it publishes is dialed
    ``MAX_DIALS_PER_MEMBER`` times per peer TTL, not once per record."""
    net, us, them, state, service = setup()
    async with net.running(), trio.open_nursery() as nursery:
        await nursery.start(service.run)
        for seq in range(2, 10):
            await trio.testing.wait_all_tasks_blocked()  # the sweep read the record before
            state.put_member(member(them, (f"/ip4/192.168.3.{seq}/tcp/4001",), seq))
        await trio.testing.wait_all_tasks_blocked()
        assert len(us.dialed) == MAX_DIALS_PER_MEMBER
        autojump_clock.jump(PEER_TTL_S + 1)  # the window is over: its newest record is dialed
        await trio.testing.wait_all_tasks_blocked()
        assert len(us.dialed) == MAX_DIALS_PER_MEMBER + 1
        assert us.dialed[-1] == ("/ip4/192.168.3.9/tcp/4001",)
        nursery.cancel_scope.cancel()


async def test_a_node_that_knows_only_its_bootstrap_peer_learns_the_run_from_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """It hears the run's heartbeats through its one connection, from members behind NATs
    whose addresses it does not know: pulls go to its connection instead (each pull to
    them timed out; in a 64-daemon simulation such a node failed 248 of 248 for minutes).
    The bootstrap peer serves the run's state but has not heartbeated: it is not live.
    The newcomer is behind a NAT too, so they cannot sync with it either."""
    from protocol.runstate.sync import StateSync

    net = FakeNetwork(7, Faults())
    boot, newcomer = net.add_host(bytes([1]) * 32), net.add_host(bytes([2]) * 32)
    natted = [net.add_host(bytes([3 + i]) * 32) for i in range(2)]
    full = RunState(RUN)
    full.create_manifest(Manifest(RUN, "boot", boot.peer_id, 1.7e9), boot.seed)
    for host in natted:
        host.behind_nat = True
        full.put_member(member(host, PRIVATE, 1))
    theirs = [RunState(RUN) for _ in natted]
    for state in theirs:
        state.apply_remote(full.encode())
    ours = RunState(RUN)
    newcomer.behind_nat = True  # nor can they reach it (a sync carries both sides' news)

    async with net.running(), trio.open_nursery() as nursery:
        StateSync(boot, full).register()
        for host, state in zip(natted, theirs, strict=True):
            await host.connect(PeerAddrs(boot.peer_id, ()), timeout_s=DIAL_TIMEOUT_S)
            await nursery.start(run_service(host, state).run)
        await newcomer.connect(PeerAddrs(boot.peer_id, ()), timeout_s=DIAL_TIMEOUT_S)
        await nursery.start(run_service(newcomer, ours).run)
        with trio.fail_after(30):  # a few heartbeats (1 s) and anti-entropy rounds (2 s)
            while not all(ours.has_member(h.peer_id) for h in natted):
                await ours.changed.wait()
        nursery.cancel_scope.cancel()


async def test_a_stranger_buys_no_long_liveness_with_a_document_of_made_up_members(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A synced peer is live for the TTL a heartbeat of our own interval would give, not one
    scaled by the document's records (keys are free: a second reader's stranger synced once
    with 1,000 made-up members and stayed live for 3,006 s)."""
    from protocol.runstate.sync import StateSync

    net = FakeNetwork(8, Faults())
    us, stranger = net.add_host(bytes([1]) * 32), net.add_host(bytes([2]) * 32)
    ours, theirs = RunState(RUN), RunState(RUN)
    ours.create_manifest(Manifest(RUN, "ttl", us.peer_id, 1.7e9), us.seed)
    theirs.apply_remote(ours.encode())
    for i in range(200):  # made-up members, each signed by its own fresh key
        theirs.put_member(member(net.add_host((1000 + i).to_bytes(4, "big") * 8), PRIVATE, 1))
    service = run_service(us, ours)
    async with net.running(), trio.open_nursery() as nursery:
        StateSync(stranger, theirs).register()
        await nursery.start(service.run)
        await us.connect(PeerAddrs(stranger.peer_id, ()), timeout_s=DIAL_TIMEOUT_S)
        await service.on_peer_connected(stranger.peer_id, "test")
        with trio.fail_after(30):
            while not us.peers.is_live(stranger.peer_id):
                await us.peers.changed.wait()
        assert len(ours.members) >= 200  # the records came (admitted: each is validly signed)
        live_for_s = service.sync_live_for_s()
        assert live_for_s < 200  # before: 3 × 200 members = 600 s
        net.remove_host(stranger.peer_id)  # gone without a word (it never heartbeated)
        await trio.sleep(live_for_s + 1.0)
        assert not us.peers.is_live(stranger.peer_id)
        nursery.cancel_scope.cancel()


async def test_heartbeats_from_strangers_do_not_send_our_pulls_to_honest_peers(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A node that knows the run pulls from a heartbeat's sender or from no one: a key
    gossiping heartbeats with made-up digests cannot turn each into a state sync with an
    honest connection of every node (a second reader's 20 a second: 11 syncs a second at
    each of 16 nodes)."""
    from protocol.runstate import sync as sync_module

    net = FakeNetwork(9, Faults())
    us, honest, junk = (net.add_host(bytes([i]) * 32) for i in (1, 2, 3))
    junk.behind_nat = True
    ours = RunState(RUN)
    ours.create_manifest(Manifest(RUN, "junk", us.peer_id, 1.7e9), us.seed)
    ours.put_member(member(honest, PRIVATE, 1))
    ours.put_member(member(us, PRIVATE, 1))
    theirs = RunState(RUN)
    theirs.apply_remote(ours.encode())
    served = []
    serve = sync_module.StateSync._serve

    async def counted(self: sync_module.StateSync, stream: object) -> None:
        served.append(trio.current_time())
        await serve(self, stream)  # type: ignore[arg-type]

    sync_module.StateSync._serve = counted  # type: ignore[method-assign]
    try:
        async with net.running(), trio.open_nursery() as nursery:
            # Anti-entropy (its own bound: one pull an interval) out of the way: what is
            # left is the pull each heartbeat with another digest asks for.
            for host, state in ((us, ours), (honest, theirs)):
                await nursery.start(run_service(host, state, anti_entropy_interval_s=3600.0).run)
            await us.connect(PeerAddrs(honest.peer_id, ()), timeout_s=DIAL_TIMEOUT_S)
            await trio.sleep(10.0)
            before = len(served)
            for i in range(60):  # 60 s of heartbeats with made-up digests
                beat = gossip.Heartbeat(digest=f"{i:016x}", role="trainer", every_s=0)
                await junk.publish(gossip.topic(RUN), gossip.encode(beat))
                await trio.sleep(1.0)
            assert len(served) == before  # before: a sync with the honest peer per heartbeat
            nursery.cancel_scope.cancel()
    finally:
        sync_module.StateSync._serve = serve  # type: ignore[method-assign]
