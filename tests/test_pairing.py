"""Pairing without a barrier, between real hosts on loopback."""

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

import pytest
import trio

from protocol.exchange import TensorReceiver
from protocol.host import Host, open_host, parse_dial_addr
from protocol.pairing import Pairing

pytestmark = pytest.mark.integration
NBYTES = 4096


@asynccontextmanager
async def nodes(count: int) -> AsyncIterator[list[tuple[Host, Pairing]]]:
    async with AsyncExitStack() as stack:
        nursery = await stack.enter_async_context(trio.open_nursery())
        out: list[tuple[Host, Pairing]] = []
        for i in range(count):
            host = await stack.enter_async_context(
                open_host(identity_seed=bytes([i + 1]) * 32, listen_addrs=["/ip4/127.0.0.1/tcp/0"], announce_addrs=[])
            )
            pairing = Pairing(host, send_timeout_s=10, is_member=lambda _: True)
            await nursery.start(pairing.run)
            TensorReceiver(
                host, pairing.accept_payload, authorize=pairing.authorize, max_payload_nbytes=1 << 20, timeout_s=10
            ).register()
            out.append((host, pairing))
        for i, (host, _) in enumerate(out):
            for other, _ in out[i + 1 :]:
                await host.connect(parse_dial_addr(other.addrs()[0]), timeout_s=5)
        yield out
        nursery.cancel_scope.cancel()


async def run_round(group: list[tuple[Host, Pairing]], *, timeout_s: float) -> list[tuple[str | None, bytes]]:
    results: list[tuple[str | None, bytes]] = [(None, b"")] * len(group)

    async def one(i: int) -> None:
        host, pairing = group[i]
        outbox, inbox = memoryview(bytearray([i + 1]) * NBYTES), memoryview(bytearray(NBYTES))
        others = [h.peer_id for h, _ in group if h is not host]
        partner = await pairing.find_partner(0, outbox, inbox, others, timeout_s=timeout_s)
        results[i] = (partner, bytes(inbox))

    async with trio.open_nursery() as nursery:
        for i in range(len(group)):
            nursery.start_soon(one, i)
    return results


@pytest.mark.parametrize("count", [2, 4])
async def test_everyone_pairs_mutually_and_gets_the_partners_payload(count: int) -> None:
    async with nodes(count) as group:
        results = await run_round(group, timeout_s=20)
        ids = [h.peer_id for h, _ in group]
        for i, (partner, inbox) in enumerate(results):
            assert partner is not None
            j = ids.index(partner)
            assert results[j][0] == ids[i]  # mutual
            assert inbox == bytes([j + 1]) * NBYTES  # the partner's payload, whole
        assert all(p.bytes_sent == NBYTES and p.bytes_received == NBYTES for _, p in group)


async def test_the_odd_one_out_goes_on_alone_without_waiting_out_the_bound() -> None:
    async with nodes(3) as group:
        # Once the other two have paired, they answer "never": the odd one stops asking
        # instead of waiting out its 600 s bound (this guard fails if it waited it out).
        with trio.fail_after(60):
            results = await run_round(group, timeout_s=600)
        alone = [r for r in results if r[0] is None]
        assert len(alone) == 1 and alone[0][1] == bytes(NBYTES)  # inbox untouched


async def test_a_peer_that_is_not_at_the_boundary_is_not_waited_for() -> None:
    async with nodes(2) as group:
        (_, pairing), (other, _) = group
        outbox, inbox = memoryview(bytearray(NBYTES)), memoryview(bytearray(NBYTES))
        assert await pairing.find_partner(0, outbox, inbox, [other.peer_id], timeout_s=1) is None


async def test_a_payload_that_beats_its_accept_is_kept() -> None:
    # The asked peer replies "accept" and starts sending at once; its payload can reach us
    # before we have read the "accept". It must not be dropped as "not our partner".
    from protocol.exchange import Payload, TensorSpec
    from protocol.pairing import PAYLOAD_NAME, _Round

    pairing = Pairing(None, send_timeout_s=1, is_member=lambda _: True)  # type: ignore[arg-type]  # the host is not used here
    inbox = memoryview(bytearray(NBYTES))
    pairing._round = _Round(0, memoryview(bytearray(NBYTES)), inbox, asking="asked-peer")
    data = bytes([7]) * NBYTES
    await pairing.accept_payload("asked-peer", Payload(0, (TensorSpec(PAYLOAD_NAME, "uint8", (NBYTES,)),), data))
    assert pairing._round.early == data and not pairing._round.received
    await pairing.accept_payload("someone-else", Payload(0, (TensorSpec(PAYLOAD_NAME, "uint8", (NBYTES,)),), data))
    assert bytes(inbox) == bytes(NBYTES)  # a stranger's payload is not taken
