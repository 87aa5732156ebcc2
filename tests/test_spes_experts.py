"""Expert versions between real libp2p hosts on loopback: signed heads, hashed bytes, bounded
sizes, and what a hostile holder can and cannot make us take."""

import contextlib
import hashlib
import itertools
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from functools import partial

import numpy as np
import pytest
import trio

from node.algorithms.spes import experts
from node.algorithms.spes.experts import ExpertStore, Head, parse_head, sign_head
from protocol import keys, wire
from protocol.errors import BadMessage, ProtocolError, StreamError
from protocol.net import data_channel
from protocol.net.data_channel import DataChannel
from protocol.net.host import Host, Stream, open_host, parse_dial_addr
from protocol.net.memnet import FakeNetwork, FakeStream, Faults
from training.encodings import expert_versions
from training.encodings.experts import Chain

RUN = "experts-abc123"
SEED_A, SEED_B = b"\x0a" * 32, b"\x0b" * 32
NBYTES = 4096
TIMEOUT_S = 30.0


@asynccontextmanager
async def two_hosts() -> AsyncIterator[tuple[Host, Host]]:
    async with (
        open_host(identity_seed=SEED_A, listen_addrs=["/ip4/127.0.0.1/tcp/0"], announce_addrs=[]) as a,
        open_host(identity_seed=SEED_B, listen_addrs=["/ip4/127.0.0.1/tcp/0"], announce_addrs=[]) as b,
    ):
        await b.connect(parse_dial_addr(a.addrs()[0]), timeout_s=10)
        yield a, b


def stores(a: Host, b: Host) -> tuple[ExpertStore, ExpertStore]:
    owner, fetcher = ExpertStore(a, RUN), ExpertStore(b, RUN)
    for store in (owner, fetcher):
        store.configure(4, NBYTES)
        store.register()
    return owner, fetcher


def test_a_head_is_its_owners_signature_over_the_version() -> None:
    data = bytes(range(256)) * 16
    head = sign_head(SEED_A, RUN, 2, 7, data)
    assert head.sha256 == hashlib.sha256(data).digest() and head.owner == keys.peer_id_of(SEED_A)
    assert parse_head(head.wire(), RUN) == head
    for forged in (
        Head(2, head.owner, 8, head.sha256, head.sig),  # another round
        Head(3, head.owner, 7, head.sha256, head.sig),  # another expert
        Head(2, keys.peer_id_of(SEED_B), 7, head.sha256, head.sig),  # another owner
    ):
        with pytest.raises(BadMessage):
            parse_head(forged.wire(), RUN)
    with pytest.raises(BadMessage):
        parse_head(head.wire(), "other-run-abc123")
    for junk in ([], [1, 2, 3, 4], [-1, head.owner, 7, head.sha256, head.sig], [2, head.owner, 7, b"x", head.sig]):
        with pytest.raises(BadMessage):
            parse_head(junk, RUN)


async def test_a_published_version_is_fetched_by_a_peer_and_served_on() -> None:
    async with two_hosts() as (a, b):
        owner, fetcher = stores(a, b)
        data = bytes([7]) * NBYTES
        head = owner.publish(SEED_A, 1, 3, data)
        with trio.fail_after(TIMEOUT_S):
            await fetcher.sync_once([a.peer_id], lambda h: True)
        assert fetcher.held[1].data == data and fetcher.held[1].head == head
        assert fetcher.fetched == 1 and fetcher.newest_by_owner[a.peer_id] == 3
        assert owner.bytes_sent == NBYTES and fetcher.bytes_received == NBYTES
        # Nothing newer: nothing fetched again; a version not wanted is not fetched at all.
        owner.publish(SEED_A, 2, 3, data)
        with trio.fail_after(TIMEOUT_S):
            await fetcher.sync_once([a.peer_id], lambda h: h.expert != 2)
        assert fetcher.fetched == 1 and 2 not in fetcher.held
        # The fetcher serves what it holds: heads list it under its owner's signature.
        with trio.fail_after(TIMEOUT_S):
            _, heads = await owner.heads(b.peer_id)
        assert heads == [head]


async def test_bytes_that_do_not_hash_as_signed_are_refused_and_cost_the_holder() -> None:
    async with two_hosts() as (a, b):
        _, fetcher = stores(a, b)
        honest = bytes([1]) * NBYTES
        head = sign_head(SEED_A, RUN, 0, 5, honest)

        async def lying(stream: Stream) -> None:
            await wire.receive(stream, msg_types=frozenset({"get"}), version=experts.VERSION, max_nbytes=4096)
            await wire.send(stream, "expert", experts.VERSION, {"nbytes": NBYTES})
            await stream.write(bytes([2]) * NBYTES)

        a.set_handler(experts.PROTOCOL_ID, lying)
        with trio.fail_after(TIMEOUT_S), pytest.raises(BadMessage, match="hash"):
            await fetcher.fetch(a.peer_id, head)
        assert 0 not in fetcher.held
        assert b.peers.penalty(a.peer_id) > 0


