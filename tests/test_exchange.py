"""Bulk tensor transfers between two real hosts on loopback, and every way a payload can be bad."""

import contextlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
import trio.testing

from protocol import wire
from protocol.errors import BadMessage, ProtocolError
from protocol.net import data_channel, exchange
from protocol.net.data_channel import DataChannel
from protocol.net.exchange import Payload, TensorReceiver, TensorSpec, any_transfer
from protocol.net.host import Host, Stream, open_host, parse_dial_addr
from protocol.net.traffic import TRAFFIC

pytestmark = pytest.mark.integration
LIMIT = 1 << 20


@asynccontextmanager
async def pair(*, direct: bool = False) -> AsyncIterator[tuple[Host, Host, TensorReceiver, list[tuple[str, Payload]]]]:
    """A sender and a receiving host; ``direct`` gives the receiver a data channel."""
    received: list[tuple[str, Payload]] = []

    async def accept(peer_id: str, payload: Payload) -> None:
        received.append((peer_id, Payload(payload.round, payload.specs, bytes(payload.data))))  # lent: copy

    listen = ["/ip4/127.0.0.1/tcp/0"]
    async with (
        open_host(identity_seed=b"\x01" * 32, listen_addrs=listen, announce_addrs=[]) as sender,
        open_host(identity_seed=b"\x02" * 32, listen_addrs=listen, announce_addrs=[]) as target,
        trio.open_nursery() as nursery,
    ):
        channel = DataChannel("127.0.0.1") if direct else None
        if channel is not None:
            await nursery.start(channel.run)
        receiver = TensorReceiver(
            target, accept, authorize=any_transfer, max_payload_nbytes=LIMIT, timeout_s=10, channel=channel
        )
        receiver.register()
        await sender.connect(parse_dial_addr(target.addrs()[0]), timeout_s=5)
        yield sender, target, receiver, received
        nursery.cancel_scope.cancel()


