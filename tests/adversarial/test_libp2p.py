"""A hostile peer against py-libp2p's own handlers (protocol/net/libp2p_fixes.py): each of these
inputs ended the victim's host on an unpatched 0.8.1 (probed on loopback); now the victim
judges the peer and goes on serving."""

import contextlib
import os
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

import pytest
import trio
from libp2p.custom_types import TProtocol
from libp2p.exceptions import BaseLibp2pError
from libp2p.peer.id import ID
from libp2p.pubsub.pb import rpc_pb2
from libp2p.utils.varint import encode_uvarint

from protocol.errors import DialError, ProtocolError, StreamError
from protocol.net.host import Host, Stream, open_host, parse_dial_addr
from protocol.net.libp2p_fixes import KAD_PROTOCOL_ID
from protocol.net.peers import BAN_POINTS
from protocol.runstate.info import NodeInfo, ask_info, serve_info
from tests.conftest import wait_until

pytestmark = pytest.mark.integration
TOPIC = "t"
TIMEOUT_S = 30.0


def varint_frame(payload: bytes) -> bytes:
    return encode_uvarint(len(payload)) + payload


@asynccontextmanager
async def hosts(count: int) -> AsyncIterator[list[Host]]:
    async with AsyncExitStack() as stack:
        out = [
            await stack.enter_async_context(
                open_host(identity_seed=os.urandom(32), listen_addrs=["/ip4/127.0.0.1/tcp/0"], announce_addrs=[])
            )
            for _ in range(count)
        ]
        for host in out:
            serve_info(host, NodeInfo(host.peer_id, "trainer", (), "test"))
        for i, host in enumerate(out):
            for other in out[i + 1 :]:
                await host.connect(parse_dial_addr(other.addrs()[0]), timeout_s=5)
        yield out


async def raw_stream(attacker: Host, victim: Host, protocol: str) -> object:
    """A libp2p stream without our framing: the attacker writes whatever it likes."""
    return await attacker._host.new_stream(ID.from_base58(victim.peer_id), [TProtocol(protocol)])


async def penalized(victim: Host, attacker: Host) -> None:
    await wait_until(
        lambda: victim.peers.penalty(attacker.peer_id) > 0 or victim.peers.is_banned(attacker.peer_id),
        lambda: [victim.peers.changed],
        timeout_s=TIMEOUT_S,
    )


async def still_serving(victim: Host, asker: Host) -> None:
    with trio.fail_after(TIMEOUT_S):
        assert (await ask_info(asker, victim.peer_id)).peer_id == victim.peer_id


async def publish_rpc(attacker: Host, victim: Host, rpc: rpc_pb2.RPC) -> None:
    stream = await raw_stream(attacker, victim, "/meshsub/1.2.0")
    await stream.write(varint_frame(rpc.SerializeToString()))  # type: ignore[attr-defined]


async def test_garbage_on_gossipsub_is_judged_and_gossip_still_flows() -> None:
    async with hosts(3) as [victim, attacker, honest], trio.open_nursery() as nursery:
        received: list[bytes] = []
        arrived = trio.Event()

        async def listen() -> None:
            async with contextlib.aclosing(victim.subscribe(TOPIC)) as messages:
                async for message in messages:
                    received.append(message.data)
                    arrived.set()

        nursery.start_soon(listen)
        stream = await raw_stream(attacker, victim, "/meshsub/1.2.0")
        await stream.write(varint_frame(b"\xff" * 23))  # type: ignore[attr-defined]  # 23 bytes of bad protobuf
        await penalized(victim, attacker)
        await still_serving(victim, honest)
        with trio.fail_after(TIMEOUT_S):  # the mesh forms within a few heartbeats
            while not received:
                await honest.publish(TOPIC, b"after the attack")
                with trio.move_on_after(1.0):
                    await arrived.wait()
        assert received[0] == b"after the attack"
        nursery.cancel_scope.cancel()