@pytest.mark.parametrize("nbytes", [NBYTES - 1, NBYTES + 1, 1 << 40])
async def test_a_size_other_than_the_runs_expert_is_refused_before_anything_is_allocated(nbytes: int) -> None:
    async with two_hosts() as (a, b):
        _, fetcher = stores(a, b)
        head = sign_head(SEED_A, RUN, 0, 5, bytes(NBYTES))

        async def oversized(stream: Stream) -> None:
            await wire.receive(stream, msg_types=frozenset({"get"}), version=experts.VERSION, max_nbytes=4096)
            await wire.send(stream, "expert", experts.VERSION, {"nbytes": nbytes})
            await trio.sleep_forever()  # nothing follows: the header alone must be refused

        a.set_handler(experts.PROTOCOL_ID, oversized)
        with trio.fail_after(TIMEOUT_S), pytest.raises(BadMessage, match="nbytes"):
            await fetcher.fetch(a.peer_id, head)
        assert 0 not in fetcher.held


async def test_heads_with_a_forged_signature_are_refused_whole() -> None:
    async with two_hosts() as (a, b):
        _, fetcher = stores(a, b)
        good = sign_head(SEED_A, RUN, 0, 5, bytes(NBYTES))
        forged = Head(1, keys.peer_id_of(SEED_B), 9, good.sha256, good.sig)  # "signed" by b

        async def forging(stream: Stream) -> None:
            await wire.receive(stream, msg_types=frozenset({"heads?"}), version=experts.VERSION, max_nbytes=4096)
            await wire.send(stream, "heads", experts.VERSION, {"round": 9, "heads": [good.wire(), forged.wire()]})

        a.set_handler(experts.PROTOCOL_ID, forging)
        with trio.fail_after(TIMEOUT_S), pytest.raises(ProtocolError):
            await fetcher.heads(a.peer_id)
        assert fetcher.newest_by_owner == {}  # nothing of the batch counted
        assert b.peers.penalty(a.peer_id) > 0


async def test_a_holder_gives_nothing_of_another_run_or_a_version_it_does_not_hold() -> None:
    async with two_hosts() as (a, b):
        owner, _ = stores(a, b)
        owner.publish(SEED_A, 0, 1, bytes(NBYTES))
        other_run = ExpertStore(b, "other-run-abc123")
        other_run.configure(4, NBYTES)
        with trio.fail_after(TIMEOUT_S):
            assert await other_run.heads(a.peer_id) == (0, [])
            stale = sign_head(SEED_A, RUN, 0, 0, bytes([9]) * NBYTES)
            fetcher = ExpertStore(b, RUN)
            fetcher.configure(4, NBYTES)
            assert await fetcher.fetch(a.peer_id, stale) is False


@asynccontextmanager
async def direct_stores(a: Host, b: Host) -> AsyncIterator[tuple[ExpertStore, ExpertStore]]:
    """``stores`` whose fetcher offers its data channel (the owner serves over it)."""
    channel = DataChannel("127.0.0.1", per_peer=experts.MAX_PARALLEL_FETCHES, hashed=True)
    owner, fetcher = ExpertStore(a, RUN), ExpertStore(b, RUN, channel=channel)
    for store in (owner, fetcher):
        store.configure(4, NBYTES)
        store.register()
    async with trio.open_nursery() as nursery:
        await nursery.start(channel.run)
        yield owner, fetcher
        nursery.cancel_scope.cancel()


