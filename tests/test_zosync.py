"""Pulling the ZO log between real hosts on loopback, and refusing a lying holder."""

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

import msgpack
import pytest
import trio

from node.algorithms.zo import zolog, zosync
from protocol import wire
from protocol.errors import BadMessage
from protocol.net.host import Host, Stream, open_host, parse_dial_addr
from protocol.net.peers import PeerTable

pytestmark = pytest.mark.integration
RUN = "zo-run-abcdef"
SEEDS = [bytes([i + 1]) * 32 for i in range(3)]
MEMBERS = {zolog.peer_id_of(s) for s in SEEDS}


@asynccontextmanager
async def hosts(count: int) -> AsyncIterator[list[tuple[Host, zosync.ZoLogSync]]]:
    async with AsyncExitStack() as stack:
        out = []
        for seed in SEEDS[:count]:
            peers = PeerTable(ttl_s=60)
            host = await stack.enter_async_context(
                open_host(identity_seed=seed, listen_addrs=["/ip4/127.0.0.1/tcp/0"], announce_addrs=[], peers=peers)
            )
            sync = zosync.ZoLogSync(host, zolog.UpdateLog(RUN, is_member=MEMBERS.__contains__), current_round=lambda: 0)
            sync.register()
            out.append((host, sync))
        for i, (host, _) in enumerate(out):
            for other, _ in out[i + 1 :]:
                await host.connect(parse_dial_addr(other.addrs()[0]), timeout_s=5)
        yield out


async def test_a_pull_brings_every_signed_batch_beyond_our_vector() -> None:
    async with hosts(3) as [(_, a), (_, b), (_, c)]:
        for seed, first, rounds in [(SEEDS[0], 0, [1, 2]), (SEEDS[0], 2, [3]), (SEEDS[1], 0, [1, 2, 3])]:
            await a.add(zolog.sign_batch(seed, RUN, first, rounds, bytes(len(rounds))))
        await c.add(zolog.sign_batch(SEEDS[0], RUN, 0, [1, 2], b"\x00\x00"))  # c already has some
        with trio.fail_after(30):
            assert await c.pull(a._host.peer_id) == 4
            assert await c.pull(a._host.peer_id) == 0  # nothing new the second time
            assert await b.pull(c._host.peer_id) == 6  # b had none: all of them, through c
        assert (
            b.log.vector()
            == c.log.vector()
            == a.log.vector()
            == {zolog.peer_id_of(SEEDS[0]): 3, zolog.peer_id_of(SEEDS[1]): 3}
        )
        assert list(c.log.ordered(below_round=10)) == list(a.log.ordered(below_round=10))


async def test_a_holder_serving_a_forged_batch_is_refused_and_penalized() -> None:
    async with hosts(2) as [(liar_host, _), (_, puller)]:
        genuine = zolog.sign_batch(SEEDS[0], RUN, 0, [1], b"\x05")
        forged = msgpack.unpackb(genuine.encode(), raw=False)
        forged["g"] = b"\x7f"  # the author never signed this g

        async def lie(stream: Stream) -> None:
            await wire.receive(stream, msg_types=frozenset({"want"}), version=zosync.VERSION, max_nbytes=1 << 20)
            await wire.send(stream, "batches", zosync.VERSION, {"batches": [msgpack.packb(forged)], "more": False})

        liar_host.set_handler(zosync.PROTOCOL_ID, lie)
        with trio.fail_after(30), pytest.raises(BadMessage, match="signature"):
            await puller.pull(liar_host.peer_id)
        assert puller.log.vector() == {}
        assert puller._host.peers.penalty(liar_host.peer_id) > 0


async def test_equivocation_is_evidence_the_author_is_excluded_everywhere_and_nobody_else_blamed() -> None:
    async with hosts(3) as [(_, a), (_, b), (relay_host, relay)]:
        one = zolog.sign_batch(SEEDS[2], RUN, 0, [1], b"\x01")
        two = zolog.sign_batch(SEEDS[2], RUN, 0, [1], b"\x02")  # the same seq, another g
        await a.add(one)
        await relay.add(two)
        with trio.fail_after(30):
            await a.pull(relay_host.peer_id)  # a holds one, is served two: an equivocation
        author = zolog.peer_id_of(SEEDS[2])
        assert author in a.log.excluded and a.log.vector() == {}, a.log.vector()
        assert a._host.peers.is_banned(author) and a._host.peers.penalty(relay_host.peer_id) == 0
        with trio.fail_after(30):
            await b.pull(a._host.peer_id)  # b learns the evidence from a's pull answer
        assert author in b.log.excluded and b._host.peers.is_banned(author)


async def ask(host: Host, holder: Host, have: dict[str, int], hashes: dict[str, bytes]) -> dict[str, object]:
    stream = await host.open_stream(holder.peer_id, zosync.PROTOCOL_ID, timeout_s=10)
    await wire.send(stream, "want", zosync.VERSION, {"run": RUN, "have": have, "hashes": hashes})
    reply = await wire.receive(stream, msg_types=frozenset({"batches"}), version=zosync.VERSION, max_nbytes=1 << 24)
    await stream.close()
    return reply


async def test_a_holder_sends_the_oldest_rounds_first_and_nothing_of_an_author_it_holds_less_of(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    author_a, author_b = zolog.peer_id_of(SEEDS[0]), zolog.peer_id_of(SEEDS[1])
    async with hosts(2) as [(holder_host, holder), (asker_host, asker)]:
        for seed, first, round_index in [(SEEDS[0], 0, 1), (SEEDS[0], 1, 2), (SEEDS[0], 2, 3), (SEEDS[1], 0, 1)]:
            await holder.add(zolog.sign_batch(seed, RUN, first, [round_index], b"\x01"))
        await holder.add(zolog.sign_batch(SEEDS[1], RUN, 1, [2], b"\x01"))
        monkeypatch.setattr(zosync, "MAX_BATCHES", 2)
        with trio.fail_after(30):
            reply = await ask(asker_host, holder_host, {}, {})
        firsts = [zolog.decode_batch(raw, RUN) for raw in reply["batches"]]  # type: ignore[union-attr]
        # Round 1 of both authors, not author A's rounds 1 and 2: a puller whose window
        # reaches round 1 only would otherwise be sent nothing it can take, again and again.
        assert [(b.peer_id, b.rounds[0]) for b in firsts] == sorted([(author_a, 1), (author_b, 1)], key=lambda x: x[0])
        assert reply["more"] is True
        monkeypatch.setattr(zosync, "MAX_BATCHES", 512)
        # The asker holds more of author A (5 entries) than the holder (3): nothing of A comes
        # back (before, the holder saw "another hash" and sent A's whole chain, all of it old).
        for first in range(5):
            await asker.add(zolog.sign_batch(SEEDS[0], RUN, first, [first + 1], b"\x01"))
        have = asker.log.vector()
        hashes = {peer: asker.log.chain_hash(peer) for peer in have}
        with trio.fail_after(30):
            reply = await ask(asker_host, holder_host, have, hashes)
        sent = [zolog.decode_batch(raw, RUN) for raw in reply["batches"]]  # type: ignore[union-attr]
        assert {b.peer_id for b in sent} == {author_b} and reply["more"] is False