async def test_a_published_message_with_a_garbage_key_is_judged() -> None:
    async with hosts(2) as [victim, attacker], trio.open_nursery() as nursery:

        async def subscribed() -> None:
            async with contextlib.aclosing(victim.subscribe(TOPIC)) as messages:
                async for _ in messages:
                    pass

        nursery.start_soon(subscribed)
        message = rpc_pb2.Message(
            topicIDs=[TOPIC], data=b"hi", seqno=b"\0" * 8, from_id=b"not-a-peer-id", signature=b"sig", key=b"garbage"
        )
        # Our subscription must be known to the attacker's side for the message to route:
        # the victim subscribes first, then the attacker speaks raw pubsub to it.
        await publish_rpc(attacker, victim, rpc_pb2.RPC(publish=[message]))
        await penalized(victim, attacker)
        await still_serving(victim, attacker)
        nursery.cancel_scope.cancel()


async def test_a_protocol_name_that_is_not_utf8_does_not_end_the_host() -> None:
    async with hosts(2) as [victim, attacker]:
        conn = attacker._host.get_network().connections[ID.from_base58(victim.peer_id)][0]
        stream = await conn.muxed_conn.open_stream()
        await stream.write(varint_frame(b"/multistream/1.0.0\n") + varint_frame(b"/\xff\xfe\n"))
        with trio.fail_after(TIMEOUT_S), pytest.raises(BaseLibp2pError):  # refused: the stream ends unanswered
            while await stream.read(64):
                pass
        await still_serving(victim, attacker)


async def test_an_answer_that_is_not_utf8_is_a_stream_error_for_us() -> None:
    async with hosts(2) as [us, evil]:

        async def answer_garbage(net_stream: object) -> None:
            await net_stream.write(varint_frame(b"/multistream/1.0.0\n") + varint_frame(b"\xff\xfe\n"))  # type: ignore[attr-defined]

        evil._host.get_network().set_stream_handler(answer_garbage)
        with trio.fail_after(TIMEOUT_S), pytest.raises(StreamError):
            await us.open_stream(evil.peer_id, "/swarmtrain/info/1.0.0", timeout_s=10)


async def test_the_dht_speaks_our_protocol_id_not_the_ipfs_one() -> None:
    async with hosts(2) as [a, b]:
        handlers = set(a._host.get_mux().handlers)
        assert TProtocol(KAD_PROTOCOL_ID) in handlers and TProtocol("/ipfs/kad/1.0.0") not in handlers
        with trio.fail_after(TIMEOUT_S):
            stream = await b.open_stream(a.peer_id, KAD_PROTOCOL_ID, timeout_s=10)
            await stream.close()
            with pytest.raises(StreamError):
                await b.open_stream(a.peer_id, "/ipfs/kad/1.0.0", timeout_s=10)


async def test_a_banned_peer_is_cut_off_and_cannot_come_back() -> None:
    async with hosts(2) as [victim, attacker]:
        for _ in range(BAN_POINTS):
            await victim.punish(attacker.peer_id, "test")
        assert victim.peers.is_banned(attacker.peer_id)
        assert attacker.peer_id not in victim.connected_peers()
        with trio.fail_after(TIMEOUT_S):
            with pytest.raises(ProtocolError):  # its connection is gone, whether it noticed yet or not
                stream = await attacker.open_stream(victim.peer_id, "/swarmtrain/info/1.0.0", timeout_s=5)
                await stream.write(b"x")
                await stream.read_exact(1)
            await attacker.disconnect(victim.peer_id)  # drop a stale view of it, if any: dial afresh
            with pytest.raises(DialError):
                await attacker.connect(parse_dial_addr(victim.addrs()[0]), timeout_s=5)
            with pytest.raises(DialError):
                await victim.connect(parse_dial_addr(attacker.addrs()[0]), timeout_s=5)
        assert attacker.peer_id not in victim.connected_peers()


async def test_our_stream_handlers_judge_whatever_escapes_them() -> None:
    class NativePanic(BaseException):
        """What pycrdt raises when yrs panics: not an Exception."""

    async with hosts(2) as [victim, attacker]:

        async def buggy(stream: Stream) -> None:
            await stream.read_exact(1)
            raise NativePanic("a native library panicked")

        victim.set_handler("/test/buggy/1.0.0", buggy)
        stream = await attacker.open_stream(victim.peer_id, "/test/buggy/1.0.0", timeout_s=10)
        await stream.write(b"x")
        with trio.fail_after(TIMEOUT_S), pytest.raises(ProtocolError):
            await stream.read_exact(1)  # reset, not answered
        await penalized(victim, attacker)
        assert victim.guard.num_faults == 1
        await still_serving(victim, attacker)