async def test_versions_come_over_the_askers_data_channel_where_it_can_be_reached() -> None:
    async with two_hosts() as (a, b), direct_stores(a, b) as (owner, fetcher):
        first, second = bytes([7]) * NBYTES, bytes(range(256)) * (NBYTES // 256)
        heads = [owner.publish(SEED_A, 1, 3, first), owner.publish(SEED_A, 2, 3, second)]
        with trio.fail_after(TIMEOUT_S):
            await fetcher.sync_once([a.peer_id], lambda h: True)  # both at once: two pending on one peer
        assert [fetcher.held[e].data for e in (1, 2)] == [first, second]
        assert [fetcher.held[e].head for e in (1, 2)] == heads
        assert fetcher.direct_received == 2 and owner.bytes_sent == fetcher.bytes_received == 2 * NBYTES
        # Behind a NAT nobody can open a connection to us: the bytes take the stream.
        b.nat.status.reachability = "private"
        third = owner.publish(SEED_A, 3, 3, first)
        with trio.fail_after(TIMEOUT_S):
            assert await fetcher.fetch(a.peer_id, third) is True
        assert fetcher.held[3].data == first and fetcher.direct_received == 2


async def test_bytes_over_the_data_channel_that_do_not_hash_are_refused_and_the_stream_serves_that_holder() -> None:
    """The channel's bytes are not authenticated (a tamperer on the path could have changed
    them): no blame, and the stream, where a bad hash is the holder's own, serves from now."""
    async with two_hosts() as (a, b), direct_stores(a, b) as (_, fetcher):
        head = sign_head(SEED_A, RUN, 0, 5, bytes([1]) * NBYTES)

        async def lying(stream: Stream) -> None:
            request = await wire.receive(stream, msg_types=frozenset({"get"}), version=experts.VERSION, max_nbytes=4096)
            await wire.send(stream, "expert", experts.VERSION, {"nbytes": NBYTES, "channel": request["channel"]})
            if request["channel"] != experts.CHANNEL:
                await stream.write(bytes([2]) * NBYTES)
                return
            go = await wire.receive(stream, msg_types=frozenset({"go"}), version=experts.VERSION, max_nbytes=4096)
            forged = memoryview(bytes([2]) * NBYTES)
            presented = data_channel.presented(go["token"])
            await data_channel.send("127.0.0.1", go["port"], presented, forged, nonce=go["nonce"])

        a.set_handler(experts.PROTOCOL_ID, lying)
        with trio.fail_after(TIMEOUT_S), pytest.raises(ProtocolError, match="data channel do not hash") as refused:
            await fetcher.fetch(a.peer_id, head)
        assert not isinstance(refused.value, BadMessage) and fetcher.direct_received == 1
        assert 0 not in fetcher.held and b.peers.penalty(a.peer_id) == 0
        with trio.fail_after(TIMEOUT_S), pytest.raises(BadMessage, match="hash"):  # now on the stream
            await fetcher.fetch(a.peer_id, head)
        assert 0 not in fetcher.held and fetcher.direct_received == 1 and b.peers.penalty(a.peer_id) > 0


async def test_a_holder_that_cannot_reach_our_data_port_serves_us_on_streams() -> None:
    """A firewall in front of our data port: the first fetch fails within the connect
    timeout, blaming nobody, and the versions take streams from then on, both ways."""
    async with two_hosts() as (a, b), direct_stores(a, b) as (owner, fetcher):
        data = bytes([3]) * NBYTES
        head = owner.publish(SEED_A, 0, 2, data)
        with socket.socket() as closed:  # a port nobody listens on
            closed.bind(("127.0.0.1", 0))
            port = closed.getsockname()[1]
        assert fetcher._channel is not None
        fetcher._channel.port = port  # as a firewall would make it: the holder's dial fails
        with trio.fail_after(TIMEOUT_S), pytest.raises(ProtocolError, match="could not reach our data channel"):
            await fetcher.fetch(a.peer_id, head)  # at once: not after waiting for the connection
        assert a.peers.penalty(b.peer_id) == 0 and b.peers.penalty(a.peer_id) == 0
        assert owner._channel_failed(b.peer_id) and fetcher._channel_failed(a.peer_id)
        with trio.fail_after(TIMEOUT_S):
            assert await fetcher.fetch(a.peer_id, head) is True
        assert fetcher.held[0].data == data and fetcher.direct_received == 0


async def test_a_holder_pushing_the_data_channel_on_an_asker_that_did_not_offer_it_is_refused() -> None:
    async with two_hosts() as (a, b):
        _, fetcher = stores(a, b)  # no channel: it offers none
        head = sign_head(SEED_A, RUN, 0, 5, bytes(NBYTES))

        async def pushing(stream: Stream) -> None:
            request = await wire.receive(stream, msg_types=frozenset({"get"}), version=experts.VERSION, max_nbytes=4096)
            assert request["channel"] == 0
            await wire.send(stream, "expert", experts.VERSION, {"nbytes": NBYTES, "channel": experts.CHANNEL})
            await trio.sleep_forever()

        a.set_handler(experts.PROTOCOL_ID, pushing)
        with trio.fail_after(TIMEOUT_S), pytest.raises(BadMessage, match="did not offer"):
            await fetcher.fetch(a.peer_id, head)
        assert b.peers.penalty(a.peer_id) > 0


async def _direct_holder(stream: Stream, then: Callable[[dict[str, object]], Awaitable[None]]) -> None:
    """A holder's side up to the asker's go, then ``then(go)``."""
    await wire.receive(stream, msg_types=frozenset({"get"}), version=experts.VERSION, max_nbytes=4096)
    await wire.send(stream, "expert", experts.VERSION, {"nbytes": NBYTES, "channel": experts.CHANNEL})
    await then(await wire.receive(stream, msg_types=frozenset({"go"}), version=experts.VERSION, max_nbytes=4096))


async def ask_with_go(asker: Host, holder: str, head: Head, go: dict[str, object]) -> Stream:
    """A raw asker: ``get`` of ``head``'s expert offering the data channel, the holder's
    offer checked, then ``go`` as given; the stream, for what the holder says next."""
    stream = await asker.open_stream(holder, experts.PROTOCOL_ID, timeout_s=TIMEOUT_S)
    request = {"run": RUN, "expert": head.expert, "sha256": head.sha256, "channel": experts.CHANNEL}
    await wire.send(stream, "get", experts.VERSION, request)
    reply = await wire.receive(stream, msg_types=frozenset({"expert"}), version=experts.VERSION, max_nbytes=4096)
    assert reply["channel"] == experts.CHANNEL
    await wire.send(stream, "go", experts.VERSION, go)
    return stream


@pytest.mark.parametrize("fault", ["never connects", "stops after 10 bytes"])
async def test_a_holder_whose_data_channel_transfer_fails_costs_a_fetch_not_the_sync(
    fault: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The failure is a ProtocolError like any other (once an ExceptionGroup, from a nursery,
    that no caller caught: it ended the node's sync), and that holder's versions take streams."""
    monkeypatch.setattr(experts, "DIRECT_CONNECT_S", 0.5)
    async with two_hosts() as (a, b), direct_stores(a, b) as (_, fetcher):
        head = sign_head(SEED_A, RUN, 0, 5, bytes([1]) * NBYTES)

        async def failing(go: dict[str, object]) -> None:
            if fault == "stops after 10 bytes":
                port, token, nonce = go["port"], go["token"], go["nonce"]
                assert isinstance(port, int) and isinstance(token, bytes) and isinstance(nonce, bytes)
                async with await trio.open_tcp_stream("127.0.0.1", port) as raw:
                    assert await raw.receive_some(32) == data_channel.greeting_of(nonce)
                    await raw.send_all(data_channel.presented(token) + bytes(10))
            await trio.sleep_forever()

        a.set_handler(experts.PROTOCOL_ID, lambda stream: _direct_holder(stream, failing))
        with trio.fail_after(TIMEOUT_S), pytest.raises(ProtocolError):
            await fetcher.fetch(a.peer_id, head)
        assert fetcher._channel_failed(a.peer_id) and b.peers.penalty(a.peer_id) == 0
        # And in the sync: that holder's failure leaves the others' versions coming.
        a.set_handler(experts.PROTOCOL_ID, lambda stream: _direct_holder(stream, failing))
        fetcher._no_direct.clear()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(fetcher._get, head, [a.peer_id])  # raised through it before
        assert 0 not in fetcher.held and fetcher._channel_failed(a.peer_id)


SSH_BANNER = b"SSH-2.0-OpenSSH_9.6p1 Ubuntu-3ubuntu13.5\r\n"


@pytest.mark.parametrize(
    ("service", "nonce"),
    [
        (b"", bytes(32)),
        (b"220 mail.example ESMTP\r\n", bytes(32)),
        # The nonce an asker would name if the greeting were the nonce itself: the banner's
        # first 32 bytes. The holder expects a hash of it, which no banner is.
        (SSH_BANNER, SSH_BANNER[:32]),
    ],
)
async def test_a_holder_writes_nothing_to_a_port_that_does_not_greet_as_the_asker_said(
    service: bytes, nonce: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An asker naming another service's port on its IP (a router's, a container host's):
    that service hears nothing from us, whatever it says or does not say first."""
    monkeypatch.setattr(data_channel, "CONNECT_TIMEOUT_S", 0.5)
    heard = bytearray()
    async with two_hosts() as (a, b), direct_stores(a, b) as (owner, _):
        head = owner.publish(SEED_A, 0, 1, bytes([5]) * NBYTES)

        async def other_service(conn: trio.SocketStream) -> None:
            async with conn:
                if service:
                    await conn.send_all(service)
                # A holder closing on a banner longer than a greeting leaves bytes unread:
                # its kernel resets the connection.
                with contextlib.suppress(trio.BrokenResourceError):
                    while chunk := await conn.receive_some(4096):
                        heard.extend(chunk)

        async with trio.open_nursery() as nursery:
            (listener,) = await nursery.start(partial(trio.serve_tcp, other_service, 0, host="127.0.0.1"))
            port = listener.socket.getsockname()[1]
            with trio.fail_after(TIMEOUT_S):
                go = {"port": port, "token": bytes(range(32)), "nonce": nonce}
                stream = await ask_with_go(b, a.peer_id, head, go)
                said = await wire.receive(
                    stream, msg_types=frozenset({"failed"}), version=experts.VERSION, max_nbytes=4096
                )
            assert "greet" in str(said["reason"]) and owner._channel_failed(b.peer_id)
            nursery.cancel_scope.cancel()
    assert bytes(heard) == b"" and owner.bytes_sent == 0


@pytest.mark.parametrize(
    "go",
    [
        {"port": 1 << 16, "token": bytes(32), "nonce": bytes(32)},
        {"port": 80, "token": bytes(32), "nonce": bytes(32)},  # a port none of ours is: another service's
        {"port": 40000, "token": b"GET / HTTP/1.0\r\n\r\n", "nonce": bytes(32)},  # bytes of its choosing
        {"port": 40000, "token": bytes(32)},
        {"port": 40000, "nonce": bytes(32)},
    ],
)
async def test_an_askers_malformed_go_costs_it_and_the_holder_serves_on(go: dict[str, object]) -> None:
    async with two_hosts() as (a, b), direct_stores(a, b) as (owner, fetcher):
        data = bytes([5]) * NBYTES
        head = owner.publish(SEED_A, 0, 1, data)
        with trio.fail_after(TIMEOUT_S):
            stream = await ask_with_go(b, a.peer_id, head, go)
            with pytest.raises(StreamError):  # the holder gives up on us: the stream ends
                await stream.read_exact(1)
            assert a.peers.penalty(b.peer_id) > 0 and owner.bytes_sent == 0
            assert await fetcher.fetch(a.peer_id, head) is True  # and serves the next asker
        assert fetcher.held[0].data == data


@asynccontextmanager
async def syncing(fetcher: ExpertStore, peers: list[str], answers: int) -> AsyncIterator[list[str]]:
    """``fetcher`` syncing from ``peers`` until they answered ``answers`` times in all (the
    list of who answered, in order)."""
    answered: list[str] = []
    enough = trio.Event()
    take_heads = fetcher.take_heads

    def noted(peer_id: str, reply: dict[str, object]) -> tuple[int, list[Head]]:
        answer = take_heads(peer_id, reply)
        answered.append(peer_id)
        if len(answered) >= answers:
            enough.set()
        return answer

    fetcher.take_heads = noted  # type: ignore[method-assign]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(fetcher.sync_forever, lambda: peers, lambda h: True)
        with trio.fail_after(TIMEOUT_S):
            await enough.wait()
        yield answered
        nursery.cancel_scope.cancel()


async def test_heads_are_asked_again_and_again_on_one_stream() -> None:
    """Opening a libp2p stream costs ~5 ms of CPU, an ask on an open one ~1 ms."""
    async with two_hosts() as (a, b):
        owner, fetcher = stores(a, b)
        owner.publish(SEED_A, 1, 3, bytes([7]) * NBYTES)
        sessions = 0
        serve_session = owner._serve_session

        async def counted(stream: Stream) -> None:
            nonlocal sessions
            sessions += 1
            await serve_session(stream)

        a.set_handler(experts.HEADS_PROTOCOL_ID, counted, deadline_s=3600.0)
        async with syncing(fetcher, [a.peer_id], answers=4) as answered:
            assert answered[:4] == [a.peer_id] * 4 and sessions == 1
        assert fetcher.held[1].data == bytes([7]) * NBYTES


async def test_a_holder_without_heads_sessions_is_asked_a_stream_an_ask() -> None:
    """A holder of the release before sessions serves only ``heads?`` on the experts protocol."""
    async with two_hosts() as (a, b):
        owner, fetcher = ExpertStore(a, RUN), ExpertStore(b, RUN)
        for store in (owner, fetcher):
            store.configure(4, NBYTES)
        fetcher.register()
        a.set_handler(experts.PROTOCOL_ID, owner._serve)  # and nothing else, as before sessions
        owner.publish(SEED_A, 1, 3, bytes([7]) * NBYTES)
        async with syncing(fetcher, [a.peer_id], answers=2) as answered:
            assert answered[:2] == [a.peer_id] * 2
        assert a.peer_id in fetcher._sessionless and fetcher.held[1].data == bytes([7]) * NBYTES


async def test_a_heads_session_is_answered_no_faster_than_its_bound_and_one_a_peer(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A peer asking as fast as it can, on as many sessions or streams as it likes, costs a
    holder one answer per MIN_ASK_INTERVAL_S."""
    monkeypatch.setattr(experts, "SESSION_IDLE_S", 3600.0)  # sessions end only as tested here
    net = FakeNetwork(1, Faults())
    async with net.running():
        holder_host, asker = net.add_host(SEED_A), net.add_host(SEED_B)
        holder = ExpertStore(holder_host, RUN)
        holder.configure(4, NBYTES)
        holder.register()

        async def ask(stream: FakeStream, times: int) -> list[float]:
            for _ in range(times):
                await wire.send(stream, "heads?", experts.VERSION, {"run": RUN})
            answered = []
            for _ in range(times):
                await wire.receive(stream, msg_types=frozenset({"heads"}), version=experts.VERSION, max_nbytes=4096)
                answered.append(trio.current_time())
            return answered

        with trio.fail_after(60):
            first = await asker.open_stream(holder_host.peer_id, experts.HEADS_PROTOCOL_ID, timeout_s=10)
            answered = await ask(first, 5)
            # Each answer at least the bound after the last (less the clock's float rounding).
            assert min(b - a for a, b in itertools.pairwise(answered)) >= experts.MIN_ASK_INTERVAL_S - 1e-9
            second = await asker.open_stream(holder_host.peer_id, experts.HEADS_PROTOCOL_ID, timeout_s=10)
            answered += await ask(second, 1)
            with pytest.raises(StreamError):  # the second session ended the first
                await ask(first, 1)
            # Nor do asks a stream each, all at once, get answers faster (the release before
            # sessions asks so): one slot per peer, whatever the protocol.
            singles: list[float] = []

            async def single() -> None:
                stream = await asker.open_stream(holder_host.peer_id, experts.PROTOCOL_ID, timeout_s=10)
                singles.extend(await ask(stream, 1))

            async with trio.open_nursery() as nursery:
                for _ in range(3):
                    nursery.start_soon(single)
            answered = sorted([*answered, *singles])
            assert min(b - a for a, b in itertools.pairwise(answered)) >= experts.MIN_ASK_INTERVAL_S - 1e-9
        assert holder_host.peers.penalty(asker.peer_id) == 0


SPARSE = expert_versions("sparseloco")
NUMEL = 4096 + 100  # a full chunk and a partial one


def chained_stores(a: Host, b: Host) -> tuple[ExpertStore, ExpertStore]:
    owner, fetcher = ExpertStore(a, RUN), ExpertStore(b, RUN)
    for store in (owner, fetcher):
        configure_chained(store)
        store.register()
    return owner, fetcher


def configure_chained(store: ExpertStore) -> None:
    store.configure(4, *SPARSE.sizes(NUMEL), link=lambda w: SPARSE.link(w, NUMEL), max_chain=SPARSE.chain)


def owner_versions(rounds: int) -> list[tuple[bytes, Chain]]:
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(NUMEL) * 0.02).astype(np.float32)
    chain: Chain | None = None
    out = []
    for _ in range(rounds):
        x = (x + rng.standard_normal(NUMEL).astype(np.float32) * np.float32(0.002)).astype(np.float32)
        wire, chain = SPARSE.encode_next(x.tobytes(), chain)
        assert chain is not None
        out.append((wire, chain))
    return out


async def test_a_holder_that_missed_deltas_fetches_back_along_the_chain_and_serves_it_on() -> None:
    versions = owner_versions(5)
    async with two_hosts() as (a, b):
        owner, fetcher = chained_stores(a, b)
        owner.publish(SEED_A, 2, 0, versions[0][0])
        with trio.fail_after(TIMEOUT_S):
            await fetcher.sync_once([a.peer_id], lambda h: True)
        assert fetcher.held[2].versions() == (versions[0][0],)
        for round_index in range(1, 5):  # the fetcher misses rounds 1..3
            head = owner.publish(SEED_A, 2, round_index, versions[round_index][0])
        assert owner.held[2].versions() == tuple(w for w, _ in versions)
        with trio.fail_after(TIMEOUT_S):
            await fetcher.sync_once([a.peer_id], lambda h: True)
        held = fetcher.held[2]
        assert held.head == head and fetcher.chain_fetches == 3  # 3, 2, 1; 1's base it held
        assert held.versions() == tuple(w for w, _ in versions)
        public = SPARSE.decode_chain(held.versions(), NUMEL)
        assert np.array_equal(public.view(np.uint32), versions[-1][1].public.view(np.uint32))
        # A third node, holding nothing, gets the whole chain from the fetcher (not the owner).
        async with open_host(identity_seed=b"\x0c" * 32, listen_addrs=["/ip4/127.0.0.1/tcp/0"], announce_addrs=[]) as c:
            await c.connect(parse_dial_addr(b.addrs()[0]), timeout_s=10)
            third = ExpertStore(c, RUN)
            configure_chained(third)
            with trio.fail_after(TIMEOUT_S):
                await third.sync_once([b.peer_id], lambda h: True)
            assert third.held[2].versions() == held.versions() and third.chain_fetches == 4


class Hostile:
    """An owner serving a signed delta and whatever versions it likes by sha256, counting asks."""

    def __init__(self, host: Host, tip: bytes, by_sha: dict[bytes, bytes]) -> None:
        self.head = sign_head(SEED_A, RUN, 1, 7, tip)
        self.by_sha = {self.head.sha256: tip, **by_sha}
        self.gets = 0
        host.set_handler(experts.PROTOCOL_ID, self.serve)

    def resign(self, tip: bytes) -> None:
        """Another signed head of the same round, for ``tip``."""
        self.head = sign_head(SEED_A, RUN, 1, 7, tip)
        self.by_sha[self.head.sha256] = tip

    async def serve(self, stream: Stream) -> None:
        request = await wire.receive(
            stream, msg_types=frozenset({"heads?", "get"}), version=experts.VERSION, max_nbytes=4096
        )
        if request["t"] == "heads?":
            await wire.send(stream, "heads", experts.VERSION, {"round": 7, "heads": [self.head.wire()]})
            return
        self.gets += 1
        data = self.by_sha.get(request["sha256"])
        if data is None:
            await wire.send(stream, "gone", experts.VERSION, {})
            return
        await wire.send(stream, "expert", experts.VERSION, {"nbytes": len(data)})
        await stream.write(data)


def forged_delta(base: bytes, depth: int) -> bytes:
    """A well-formed delta (a real one's payload) of ``depth`` naming ``base``."""
    real = owner_versions(2)[1][0]
    return bytes([real[0], depth]) + base + real[34:]


async def test_a_delta_naming_a_base_nobody_holds_is_never_applied_nor_asked_for_again() -> None:
    async with two_hosts() as (a, b):
        _, fetcher = chained_stores(a, b)
        hostile = Hostile(a, forged_delta(hashlib.sha256(b"nothing").digest(), 1), {})
        for _ in range(3):
            with trio.fail_after(TIMEOUT_S):
                await fetcher.sync_once([a.peer_id], lambda h: True)
        # The tip and its missing base were asked for once; the delta is held nowhere.
        assert hostile.gets == 2 and 1 not in fetcher.held and fetcher.fetched == 0
        assert fetcher.unresolved[(1, hostile.head.owner)] == 7


async def test_an_owner_re_signing_an_unresolvable_head_each_time_is_not_fetched_again() -> None:
    """Another head of the same round each time we ask (another base each: all missing):
    its chains are not walked again (they were, 2 gets a sync, keyed by the exact head)."""
    async with two_hosts() as (a, b):
        _, fetcher = chained_stores(a, b)
        hostile = Hostile(a, forged_delta(hashlib.sha256(b"nothing 0").digest(), 1), {})
        for i in range(1, 4):
            with trio.fail_after(TIMEOUT_S):
                await fetcher.sync_once([a.peer_id], lambda h: True)
            hostile.resign(forged_delta(hashlib.sha256(f"nothing {i}".encode()).digest(), 1))
        assert hostile.gets == 2 and 1 not in fetcher.held


async def test_a_delta_whose_depth_lies_about_its_place_after_a_held_version_is_refused() -> None:
    """A holder of the keyframe K, offered a delta naming K with depth 5 (not 1): the chain
    it keeps does not start at K, so decoding refuses it (cached holders took it before,
    fresh ones refused it: the same version judged two ways)."""
    versions = owner_versions(2)
    keyframe = versions[0][0]
    async with two_hosts() as (a, b):
        owner, fetcher = chained_stores(a, b)
        owner.publish(SEED_A, 1, 0, keyframe)
        with trio.fail_after(TIMEOUT_S):
            await fetcher.sync_once([a.peer_id], lambda h: True)
        assert fetcher.held[1].versions() == (keyframe,)
        liar = forged_delta(hashlib.sha256(keyframe).digest(), 5)
        Hostile(a, liar, {})
        with trio.fail_after(TIMEOUT_S):
            await fetcher.sync_once([a.peer_id], lambda h: True)
        held = fetcher.held[1]
        assert held.versions() == (liar,)  # not (keyframe, liar)
        with pytest.raises(ValueError):
            SPARSE.decode_chain(held.versions(), NUMEL)
    public = SPARSE.decode_chain([keyframe], NUMEL)
    with pytest.raises(ValueError, match="one deeper"):
        SPARSE.decode_chain([liar], NUMEL, base=public, base_depth=0)
    honest = versions[1][0]
    assert np.array_equal(
        SPARSE.decode_chain([honest], NUMEL, base=public, base_depth=0), SPARSE.decode_chain([keyframe, honest], NUMEL)
    )


async def test_a_chain_longer_than_a_chain_may_be_is_walked_no_further_and_refused() -> None:
    async with two_hosts() as (a, b):
        _, fetcher = chained_stores(a, b)
        # 3 × CHAIN deltas, each naming the next, all claiming the deepest depth; then the
        # same with depths that fall by one a step, as an honest chain's do, but past CHAIN.
        for depths in ([SPARSE.chain - 1] * (3 * SPARSE.chain), list(range(3 * SPARSE.chain, 0, -1))):
            base, by_sha = hashlib.sha256(b"the bottom").digest(), {}
            for depth in reversed(depths):
                delta = forged_delta(base, min(depth, 255))
                base = hashlib.sha256(delta).digest()
                by_sha[base] = delta
            tip = by_sha.pop(base)
            hostile = Hostile(a, tip, by_sha)
            fetcher.held.pop(1, None)
            fetcher.unresolved.clear()
            with trio.fail_after(TIMEOUT_S):
                await fetcher.sync_once([a.peer_id], lambda h: True)
            assert hostile.gets <= SPARSE.chain  # the tip, then at most CHAIN − 1 back
            held = fetcher.held.get(1)
            if held is not None:  # kept as it came, for decoding to refuse (and its signer to pay)
                with pytest.raises(ValueError):
                    SPARSE.decode_chain(held.versions(), NUMEL)


@pytest.mark.parametrize("compression", ["none", "sparseloco"])
async def test_an_owner_that_skips_rounds_publishes_again_as_of_the_last_skipped_and_does_not_lapse(
    compression: str,
) -> None:
    """A SPES node behind its peers skips to their round (as NoLoCo's do). By the lease rule an
    owner whose round is ``lapse_rounds`` past its newest version has lapsed, so the experts
    it published at the round before the skip go again, as of the last round skipped."""
    from types import SimpleNamespace

    from node.algorithms.spes import Spes
    from node.algorithms.spes.leases import Progress, lapsed

    versions = expert_versions(compression)
    spes = Spes.__new__(Spes)  # its publishing alone: a store, the experts block, our identity
    spes.versions, spes.expert_numel = versions, NUMEL
    spes.store = ExpertStore(None, RUN)  # type: ignore[arg-type]  # publishing needs no host
    spes.store.configure(2, *versions.sizes(NUMEL), link=lambda w: versions.link(w, NUMEL), max_chain=versions.chain)
    rng = np.random.default_rng(1)
    block = bytearray((rng.standard_normal(2 * NUMEL) * 0.02).astype("<f4").tobytes())
    spes._block = SimpleNamespace(buf=memoryview(block))
    peer_id = keys.peer_id_of(SEED_A)
    spes.ctx = SimpleNamespace(identity_seed=SEED_A, host=SimpleNamespace(peer_id=peer_id))  # type: ignore[assignment]
    spes._chains, spes._worker_rounds = {}, [-1, -1]
    spes.owned = spes._published = [0, 1]
    await spes._publish(spes._published, 3)  # round 3's versions, as exchange publishes them
    spes.store.round = 4
    spes.owned = [1]  # expert 0 handed over at this boundary: not ours to publish again
    await spes._skipped(3, 2)  # the worker left out rounds 4 and 5: our next is 6
    assert spes.store.round == 6
    assert spes.store.held[1].head.round == 5 and spes.store.held[0].head.round == 3
    if versions.chain > 1:  # the chain goes on: a delta after round 3's keyframe
        assert len(spes.store.held[1].versions()) == 2
    now = 100.0
    seen = Progress(newest=dict(spes.store.newest_by_owner), reported={peer_id: 6}, answered={peer_id: (10, now)})
    assert not lapsed(peer_id, 0, seen, our_round=10, lapse_rounds=2, now=now)
    # Without the versions as of round 5, the rule would take its experts.
    before = Progress(newest={peer_id: 3}, reported={peer_id: 6}, answered={peer_id: (10, now)})
    assert lapsed(peer_id, 0, before, our_round=10, lapse_rounds=2, now=now)


@asynccontextmanager
async def beside_a_hung_peer(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[tuple[Host, Host, ExpertStore]]:
    """(a, c, b's store): a owns expert 1's version, c never answers an ask (its cable was
    pulled: the ask hangs until HEADER_TIMEOUT_S, as long as an owner may stay silent
    before it lapses, leases.SILENT_S); b's store syncs from both until the block ends."""
    monkeypatch.setattr(experts, "HEADER_TIMEOUT_S", 3600.0)  # the hung ask outlives the test
    released = trio.Event()
    async with (
        two_hosts() as (a, b),
        open_host(identity_seed=b"\x0c" * 32, listen_addrs=["/ip4/127.0.0.1/tcp/0"], announce_addrs=[]) as c,
    ):
        await b.connect(parse_dial_addr(c.addrs()[0]), timeout_s=10)
        owner, fetcher = stores(a, b)
        owner.publish(SEED_A, 1, 3, bytes([7]) * NBYTES)
        for protocol_id in (experts.PROTOCOL_ID, experts.HEADS_PROTOCOL_ID):
            c.set_handler(protocol_id, lambda stream: released.wait(), deadline_s=3600.0)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(fetcher.sync_forever, lambda: [c.peer_id, a.peer_id], lambda h: True)
            yield a, c, fetcher
            assert c.peer_id not in fetcher.answered  # its ask hung all along
            released.set()
            nursery.cancel_scope.cancel()


async def test_a_peer_whose_asks_hang_keeps_nobody_else_from_being_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """Were the asks of a look waited for together, every other owner's last answer would
    be HEADER_TIMEOUT_S old at each look, and they would lapse by turns."""
    asked = 0
    three = trio.Event()
    async with beside_a_hung_peer(monkeypatch) as (a, _, fetcher):
        take_heads = fetcher.take_heads

        def counted(peer_id: str, reply: dict[str, object]) -> tuple[int, list[Head]]:
            nonlocal asked
            answer = take_heads(peer_id, reply)
            asked += peer_id == a.peer_id
            if asked >= 3:
                three.set()
            return answer

        fetcher.take_heads = counted  # type: ignore[method-assign]
        with trio.fail_after(TIMEOUT_S):
            await three.wait()


async def test_a_version_an_answer_lists_is_fetched_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not at the next look (a second reader measured each fetch starting SYNC_INTERVAL_S
    later when answers waited for it), nor after the hung peer's ask."""
    monkeypatch.setattr(experts, "SYNC_INTERVAL_S", 3600.0)  # one look: what it starts must do
    async with beside_a_hung_peer(monkeypatch) as (a, _, fetcher):
        with trio.fail_after(TIMEOUT_S):
            while 1 not in fetcher.held:
                await fetcher.changed.wait()
        assert fetcher.held[1].head.owner == a.peer_id
