"""Member dials (protocol/runstate/run.py): a member whose record gets new addresses is dialed
at once, even while the dial of its old addresses still hangs.

Behind NATs a member's first record names only its private address (dials of it hang until
their timeout: the NAT drops the SYNs) and its next one, a second later, its relay circuit.
The loop used to wait for every dial of a sweep to end, then back off from the failed
member: in the NAT test bed its first relayed connection came 9 s after its relay slot.
"""

import trio
import trio.testing

from protocol.errors import DialError
from protocol.net.hostlike import PeerAddrs
from protocol.runstate.run import RunService
from protocol.runstate.state import Manifest, MemberRecord, RunState, sign_member
from tests.fakenet import FakeHost, FakeNetwork, Faults

RUN = "dials-abc123"
PRIVATE = ("/ip4/192.168.3.2/tcp/4001",)
WITH_CIRCUIT = (*PRIVATE, "/ip4/10.0.0.2/tcp/4001/p2p/relay/p2p-circuit")
DIAL_TIMEOUT_S = 10.0


class NatDialer(FakeHost):
    """Dials of ``PRIVATE`` alone hang until their timeout, as a NAT makes them."""

    def __init__(self, net: FakeNetwork, seed: bytes) -> None:
        super().__init__(net, seed, peer_ttl_s=30.0)
        self.dialed: list[tuple[str, ...]] = []
        self.hanging = 0
        self.hanging_when_circuit_dialed: int | None = None
        self.hung = trio.Event()
        self.reached = trio.Event()

    async def connect(self, peer: PeerAddrs, *, timeout_s: float) -> None:
        self.dialed.append(peer.addrs)
        if peer.addrs == PRIVATE:
            self.hanging += 1
            self.hung.set()
            try:
                await trio.sleep(timeout_s)  # virtual time: only the timeout tells
            finally:
                self.hanging -= 1
            raise DialError(f"dial {peer.peer_id} timed out after {timeout_s:g} s")
        self.hanging_when_circuit_dialed = self.hanging
        await super().connect(peer, timeout_s=timeout_s)
        self.reached.set()


def member(host: FakeHost, addrs: tuple[str, ...], seq: int) -> MemberRecord:
    return sign_member(MemberRecord(host.peer_id, addrs, "trainer", "cpu", 1 << 30, 1.7e9, seq), host.seed, RUN)


async def test_a_member_with_new_addresses_is_dialed_at_once_while_the_old_dial_hangs(
    autojump_clock: trio.testing.MockClock,
) -> None:
    net = FakeNetwork(5, Faults())
    us = NatDialer(net, bytes([1]) * 32)
    net.hosts[us.peer_id] = us
    them = net.add_host(bytes([2]) * 32)
    state = RunState(RUN)
    state.create_manifest(Manifest(RUN, "dials", us.peer_id, 1.7e9), us.seed)
    state.put_member(member(them, PRIVATE, 1))
    service = RunService(
        us,
        state,
        us.peers,
        role="trainer",
        heartbeat_interval_s=1.0,
        anti_entropy_interval_s=2.0,
        dial_timeout_s=DIAL_TIMEOUT_S,
    )
    async with net.running(), trio.open_nursery() as nursery:
        await nursery.start(service.run)
        with trio.fail_after(DIAL_TIMEOUT_S):
            await us.hung.wait()
        state.put_member(member(them, WITH_CIRCUIT, 2))  # its relay slot came
        with trio.fail_after(60):
            await us.reached.wait()
        assert us.dialed == [PRIVATE, WITH_CIRCUIT]
        assert us.hanging_when_circuit_dialed == 1  # not after the old dial gave up
        nursery.cancel_scope.cancel()
