"""Expert versions between real libp2p hosts on loopback: signed heads, hashed bytes, bounded
sizes, and what a hostile holder can and cannot make us take."""

import hashlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio

from node.algorithms.spes import experts
from node.algorithms.spes.experts import ExpertStore, Head, parse_head, sign_head
from protocol import keys, wire
from protocol.errors import BadMessage, ProtocolError
from protocol.net.host import Host, Stream, open_host, parse_dial_addr

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