def payload(round_index: int = 3) -> Payload:
    specs = (TensorSpec("w", "float32", (64, 32)), TensorSpec("b", "bfloat16", (32,)), TensorSpec("e", "int8", (0,)))
    total = sum(s.nbytes for s in specs)
    data = (bytes(range(256)) * (total // 256 + 1))[:total]
    return Payload(round_index, specs, data)


@pytest.mark.parametrize("direct", [False, True])
async def test_round_trip_delivers_every_byte_and_spec(direct: bool) -> None:
    async with pair(direct=direct) as (sender, target, receiver, received):
        sent = payload()
        await exchange.send_tensors(sender, target.peer_id, sent, timeout_s=10)
        assert receiver.num_direct == int(direct)
        ((peer_id, got),) = received
        assert peer_id == sender.peer_id
        assert got.round == 3 and got.specs == sent.specs and bytes(got.data) == bytes(sent.data)
        views = got.views()
        assert len(views["w"]) == 64 * 32 * 4 and len(views["b"]) == 64 and len(views["e"]) == 0


@pytest.mark.parametrize("direct", [False, True])
async def test_every_byte_on_the_wire_is_counted(direct: bool) -> None:
    """protocol/net/traffic.py: a payload sent over a libp2p stream (encrypted and framed:
    more bytes than the payload) or over the data channel (the payload and its token) shows
    in the process's counters, sent and received (both hosts are in this process)."""
    async with pair(direct=direct) as (sender, target, _receiver, received):
        sent = payload()
        before = (TRAFFIC.sent, TRAFFIC.received)
        await exchange.send_tensors(sender, target.peer_id, sent, timeout_s=10)
        assert len(received) == 1
        grew = (TRAFFIC.sent - before[0], TRAFFIC.received - before[1])
        assert min(grew) >= len(sent.data) + (data_channel.TOKEN_NBYTES if direct else 0)
        assert max(grew) <= len(sent.data) + 64 * 1024  # plus headers, acks and framing: not twice


async def raw_send(sender: Host, target: Host, header: dict[str, object], body: bytes) -> dict[str, object]:
    """Speak the protocol by hand: header, then (if told to go) the body on the stream, then the verdict."""
    stream = await sender.open_stream(target.peer_id, exchange.PROTOCOL_ID, timeout_s=5)
    await wire.send(stream, "tensors", 1, header)
    with trio.fail_after(10):
        reply = await wire.receive(stream, msg_types=frozenset({"ack", "go"}), version=1, max_nbytes=4096)
        if reply["t"] == "ack":
            return reply
        assert reply["port"] == 0
        await stream.write(body)
        return await wire.receive(stream, msg_types=frozenset({"ack"}), version=1, max_nbytes=4096)


def header_for(data: bytes, **changes: object) -> dict[str, object]:
    header: dict[str, object] = {
        "round": 1,
        "tensors": [{"name": "w", "dtype": "float32", "shape": [len(data) // 4], "nbytes": len(data)}],
        "nbytes": len(data),
        "blake3": exchange.digest(data),
        "channel": "stream",
    }
    header.update(changes)
    return header


BODY = b"\x00\x00\x80\x3f" * 256  # 256 float32 ones
BAD = {
    "hash mismatch": (header_for(BODY, blake3=b"\x00" * 32), BODY, "hash"),
    "unknown channel": (header_for(BODY, channel="pigeon"), BODY, "unknown channel"),
    "wrong shape for nbytes": (
        header_for(BODY, tensors=[{"name": "w", "dtype": "float32", "shape": [3, 3], "nbytes": 1024}]),
        BODY,
        "nbytes does not match",
    ),
    "unknown dtype": (
        header_for(BODY, tensors=[{"name": "w", "dtype": "complex64", "shape": [128], "nbytes": 1024}]),
        BODY,
        "unknown dtype",
    ),
    "oversized": (
        header_for(
            b"", nbytes=LIMIT + 4, tensors=[{"name": "w", "dtype": "int8", "shape": [LIMIT + 4], "nbytes": LIMIT + 4}]
        ),
        b"",
        "outside",
    ),
    "total disagrees with tensors": (header_for(BODY, nbytes=512), BODY[:512], "header says"),
    "duplicate names": (
        header_for(
            BODY,
            tensors=[{"name": "w", "dtype": "int8", "shape": [512], "nbytes": 512}] * 2,
        ),
        BODY,
        "twice",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
async def test_bad_payloads_are_refused_and_never_delivered(case: str) -> None:
    header, body, reason = BAD[case]
    async with pair() as (sender, target, receiver, received):
        ack = await raw_send(sender, target, header, body)
        assert ack["ok"] is False and reason in str(ack["reason"])
        assert received == [] and receiver.num_refused == 1


async def test_a_truncated_payload_is_never_delivered() -> None:
    async with pair() as (sender, target, _, received):
        stream = await sender.open_stream(target.peer_id, exchange.PROTOCOL_ID, timeout_s=5)
        await wire.send(stream, "tensors", 1, header_for(BODY))
        await wire.receive(stream, msg_types=frozenset({"go"}), version=1, max_nbytes=4096)
        await stream.write(BODY[:100])
        await stream.close()  # EOF 924 bytes early
        with trio.fail_after(10), pytest.raises(ProtocolError):
            await stream.read_exact(1)
        assert received == []


async def test_a_refusal_surfaces_to_the_sender() -> None:
    async with pair() as (sender, target, _, received):
        big = Payload(0, (TensorSpec("w", "int8", (LIMIT + 1,)),), bytes(LIMIT + 1))
        with pytest.raises(ProtocolError):
            await exchange.send_tensors(sender, target.peer_id, big, timeout_s=10)
        assert received == []


async def test_tampering_on_the_direct_channel_is_caught_by_the_hash_and_blames_nobody() -> None:
    async with pair(direct=True) as (sender, target, receiver, received):
        stream = await sender.open_stream(target.peer_id, exchange.PROTOCOL_ID, timeout_s=5)
        await wire.send(stream, "tensors", 1, header_for(BODY, channel="direct"))
        go = await wire.receive(stream, msg_types=frozenset({"go"}), version=1, max_nbytes=4096)
        assert go["port"] > 0 and len(go["token"]) == 32
        forged = b"\xff" + BODY[1:]  # what a man in the middle of the plain TCP link could do
        await data_channel.send("127.0.0.1", go["port"], go["token"], memoryview(forged))
        with trio.fail_after(10):
            ack = await wire.receive(stream, msg_types=frozenset({"ack"}), version=1, max_nbytes=4096)
        assert ack["ok"] is False and "hash" in ack["reason"]
        assert received == [] and receiver.num_refused == 1
        # Plain TCP authenticates nobody: no blame, but this sender's bytes take the stream
        # now, where a bad hash is its own.
        assert target.peers.penalty(sender.peer_id) == 0
        stream = await sender.open_stream(target.peer_id, exchange.PROTOCOL_ID, timeout_s=5)
        await wire.send(stream, "tensors", 1, header_for(BODY, channel="direct"))
        go = await wire.receive(stream, msg_types=frozenset({"go"}), version=1, max_nbytes=4096)
        assert go["port"] == 0
        await stream.write(forged)
        with trio.fail_after(10):
            ack = await wire.receive(stream, msg_types=frozenset({"ack"}), version=1, max_nbytes=4096)
        assert ack["ok"] is False and "hash" in ack["reason"]
        assert received == [] and target.peers.penalty(sender.peer_id) > 0


async def test_the_data_port_ignores_connections_without_a_valid_token() -> None:
    async with pair(direct=True) as (sender, target, _receiver, received):
        stream = await sender.open_stream(target.peer_id, exchange.PROTOCOL_ID, timeout_s=5)
        await wire.send(stream, "tensors", 1, header_for(BODY, channel="direct"))
        go = await wire.receive(stream, msg_types=frozenset({"go"}), version=1, max_nbytes=4096)
        # A stranger guessing tokens gets nothing: its bytes are dropped unread.
        with contextlib.suppress(ProtocolError):  # the receiver hangs up on it
            await data_channel.send("127.0.0.1", go["port"], b"\x00" * 32, memoryview(BODY))
        # The real sender, with the real token, still completes the transfer.
        await data_channel.send("127.0.0.1", go["port"], go["token"], memoryview(BODY))
        with trio.fail_after(10):
            ack = await wire.receive(stream, msg_types=frozenset({"ack"}), version=1, max_nbytes=4096)
        assert ack["ok"] is True
        ((_, got),) = received
        assert bytes(got.data) == BODY


@pytest.mark.parametrize("go", [{"port": 80, "token": bytes(32)}, {"port": 40000, "token": b"GET / HTTP/1.0\r\n\r\n"}])
async def test_a_sender_dials_no_port_and_writes_no_token_a_receiver_could_aim_at_another_service(
    go: dict[str, object],
) -> None:
    """A hostile receiver picks the port and the token: ours are an ephemeral port and 32
    random bytes, never a privileged port or a request of its own making."""
    async with pair() as (sender, target, _receiver, _received):

        async def aiming(stream: Stream) -> None:
            await wire.receive(stream, msg_types=frozenset({"tensors"}), version=1, max_nbytes=1 << 20)
            await wire.send(stream, "go", 1, go)
            await trio.sleep_forever()

        target.set_handler(exchange.PROTOCOL_ID, aiming)
        with trio.fail_after(10), pytest.raises(BadMessage, match="go-ahead"):
            await exchange.send_tensors(sender, target.peer_id, payload(), timeout_s=10)


async def test_a_sender_that_never_connects_to_our_port_costs_one_transfer_then_uses_the_stream(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A firewall in front of our data port: the receiver waits DIRECT_CONNECT_S, not the
    whole transfer's time, blames nobody, and that sender's payloads take the stream."""
    monkeypatch.setattr(exchange, "DIRECT_CONNECT_S", 0.3)
    async with pair(direct=True) as (sender, target, receiver, received):
        stream = await sender.open_stream(target.peer_id, exchange.PROTOCOL_ID, timeout_s=5)
        await wire.send(stream, "tensors", 1, header_for(BODY, channel="direct"))
        go = await wire.receive(stream, msg_types=frozenset({"go"}), version=1, max_nbytes=4096)
        assert go["port"] > 0  # and we never connect
        with trio.fail_after(10), pytest.raises(ProtocolError):  # the receiver gives up: reset
            await wire.receive(stream, msg_types=frozenset({"ack"}), version=1, max_nbytes=4096)
        assert target.peers.penalty(sender.peer_id) == 0
        await exchange.send_tensors(
            sender, target.peer_id, Payload(3, (TensorSpec("w", "float32", (256,)),), BODY), timeout_s=10
        )
        assert [bytes(p.data) for _, p in received] == [BODY] and receiver.num_direct == 0


async def test_a_waiter_is_released_when_another_task_ends_its_transfer() -> None:
    async with channel_running() as channel:
        token = channel.expect(memoryview(bytearray(8)), "peer")
        outcome: list[str] = []

        async def waiter() -> None:
            try:
                await channel.wait(token)
            except ProtocolError as exc:
                outcome.append(str(exc))

        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(waiter)
                await trio.testing.wait_all_tasks_blocked()
                channel.cancel(token)  # from another task: the waiter must not wait forever
        assert outcome == ["data channel: the transfer was ended by its receiver"]
        with pytest.raises(ProtocolError, match="no transfer"):  # and a wait after the end
            await channel.wait(token)


@asynccontextmanager
async def channel_running(**options: Any) -> AsyncIterator[DataChannel]:
    channel = DataChannel("127.0.0.1", **options)
    async with trio.open_nursery() as nursery:
        await nursery.start(channel.run)
        yield channel
        nursery.cancel_scope.cancel()


async def test_a_sender_stalling_mid_payload_is_cut_when_its_receiver_gives_up() -> None:
    """Else the buffer and the socket stay held for as long as the sender likes."""
    async with channel_running() as channel:
        token = channel.expect(memoryview(bytearray(len(BODY))), "peer")
        async with await trio.open_tcp_stream("127.0.0.1", channel.port) as sender:
            await sender.send_all(token + BODY[:100])  # then nothing more
            with trio.move_on_after(0.2):  # the receiver's own deadline, short here
                await channel.wait(token)
            with trio.fail_after(10):
                assert await sender.receive_some(1) == b""  # the receiver hung up on it
        assert channel.expect(memoryview(bytearray(1)), "peer")  # and its slot is free again


async def test_a_hashed_channel_takes_the_tokens_hash_not_the_token() -> None:
    """A receiver picks the token: sent as such, its first bytes would be ones a peer chose."""
    async with channel_running(hashed=True) as channel:
        buffer = bytearray(len(BODY))
        token = channel.expect(memoryview(buffer), "peer")
        with contextlib.suppress(ProtocolError):  # dropped unread: the channel hangs up
            await data_channel.send("127.0.0.1", channel.port, token, memoryview(b"\xff" * len(BODY)))
        presented = data_channel.presented(token)
        await data_channel.send("127.0.0.1", channel.port, presented, memoryview(BODY), nonce=channel.nonce)
        with trio.fail_after(10):
            await channel.wait(token)
        assert bytes(buffer) == BODY


async def test_a_receiver_waiting_for_a_connection_that_never_comes_gives_up_unjudged() -> None:
    async with channel_running() as channel:
        token = channel.expect(memoryview(bytearray(len(BODY))), "peer")
        with trio.fail_after(10), pytest.raises(ProtocolError, match="no connection within"):
            await channel.wait(token, connect_timeout_s=0.1)
        assert channel.expect(memoryview(bytearray(1)), "peer")  # the transfer ended: its slot is free


def test_buffer_pool_reuses_buffers_of_the_same_size_up_to_a_cap() -> None:
    pool = exchange.BufferPool()
    first = pool.take(1024)
    pool.give(first)
    assert pool.take(1024) is first
    assert pool.take(1024) is not first  # not given back yet: a fresh one
    buffers = [pool.take(64) for _ in range(exchange.MAX_FREE_PER_SIZE + 2)]
    for buffer in buffers:
        pool.give(buffer)
    taken = [pool.take(64) for _ in range(exchange.MAX_FREE_PER_SIZE + 2)]
    reused = sum(any(t is b for b in buffers) for t in taken)  # identity: equal zeros are not the same buffer
    assert reused == exchange.MAX_FREE_PER_SIZE
