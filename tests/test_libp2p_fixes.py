"""Fix 12 of protocol/net/libp2p_fixes.py: pubsub's signed peer records and IDONTWANT cost
what they must, not a signature check and an address listing per message."""

import contextlib
import os
from typing import Any

import pytest
import trio
from libp2p.peer.id import ID
from libp2p.pubsub.gossipsub import GossipSub
from libp2p.pubsub.pb import rpc_pb2

from protocol.net import libp2p_fixes
from protocol.net.host import open_host, parse_dial_addr

PEER = ID.from_base58("12D3KooWD8Hd2Mxjj3jWJENDSFZdjfhMLGUrfxqqhrLvcBN2vYkf")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(libp2p_fixes, "time", clock)
    monkeypatch.setattr(libp2p_fixes, "_records_checked", {})
    return clock


def counting_consume(monkeypatch: pytest.MonkeyPatch, valid: bytes) -> list[bytes]:
    """libp2p's own consume replaced by one that takes only the record ``valid``."""
    calls: list[bytes] = []

    def consume(msg: rpc_pb2.RPC, host: Any, peer_id: ID) -> bool:
        calls.append(msg.senderRecord)
        return msg.senderRecord == valid

    monkeypatch.setattr(libp2p_fixes, "_consume_signed_record", consume)
    return calls


def test_a_peers_record_is_checked_once_while_it_sends_the_same_bytes(
    monkeypatch: pytest.MonkeyPatch, clock: Clock
) -> None:
    calls = counting_consume(monkeypatch, b"record one")
    rpc = rpc_pb2.RPC(senderRecord=b"record one")
    assert all(libp2p_fixes._consume_signed_record_once(rpc, None, PEER) for _ in range(50))
    assert len(calls) == 1
    clock.now += libp2p_fixes.RECORD_RECHECK_S  # then once more, as libp2p's 2 h record needs
    assert libp2p_fixes._consume_signed_record_once(rpc, None, PEER)
    assert len(calls) == 2
    assert libp2p_fixes._consume_signed_record_once(rpc_pb2.RPC(), None, PEER)
    assert len(calls) == 2  # no record: nothing to check


def test_a_record_that_fails_its_check_is_checked_and_refused_every_time(
    monkeypatch: pytest.MonkeyPatch, clock: Clock
) -> None:
    """A hostile peer cannot get a bad record taken by sending it again, nor a good one
    of someone else's by sending it as its own (the pair is the key)."""
    calls = counting_consume(monkeypatch, b"good")
    bad = rpc_pb2.RPC(senderRecord=b"forged")
    assert not any(libp2p_fixes._consume_signed_record_once(bad, None, PEER) for _ in range(3))
    assert len(calls) == 3
    good = rpc_pb2.RPC(senderRecord=b"good")
    assert libp2p_fixes._consume_signed_record_once(good, None, PEER)
    other = ID.from_base58("12D3KooWRXgoJ4SwE2WRwdnSyfRcniTQ3L1w46yA4t5NTB8wfcZH")
    assert libp2p_fixes._consume_signed_record_once(good, None, other)
    assert len(calls) == 5  # checked for the other peer too


def test_the_records_remembered_are_bounded(monkeypatch: pytest.MonkeyPatch, clock: Clock) -> None:
    monkeypatch.setattr(libp2p_fixes, "_consume_signed_record", lambda msg, host, peer_id: True)
    for i in range(3 * libp2p_fixes.MAX_RECORDS_KEPT):
        clock.now += 1e-3
        assert libp2p_fixes._consume_signed_record_once(rpc_pb2.RPC(senderRecord=i.to_bytes(4)), None, PEER)
        assert len(libp2p_fixes._records_checked) <= libp2p_fixes.MAX_RECORDS_KEPT


def test_our_own_record_is_reused_for_a_while(monkeypatch: pytest.MonkeyPatch, clock: Clock) -> None:
    class FakeHost:
        pass

    made: list[int] = []

    def env_to_send(host: Any) -> tuple[bytes, bool]:
        made.append(1)
        return b"envelope %d" % len(made), True

    monkeypatch.setattr(libp2p_fixes, "_env_to_send", env_to_send)
    host = FakeHost()
    assert libp2p_fixes._local_record(host) == (b"envelope 1", True)
    assert libp2p_fixes._local_record(host) == (b"envelope 1", False)
    clock.now += libp2p_fixes.LOCAL_RECORD_REUSE_S
    assert libp2p_fixes._local_record(host) == (b"envelope 2", True)
    assert len(made) == 2


@pytest.mark.parametrize(("nbytes", "emitted"), [(100, 0), (libp2p_fixes.IDONTWANT_MIN_NBYTES, 0), (4096, 1)])
async def test_idontwant_goes_out_for_large_messages_only(
    monkeypatch: pytest.MonkeyPatch, nbytes: int, emitted: int
) -> None:
    emits: list[bytes] = []

    async def publish(self: GossipSub, msg_forwarder: ID, pubsub_msg: rpc_pb2.Message) -> None:
        await self._emit_idontwant_for_message(b"id", pubsub_msg.topicIDs)  # as 0.8.1's publish does

    async def emit(self: GossipSub, msg_id: bytes, topic_ids: Any) -> None:
        emits.append(msg_id)

    monkeypatch.setattr(libp2p_fixes, "_gossipsub_publish", publish)
    monkeypatch.setattr(libp2p_fixes, "_emit_idontwant", emit)
    message = rpc_pb2.Message(data=bytes(nbytes), topicIDs=["t"])
    await GossipSub.publish(object.__new__(GossipSub), PEER, message)
    assert len(emits) == emitted


@pytest.mark.integration
async def test_gossip_flows_and_the_senders_record_is_kept() -> None:
    """On real hosts: messages arrive, and the first one's record reached the peerstore
    (checked once, not skipped)."""
    async with (
        open_host(identity_seed=os.urandom(32), listen_addrs=["/ip4/127.0.0.1/tcp/0"], announce_addrs=[]) as a,
        open_host(identity_seed=os.urandom(32), listen_addrs=["/ip4/127.0.0.1/tcp/0"], announce_addrs=[]) as b,
        trio.open_nursery() as nursery,
    ):
        await b.connect(parse_dial_addr(a.addrs()[0]), timeout_s=5)
        received: list[bytes] = []
        arrived = trio.Event()

        async def listen() -> None:
            async with contextlib.aclosing(b.subscribe("t")) as messages:
                async for message in messages:
                    received.append(message.data)
                    if len(received) >= 3:
                        arrived.set()

        nursery.start_soon(listen)
        with trio.fail_after(30):  # the mesh forms within a few heartbeats
            while not arrived.is_set():
                await a.publish("t", b"x" * 10)
                with trio.move_on_after(0.5):
                    await arrived.wait()
        assert received[:3] == [b"x" * 10] * 3
        assert b._host.get_peerstore().get_peer_record(ID.from_base58(a.peer_id)) is not None
        nursery.cancel_scope.cancel()
