"""Pairing without a barrier, between real hosts on loopback."""

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

import pytest
import trio
import trio.testing

from node.algorithms.noloco.lag import (
    CATCH_UP_FROM,
    LEAD_MEMORY_ROUNDS,
    MAX_LAG,
    PULL_AHEAD_ROUNDS,
    catch_up_steps,
    lead_of,
    rounds_to_skip,
    skip_horizon,
)
from node.algorithms.noloco.pairing import (
    BAD_SINCE_POINTS,
    PAST_THE_RUN_POINTS,
    SINCE_SHARE_MAX,
    Pairing,
    _Round,
    compute_sample,
    next_boundary,
    scheduled_partner,
)
from protocol.net.exchange import TensorReceiver
from protocol.net.host import Host, open_host, parse_dial_addr

pytestmark = pytest.mark.integration
NBYTES = 4096
START_AFTER_BOUND_S = 15.0
"""How long a node of ``run_round`` waits for its ``start_after`` events (a scenario that
went otherwise fails saying so, not at the test's own bound)."""


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


async def run_round(
    group: list[tuple[Host, Pairing]],
    *,
    timeout_s: float,
    present: list[int] | None = None,
    start_after: dict[int, list[trio.Event]] | None = None,
) -> list[tuple[str | None, bytes]]:
    """Round 0 at the nodes of ``present`` (all by default; every other node is a candidate
    all the same), node i reaching its boundary once the events ``start_after[i]`` are set
    (what the scenario needs the others to have done first)."""
    results: list[tuple[str | None, bytes]] = [(None, b"")] * len(group)

    async def one(i: int) -> None:
        host, pairing = group[i]
        with trio.move_on_after(START_AFTER_BOUND_S) as waited:
            for event in (start_after or {}).get(i, []):
                await event.wait()
        assert not waited.cancelled_caught, f"node {i}: what the scenario waits for before its start never happened"
        outbox, inbox = memoryview(bytearray([i + 1]) * NBYTES), memoryview(bytearray(NBYTES))
        others = [h.peer_id for h, _ in group if h is not host]
        partner = await pairing.find_partner(0, outbox, inbox, others, timeout_s=timeout_s)
        results[i] = (partner, bytes(inbox))

    async with trio.open_nursery() as nursery:
        for i in range(len(group)) if present is None else present:
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


async def test_the_odd_one_out_pulls_a_paired_peers_payload_without_waiting_out_the_bound() -> None:
    async with nodes(3) as group:
        # The other two pair and answer "never" to pairing: the odd one pulls one of their
        # payloads at once instead of going alone or waiting out its 600 s bound.
        with trio.fail_after(60):
            results = await run_round(group, timeout_s=600)
        ids = [h.peer_id for h, _ in group]
        pairings = [p for _, p in group]
        puller = next(i for i, p in enumerate(pairings) if p.last_pulled)
        source = ids.index(results[puller][0])  # type: ignore[arg-type]
        assert results[puller][1] == bytes([source + 1]) * NBYTES  # the pulled peer's payload, whole
        assert results[source][0] not in (None, ids[puller])  # the pulled one kept its own partner
        for p in pairings:  # the pulled one's send ends after the puller has every byte
            await p.close_pulls()
        assert [p.pulls_served for p in pairings] == [int(i == source) for i in range(3)]
        assert pairings[puller].bytes_sent == 0  # a pull is one way
        assert pairings[source].bytes_sent == 2 * NBYTES


async def test_a_node_a_round_late_pulls_until_its_peers_outbox_is_overwritten() -> None:
    async with nodes(3) as group:
        (a, pa), (b, pb), (_, pc) = group
        box = {i: (memoryview(bytearray([i + 1]) * NBYTES), memoryview(bytearray(NBYTES))) for i in range(3)}
        async with trio.open_nursery() as nursery:  # a and b pair for round 0 and move on
            nursery.start_soon(lambda: pa.find_partner(0, *box[0], [b.peer_id], timeout_s=20))
            nursery.start_soon(lambda: pb.find_partner(0, *box[1], [a.peer_id], timeout_s=20))
        with trio.fail_after(60):
            # c reaches round 0 late: a and b are past it, but their outboxes still hold it.
            pulled = await pc.find_partner(0, *box[2], [a.peer_id, b.peer_id], timeout_s=600)
            assert pulled in (a.peer_id, b.peer_id)
            assert pc.last_pulled and bytes(box[2][1]) in (bytes([1]) * NBYTES, bytes([2]) * NBYTES)
            # Once per peer per round: asked again, the pulled one says no.
            assert await pc.find_partner(0, *box[2], [pulled], timeout_s=600) is None
            # Their workers need the outboxes back: round 0 can no longer be pulled.
            await pa.close_pulls()
            await pb.close_pulls()
            assert await pc.find_partner(0, *box[2], [a.peer_id, b.peer_id], timeout_s=600) is None
            assert not pc.last_pulled


async def test_a_puller_that_never_reads_holds_the_outbox_for_the_grace_only(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A slow or hostile puller cannot keep our worker from its next round: the pull is cut
    once the grace for the payload's size has passed."""
    from node.algorithms.noloco import pairing as pairing_module

    async def never_ends(*args: object, **kwargs: object) -> None:
        await trio.sleep_forever()

    class Asked:
        peer_id = "puller"
        written = b""

        async def write(self, data: bytes) -> None:
            self.written += data

    monkeypatch.setattr(pairing_module, "send_tensors", never_ends)
    pairing = Pairing(None, send_timeout_s=600, is_member=lambda _: True)  # type: ignore[arg-type]  # not used here
    async with trio.open_nursery() as nursery:
        pairing._nursery = nursery
        pairing._pulls = pairing_module._Pulls(0, memoryview(bytearray(NBYTES)))
        asked = Asked()
        await pairing._answer_pull(asked, 0, NBYTES)  # type: ignore[arg-type]
        assert b"accept" in asked.written
        started = trio.current_time()
        with trio.fail_after(2 * pairing_module.pull_grace_s(NBYTES)):  # virtual time: instant
            await pairing.close_pulls()
        assert trio.current_time() - started == pytest.approx(pairing_module.pull_grace_s(NBYTES))
        assert pairing._pulls is None and pairing.pulls_served == 0


async def test_a_peer_that_is_not_at_the_boundary_is_not_waited_for() -> None:
    async with nodes(2) as group:
        (_, pairing), (other, _) = group
        outbox, inbox = memoryview(bytearray(NBYTES)), memoryview(bytearray(NBYTES))
        assert await pairing.find_partner(0, outbox, inbox, [other.peer_id], timeout_s=1) is None


async def test_a_payload_that_beats_its_accept_is_kept() -> None:
    # The asked peer replies "accept" and starts sending at once; its payload can reach us
    # before we have read the "accept". It must not be dropped as "not our partner".
    from node.algorithms.noloco.pairing import PAYLOAD_NAME, _Round
    from protocol.net.exchange import Payload, TensorSpec

    pairing = Pairing(None, send_timeout_s=1, is_member=lambda _: True)  # type: ignore[arg-type]  # the host is not used here
    inbox = memoryview(bytearray(NBYTES))
    pairing._round = _Round(0, memoryview(bytearray(NBYTES)), inbox, asking="asked-peer")
    data = bytes([7]) * NBYTES
    await pairing.accept_payload("asked-peer", Payload(0, (TensorSpec(PAYLOAD_NAME, "uint8", (NBYTES,)),), data))
    assert pairing._round.early == data and not pairing._round.received
    await pairing.accept_payload("someone-else", Payload(0, (TensorSpec(PAYLOAD_NAME, "uint8", (NBYTES,)),), data))
    assert bytes(inbox) == bytes(NBYTES)  # a stranger's payload is not taken


async def test_a_pull_accepted_while_the_outbox_is_being_freed_is_waited_for(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker's outbox_free comes while our "accept" to a puller is still being written:
    that pull's send must end before the worker may overwrite the outbox."""
    from node.algorithms.noloco import pairing as pairing_module

    events: list[object] = []

    async def records(host: object, peer_id: str, payload: object, **kwargs: object) -> None:
        events.append(("sent", bytes(payload.data[:1])))  # type: ignore[attr-defined]

    class SlowAsked:
        peer_id = "puller"
        release = trio.Event()

        async def write(self, data: bytes) -> None:
            await self.release.wait()

    async def close(pairing: Pairing) -> None:
        await pairing.close_pulls()
        events.append("closed")

    monkeypatch.setattr(pairing_module, "send_tensors", records)
    pairing = Pairing(None, send_timeout_s=600, is_member=lambda _: True)  # type: ignore[arg-type]  # not used here
    asked = SlowAsked()
    async with trio.open_nursery() as nursery:
        pairing._nursery = nursery
        pairing._pulls = pairing_module._Pulls(0, memoryview(bytearray(b"\x01" * NBYTES)))
        nursery.start_soon(pairing._answer_pull, asked, 0, NBYTES)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(close, pairing)
        await trio.testing.wait_all_tasks_blocked()
        assert events == []  # still writing the accept: the outbox is not free yet
        asked.release.set()
    assert events == [("sent", b"\x01"), "closed"]


def test_the_backoff_after_a_busy_asker_grows_with_how_long_questions_take() -> None:
    """On an idle machine the pause stays a sweep's; when a question takes seconds, a node
    backs off ~3 questions on average, so it asks about a quarter of its time at a boundary
    and a peer it asks is rarely itself asking (the livelock the soak showed)."""
    from node.algorithms.noloco.pairing import BACKOFF_TIMES_ASK, RETRY_PAUSE_S, backoff_s

    assert backoff_s(0.005, 0.0) == RETRY_PAUSE_S[0] and backoff_s(0.005, 1.0) == RETRY_PAUSE_S[1]
    ask_s = 2.0
    mean = (backoff_s(ask_s, 0.0) + backoff_s(ask_s, 1.0)) / 2  # linear in the draw
    assert mean >= BACKOFF_TIMES_ASK / 2 * ask_s
    assert ask_s / (ask_s + mean) <= 0.25


async def test_a_peer_still_computing_does_not_keep_us_from_pulling_before_the_bound_ends() -> None:
    """d never reaches the round ("later": computing), so c would ask it until its bound ran
    out and go alone; the end of the bound is kept for a pull from a peer past the round."""
    async with nodes(4) as group:
        (a, pa), (b, pb), (_, pc), (d, _) = group
        box = {i: (memoryview(bytearray([i + 1]) * NBYTES), memoryview(bytearray(NBYTES))) for i in range(3)}
        async with trio.open_nursery() as nursery:  # a and b pair for round 0 and move on
            nursery.start_soon(lambda: pa.find_partner(0, *box[0], [b.peer_id], timeout_s=20))
            nursery.start_soon(lambda: pb.find_partner(0, *box[1], [a.peer_id], timeout_s=20))
        with trio.fail_after(60):
            pulled = await pc.find_partner(0, *box[2], [a.peer_id, b.peer_id, d.peer_id], timeout_s=8)
        assert pulled in (a.peer_id, b.peer_id) and pc.last_pulled


async def test_a_node_every_peer_told_never_pulls_without_pausing(autojump_clock: trio.testing.MockClock) -> None:
    """A node behind its peers hears "never" from each and goes on to its pull at once: no
    sweep's pause (RETRY_PAUSE_S) after the last "never". With the pause, a micro-round late
    joiner beside a lockstep pair lost 50-300 ms a round, about as much as its shortened
    round saved, stayed 1-2 rounds behind and fell past a pull's reach under load. On the
    in-memory network without latency every question takes no virtual time, so any
    pause is the whole of the elapsed time."""
    from node.algorithms.noloco.pairing import RETRY_PAUSE_S
    from protocol.net.memnet import FakeNetwork, Faults

    net = FakeNetwork(1, Faults())
    async with net.running():
        group = []
        for i in range(3):
            host = net.add_host(bytes([i + 1]) * 32)
            pairing = Pairing(host, send_timeout_s=10, is_member=lambda _: True)
            await net.nursery.start(pairing.run)
            TensorReceiver(
                host, pairing.accept_payload, authorize=pairing.authorize, max_payload_nbytes=1 << 20, timeout_s=10
            ).register()
            group.append((host, pairing))
        (a, pa), (b, pb), (_, pc) = group
        box = {i: (memoryview(bytearray([i + 1]) * NBYTES), memoryview(bytearray(NBYTES))) for i in range(3)}
        async with trio.open_nursery() as nursery:  # a and b pair for round 0 and move on
            nursery.start_soon(lambda: pa.find_partner(0, *box[0], [b.peer_id], timeout_s=20))
            nursery.start_soon(lambda: pb.find_partner(0, *box[1], [a.peer_id], timeout_s=20))
        started = trio.current_time()
        pulled = await pc.find_partner(0, *box[2], [a.peer_id, b.peer_id], timeout_s=20)
        assert pulled in (a.peer_id, b.peer_id) and pc.last_pulled
        assert trio.current_time() - started < RETRY_PAUSE_S[0]


class _LoadedHost:
    """Only what ``Pairing._pair`` asks of a host: every peer may take tensors."""

    def tensor_refusal(self, peer_id: str) -> str | None:
        return None


async def test_a_question_that_outlasts_the_sweep_ends_the_sweep_instead_of_crashing(
    monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.testing.MockClock
) -> None:
    """Seen in the 16-node soak: a peer answered "asking" after the sweep's end had
    passed (the machine was loaded); the backoff's pause came out negative, trio refused
    it with a ValueError and the daemon died (3 of 16)."""
    pairing = Pairing(_LoadedHost(), send_timeout_s=10, is_member=lambda _: True)  # type: ignore[arg-type]
    sweep_until = trio.current_time() + 1.0
    asked = []

    async def slow_ask(peer_id: str, current: object, *, question: str = "pair?") -> str:
        asked.append(peer_id)
        await trio.sleep(2.0)  # past the sweep's end (virtual time)
        return "asking"

    monkeypatch.setattr(pairing, "_ask", slow_ask)
    current = pairing_round()
    await pairing._pair(current, ["a", "b"], sweep_until=sweep_until)
    assert current.partner is None and len(asked) == 1
    assert trio.current_time() >= sweep_until


def pairing_round() -> "_Round":
    return _Round(0, memoryview(bytearray(NBYTES)), memoryview(bytearray(NBYTES)))


async def test_a_node_a_round_behind_pulls_its_peers_next_round() -> None:
    """A node whose worker started a moment late reaches each boundary after its peers moved
    on: their outboxes hold a later round's payload, which it may pull (up to two rounds
    ahead, never more), so it does not train alone and fall further behind."""
    async with nodes(3) as group:
        (a, pa), (b, pb), (_, pc) = group
        box = {i: (memoryview(bytearray([i + 1]) * NBYTES), memoryview(bytearray(NBYTES))) for i in range(3)}
        for round_index in (0, 1, 2, 3):  # a and b pair for rounds 0 to 3; their outboxes hold round 3
            async with trio.open_nursery() as nursery:
                nursery.start_soon(lambda r=round_index: pa.find_partner(r, *box[0], [b.peer_id], timeout_s=20))
                nursery.start_soon(lambda r=round_index: pb.find_partner(r, *box[1], [a.peer_id], timeout_s=20))
        with trio.fail_after(60):
            # Three rounds behind is too far: nothing to pull, alone at once.
            assert await pc.find_partner(0, *box[2], [a.peer_id, b.peer_id], timeout_s=600) is None
            assert bytes(box[2][1]) == bytes(NBYTES)
            pulled = await pc.find_partner(1, *box[2], [a.peer_id, b.peer_id], timeout_s=600)
            assert pulled in (a.peer_id, b.peer_id)
            assert pc.last_pulled and bytes(box[2][1]) in (bytes([1]) * NBYTES, bytes([2]) * NBYTES)


def test_a_node_behind_its_peers_shortens_its_next_round_by_their_lead() -> None:
    """H / (1 + lead) steps (at least 1, lead at most MAX_LAG; under CATCH_UP_FROM of a
    round, none), the lead the second-highest its peers told it (one peer claiming a far
    round cannot shorten our rounds)."""
    assert [catch_up_steps(10, lead) for lead in (-1, 0, 1, 2, 3, 50)] == [10, 10, 5, 4, 3, 3]
    assert catch_up_steps(1, 3) == 1
    assert catch_up_steps(10, CATCH_UP_FROM - 0.01) == 10  # the one ahead waits for us (its window)
    assert catch_up_steps(10, 0.8) == 6  # 10 / 1.8 rounded up
    assert lead_of([], peers=3) == 0
    assert lead_of([-1, 0], peers=3) == 0
    assert lead_of([2], peers=1) == 2  # our only peer: its word
    assert lead_of([2], peers=3) == 0  # one of three: not enough
    assert lead_of([1e12, 1, 0], peers=3) == 1  # a liar ahead alone moves nothing
    assert lead_of([1e12, 0], peers=3) == 0  # the other accepted us: at our round
    assert lead_of([1e12, 1e12], peers=3) == MAX_LAG


def test_a_node_further_behind_than_a_pull_reaches_skips_to_its_peers_round() -> None:
    """Within a pull's reach it keeps every round (and shortens them); past it, it skips
    to its peers' round (at most MAX_LAG at a time: the lag is capped)."""
    assert [rounds_to_skip(lag) for lag in range(PULL_AHEAD_ROUNDS + 1)] == [0] * (PULL_AHEAD_ROUNDS + 1)
    assert rounds_to_skip(PULL_AHEAD_ROUNDS + 1) == PULL_AHEAD_ROUNDS + 1
    assert rounds_to_skip(int(lead_of([1e12, 1e12], peers=3))) == MAX_LAG
    assert rounds_to_skip(int(lead_of([1e12, 0], peers=3))) == 0  # one liar skips nothing
    assert rounds_to_skip(int(lead_of([1e12], peers=2))) == 0  # nor as our only peer (vouched_lag)
    # At most a third of the run's rounds in all: liars cost a node at most that.
    assert [rounds_to_skip(MAX_LAG, skipped=k, rounds=30) for k in (0, 7, 9, 10, 12)] == [3, 3, 1, 0, 0]
    # A run until its nodes stop: a third of its rounds so far, where the skip lands.
    assert skip_horizon(30, 5, MAX_LAG) == 30 and skip_horizon(0, 5, MAX_LAG) == 6 + MAX_LAG
    assert rounds_to_skip(MAX_LAG, skipped=10**6, rounds=skip_horizon(0, 10**6, MAX_LAG)) == 0
    round_index, skipped = 0, 0
    while round_index < 3000:  # two members vouching for a far round at every round
        skip = rounds_to_skip(MAX_LAG, skipped=skipped, rounds=skip_horizon(0, round_index, MAX_LAG))
        skipped, round_index = skipped + skip, round_index + 1 + skip
        assert skipped <= (round_index + MAX_LAG) // 3
    assert skipped >= (round_index - 1) // 3 - MAX_LAG  # and no fewer: honest laggards still catch up


async def test_peers_that_reached_our_round_long_before_us_say_so_and_we_catch_up() -> None:
    """Busy answers say how long ago the answerer reached its round ("since"): two peers
    past our round by 8 s of our 10 s of computing a round put us 0.8 of a round behind
    (less the answer's travel), so our next round is shortened; by 3 s, not (their
    pairing window would have waited for us). Without "since" two pairs a fraction of a
    round apart never met again (lag.py ``CATCH_UP_FROM``)."""
    async with nodes(3) as group:
        (_, pa), (b, pb), (c, pc) = group
        box = (memoryview(bytearray(NBYTES)), memoryview(bytearray(NBYTES)))
        for ahead_s, shortened in ((8.0, True), (3.0, False)):
            pa._compute_s, pa._last_round, pa._boundary_at, pa._paired_at = 10.0, 0, None, None
            for p in (pb, pc):
                p._last_round, p._boundary_at = 1, trio.current_time() - ahead_s
            with trio.fail_after(60):
                assert await pa.find_partner(1, *box, [b.peer_id, c.peer_id], timeout_s=600) is None
            # Measured at the answer, read at our end a travel time later: under ahead_s.
            assert ahead_s / 10.0 - 0.1 < pa.lead <= ahead_s / 10.0
            assert pa.lag == 0 and pa.vouched_lag == 0
            assert (catch_up_steps(10, pa.lead) < 10) is shortened
            pa.caught_up(1.0)


@pytest.mark.parametrize("since", [-1.0, float("nan"), float("inf"), "9", True, 2**63])
async def test_a_since_no_honest_node_sends_counts_for_nothing_and_costs_a_point(since: object) -> None:
    async with nodes(2) as group:
        (a, pa), (b, pb) = group
        box = (memoryview(bytearray(NBYTES)), memoryview(bytearray(NBYTES)))
        pa._compute_s = 10.0
        pb._last_round = 1
        pb._at = lambda: {"round": 1, "since": since}  # type: ignore[method-assign]
        with trio.fail_after(60):
            assert await pa.find_partner(1, *box, [b.peer_id], timeout_s=600) is None
        assert pa.lead == 0
        assert a.peers.penalty(b.peer_id) == 2 * BAD_SINCE_POINTS  # to "pair?", then to "pull?"


async def test_two_pairs_a_fraction_of_a_round_apart_come_back_together() -> None:
    """Four nodes with rounds of 0.8 s of computing (H = 10 steps, the worker waiting while
    they pair, as SPES's does); at round 2 two of them fall 0.6 s (0.75 of a round)
    behind. Before, nothing brought them back: the two ahead, asking their scheduled
    partner, heard "never, not near" (over half a round to go) and paired with each other,
    the two behind likewise, round after round (SPES beside a CPU hog: 11 rounds, shared
    weights drifting apart). Now the two behind hear how long before them the others
    reached their rounds, shorten rounds, and come within the window of the ones ahead."""
    compute_s, steps_per_round, rounds, behind = 0.8, 10, 10, {2, 3}
    async with nodes(4) as group:
        ids = [h.peer_id for h, _ in group]
        boundary_at: dict[tuple[int, int], float] = {}
        shortened = [0] * len(group)

        async def node(i: int) -> None:
            host, pairing = group[i]
            outbox, inbox = memoryview(bytearray([i + 1]) * NBYTES), memoryview(bytearray(NBYTES))
            others = [p for p in ids if p != host.peer_id]
            steps = steps_per_round
            for r in range(rounds):
                await trio.sleep(compute_s * steps / steps_per_round + (0.6 if r == 2 and i in behind else 0.0))
                boundary_at[i, r] = trio.current_time()
                await pairing.find_partner(r, outbox, inbox, others, timeout_s=20)
                steps = catch_up_steps(steps_per_round, pairing.lead)
                if steps < steps_per_round:
                    shortened[i] += 1
                    pairing.caught_up(steps / steps_per_round)

        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                for i in range(len(group)):
                    nursery.start_soon(node, i)

    def apart(r: int) -> float:
        """How far apart the two groups reached round r's boundary."""
        ahead = [t for (i, at), t in boundary_at.items() if at == r and i not in behind]
        late = [t for (i, at), t in boundary_at.items() if at == r and i in behind]
        return abs(sum(late) / len(late) - sum(ahead) / len(ahead))

    assert apart(2) > compute_s / 2  # they were apart
    assert sum(shortened[i] for i in behind) > 0, boundary_at
    # Back within half a round: the pairing window of the ones ahead reaches them.
    assert max(apart(r) for r in (rounds - 2, rounds - 1)) < compute_s / 2, boundary_at


def test_a_pair_behind_together_hears_the_pair_ahead_over_rounds() -> None:
    """Behind with our partner, each round we hear one peer of the pair ahead (the
    schedule's) and our partner, at our round: what peers told counts for
    LEAD_MEMORY_ROUNDS of our rounds, so two of them ahead move us within two rounds (in a
    round's answers alone the second-highest was always our partner's 0: a SPES pair fell 3
    rounds behind with no lag seen). Spent once we caught up on it; a stranger's "since"
    counts for at most SINCE_SHARE_MAX of a round."""
    pairing = Pairing.__new__(Pairing)
    pairing._leads = {}
    peers = ["a", "b", "d"]
    pairing._remember_leads(5, {"a": 1.9, "d": 0.0}, peers)
    assert pairing.lead == 0
    pairing._remember_leads(6, {"b": 1.9, "d": 0.0}, peers)
    assert pairing.lead == 1.9 and pairing.lag == 1 and pairing.vouched_lag == 1
    pairing.caught_up(0.5)
    pairing._remember_leads(7, {"a": 1.9, "d": 0.0}, peers)
    assert pairing.lead == 0
    pairing._remember_leads(7 + LEAD_MEMORY_ROUNDS, {"b": 1.9, "d": 0.0}, peers)
    assert pairing.lead == 0  # a's word of round 7 is too old
    # A peer gone (or banned) since it told us counts no more: not even as our only peer's word.
    pairing._remember_leads(20, {"liar": 3.0, "b": 0.9}, peers)
    pairing._remember_leads(21, {}, ["b"])
    assert pairing.lead == 0.9
    pairing._compute_s, pairing._boundary_at = 10.0, None
    assert pairing._since_share(9.0) == 0.0  # no boundary of ours to compare with


@pytest.mark.parametrize("since", ["9", True, None, -5.0, float("nan"), float("inf"), 1e300, 10**40])
async def test_a_strangers_since_counts_for_at_most_a_round(since: object) -> None:
    pairing = Pairing.__new__(Pairing)
    pairing._compute_s, pairing._boundary_at = 10.0, trio.current_time()
    share = pairing._since_share(since)
    big = type(since) is float and since > 0
    assert share == (SINCE_SHARE_MAX if big else 0.0)


@pytest.mark.parametrize(("short", "answer"), [(1.0, "never"), (0.5, "busy")])
async def test_a_node_in_a_shortened_round_expects_its_boundary_sooner(short: float, answer: str) -> None:
    """0.1 s into a round of 10 s of computing: not near (over half of it to go), but
    near when the round is shortened to half its steps; judged by whole rounds, a node
    catching up said "never" to the peer ahead it was catching up with."""
    async with nodes(2) as group:
        (_, pa), (b, pb) = group
        now = trio.current_time()
        pb._last_round, pb._boundary_at, pb._paired_at, pb._compute_s = 0, now - 0.1, now - 0.1, 10.0
        pb._short = short
        current = _Round(1, memoryview(bytearray(NBYTES)), memoryview(bytearray(NBYTES)))
        with trio.fail_after(30):
            assert await pa._ask(b.peer_id, current) == answer


async def test_a_peer_far_from_its_next_boundary_says_so_and_is_not_waited_for() -> None:
    """Asked for the round after its last boundary, a node answers "later" only when it
    expects that boundary within half its round time; else "never", so the asker
    goes on (a node at half speed among 4 kept the odd one of the others asking it for
    ~25 s a round). Every busy answer says the answerer's round: the asker learns its lag."""
    async with nodes(2) as group:
        (_, pa), (b, pb) = group
        box = (memoryview(bytearray(NBYTES)), memoryview(bytearray(NBYTES)))
        now = trio.current_time()
        pb._last_round, pb._boundary_at, pb._paired_at, pb._compute_s = 0, now, now, 3600.0  # an hour from round 1
        with trio.fail_after(60):  # without the answer, it asks until its bound: 600 s
            assert await pa.find_partner(1, *box, [b.peer_id], timeout_s=600) is None
        assert pa.lag == 0  # b is behind us, not ahead
        pb._last_round, pb._paired_at = 3, None  # b is at round 3 now: we are 2 behind
        with trio.fail_after(60):
            assert await pa.find_partner(1, *box, [b.peer_id], timeout_s=600) is None
        assert pa.lag == 2 and catch_up_steps(10, pa.lag) == 4
        pb._last_round = 5  # 4 ahead: past a pull's reach, but one peer's word skips nothing
        with trio.fail_after(60):
            assert await pa.find_partner(1, *box, [b.peer_id], timeout_s=600) is None
        assert pa.lag == MAX_LAG and pa.vouched_lag == 0


async def test_a_node_waiting_for_a_peers_state_says_never_and_is_not_waited_for() -> None:
    """A joiner (or a resync) fetches a peer's state after that peer's next boundary: asked
    meanwhile, it says "never", and the asker goes on. It said "later" (it had no rounds to
    judge by), and a lone trainer at its boundary asked it until its sweep ended while the
    joiner waited for that very boundary (~15 s in tests of 0.1 s rounds)."""
    async with nodes(2) as group:
        (_, pa), (b, pb) = group
        box = (memoryview(bytearray(NBYTES)), memoryview(bytearray(NBYTES)))
        pb.joining = True
        with trio.fail_after(60):  # without the answer, it asks until its bound: 600 s
            assert await pa.find_partner(3, *box, [b.peer_id], timeout_s=600) is None
        assert pa.lag == 0  # its round (none yet) is no lead
        pb.joining = False  # its worker started from the state: no rounds to judge by, so "later"
        with trio.move_on_after(2) as asked_on:
            await pa.find_partner(4, *box, [b.peer_id], timeout_s=600)
        assert asked_on.cancelled_caught


def test_a_rounds_computing_time_and_next_boundary_leave_out_waits_to_pair() -> None:
    """Rounds of 13 s of steps, half of them taken while pairing (overlap 0.5): a pairing
    within those steps hides in the round, a longer one pushes the boundary by its excess."""
    assert next_boundary(100.0, 100.1, 13.0, 0.5) == 113.0  # paired at once: a round on
    assert next_boundary(100.0, 110.0, 13.0, 0.5) == 116.5  # waited 10 s: the 6.5 s left after it
    assert next_boundary(100.0, 100.1, 13.0, 0.0) == pytest.approx(113.1)  # no overlap: all after it
    assert compute_sample(13.0, 12.9, 0.5) == 13.0
    assert compute_sample(16.5, 6.5, 0.5) == 13.0  # not 16.5: 3.5 s of it was a wait
    assert compute_sample(13.1, 13.0, 0.0) == 13.0
    assert compute_sample(13.0, 0.0, 1.0) == 13.0  # every step overlapped: boundary to boundary


@pytest.mark.parametrize(
    ("since_boundary", "since_paired", "near"),
    [
        (10.0, 9.9, True),  # paired at once, 3 s from the boundary of a 13 s round
        (9.9, 3.4, True),  # waited 6.5 s (all the overlapped steps): 3.1 s to go
        (0.5, 0.4, False),  # 12.5 s to go
    ],
)
async def test_a_peer_near_its_boundary_by_its_computing_time_says_later_else_never(
    since_boundary: float, since_paired: float, near: bool
) -> None:
    """A node computing towards its next boundary says "later" when it expects it within
    half its computing time (``next_boundary``), else "never". The same node judged by its
    boundary-to-boundary time (26.5 s after a round whose pairing waited 20 s) said "never"
    in the first case; judged by the time since its pairing's end alone (6.9 s when its
    pairings are quick), in the second."""
    async with nodes(2) as group:
        (_, pa), (b, pb) = group
        now = trio.current_time()
        pb._last_round, pb._round_s, pb._overlap = 0, 26.5, 0.5
        pb._boundary_at, pb._paired_at, pb._compute_s = now - since_boundary, now - since_paired, 13.0
        current = _Round(1, memoryview(bytearray(NBYTES)), memoryview(bytearray(NBYTES)))
        with trio.fail_after(30):
            assert await pa._ask(b.peer_id, current) == ("busy" if near else "never")


async def test_a_peer_saying_it_is_past_the_runs_last_round_is_not_believed_and_penalized() -> None:
    """Its word would make us skip rounds; an honest node stops at the run's last."""
    async with nodes(3) as group:
        (a, pa), (b, pb), (c, pc) = group
        pa._rounds = 8
        box = (memoryview(bytearray(NBYTES)), memoryview(bytearray(NBYTES)))
        pb._last_round = pc._last_round = 8  # both "past" round 7, the run's last
        with trio.fail_after(60):
            assert await pa.find_partner(1, *box, [b.peer_id, c.peer_id], timeout_s=600) is None
        assert pa.lag == pa.vouched_lag == 0
        lies = 2 * PAST_THE_RUN_POINTS  # each said it twice: to "pair?", then to "pull?"
        assert a.peers.penalty(b.peer_id) == a.peers.penalty(c.peer_id) == lies
        pb._last_round = pc._last_round = 7  # at the last round: 6 ahead of us, vouched by two
        with trio.fail_after(60):
            assert await pa.find_partner(1, *box, [b.peer_id, c.peer_id], timeout_s=600) is None
        assert pa.lag == pa.vouched_lag == MAX_LAG and rounds_to_skip(pa.vouched_lag) == MAX_LAG
        assert a.peers.penalty(b.peer_id) == lies  # the truth costs nothing


def test_the_schedule_pairs_every_member_alike_and_changes_partners_round_to_round() -> None:
    """Greedy pairing alone kept pairs for many rounds (node/algorithms/noloco/pairing.py):
    the schedule is a perfect matching every member computes alike, new each round."""
    members = [f"peer-{i}" for i in range(4)]
    rounds = 300
    counts: dict[frozenset[str], int] = {}
    same_as_before = 0
    previous = None
    for round_index in range(rounds):
        partners = {m: scheduled_partner("run", round_index, m, [p for p in members if p != m]) for m in members}
        assert all(partners[p] == m for m, p in partners.items() if p is not None)  # mutual
        assert None not in partners.values()  # an even count: nobody left out
        pair = frozenset(("peer-0", partners["peer-0"]))
        counts[pair] = counts.get(pair, 0) + 1
        same_as_before += partners["peer-0"] == previous
        previous = partners["peer-0"]
    # Each of peer-0's three partners a third of the rounds: 100 ± 6 standard deviations
    # (√(300·⅓·⅔) ≈ 8.2); the same partner as last round a third of the time likewise.
    assert len(counts) == 3 and all(abs(c - rounds / 3) <= 6 * 8.2 for c in counts.values())
    assert abs(same_as_before - (rounds - 1) / 3) <= 6 * 8.2
    # Another run, another schedule; an odd count leaves exactly one member out.
    assert [scheduled_partner("other", r, "peer-0", members[1:]) for r in range(20)] != [
        scheduled_partner("run", r, "peer-0", members[1:]) for r in range(20)
    ]
    five = [*members, "peer-4"]
    alone = [m for m in five if scheduled_partner("run", 7, m, [p for p in five if p != m]) is None]
    assert len(alone) == 1


async def test_nodes_pair_with_their_scheduled_partner_though_others_reach_the_boundary_first() -> None:
    """Two nodes at the boundary before their scheduled partners: greedy, they paired with
    each other (the only two there); now each waits for its own, a moment later."""
    async with nodes(4) as group:
        for _, pairing in group:
            pairing._round_s = 40.0  # a window of min(0.5 * 40 s, a quarter of the 40 s bound)
        ids = [h.peer_id for h, _ in group]
        schedule = {m: scheduled_partner("", 0, m, [p for p in ids if p != m]) for m in ids}
        early = [ids[0], next(p for p in ids if p not in (ids[0], schedule[ids[0]]))]
        late = [schedule[p] for p in early]

        # The late two come once each early node asked its scheduled partner and was told it
        # is not at the round yet (greedy pairing had paired the early two by then).
        heard = [trio.Event() for _ in early]
        for p, event in zip(early, heard, strict=True):
            pairing = group[ids.index(p)][1]

            async def ask(
                peer_id: str, current: _Round, *, question: str = "pair?", real=pairing._ask, p=p, event=event
            ) -> str:
                answer = await real(peer_id, current, question=question)
                if peer_id == schedule[p] and peer_id in current.told:
                    event.set()
                return answer

            pairing._ask = ask  # type: ignore[method-assign]
        with trio.fail_after(60):
            results = await run_round(group, timeout_s=40, start_after={ids.index(p): heard for p in late})
        assert {ids[i]: partner for i, (partner, _) in enumerate(results)} == schedule


@pytest.mark.parametrize("overlap", [0.0, 0.2, 0.9])
async def test_the_window_is_at_most_the_runs_overlap_share_of_a_round(overlap: float) -> None:
    """While pairing, the worker trains the next round's first ``outer.overlap`` share of
    steps: a longer wait would stall it (with overlap 0, any wait would): the window is
    min(half, overlap) of our round time, none at 0."""
    async with nodes(2) as group:
        (_, pairing), (other, _) = group
        pairing._prefer_share = min(0.5, overlap)  # as Noloco builds it from the run's settings
        pairing._round_s = 40.0
        box = (memoryview(bytearray(NBYTES)), memoryview(bytearray(NBYTES)))
        seen: list[float] = []

        async def look() -> None:
            await trio.testing.wait_all_tasks_blocked()
            current = pairing._round
            assert current is not None
            seen.append(current.scheduled_until - pairing._boundary_at)  # type: ignore[operator]
            pairing._notify()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(look)
            with trio.move_on_after(1):
                await pairing.find_partner(0, *box, [other.peer_id], timeout_s=400)
        assert seen == [pytest.approx(min(0.5, overlap) * 40.0)]


async def test_a_scheduled_partner_that_never_comes_is_given_up_after_the_window() -> None:
    """The window is bounded: a node whose scheduled partner never comes to the round (its
    host up, "still computing") goes back to the others once it ends, as before the
    schedule: they are paired, so it pulls one's payload when its sweeps end; the others
    pair as scheduled."""
    async with nodes(4) as group:
        ids = [h.peer_id for h, _ in group]
        schedule = {m: scheduled_partner("", 0, m, [p for p in ids if p != m]) for m in ids}
        gone = schedule[ids[0]]
        here = [i for i, p in enumerate(ids) if p != gone]
        # A bound of 8 s: the window 2 s (the first round's), the sweeps until 6 s, then a pull.
        with trio.fail_after(30):
            results = await run_round(group, timeout_s=8, present=here)
        others = here[1:]
        assert all(results[i][0] == schedule[ids[i]] and not group[i][1].last_pulled for i in others)
        assert results[0][0] in {ids[i] for i in others} and group[0][1].last_pulled


async def test_the_larger_id_hears_its_scheduled_partner_cannot_come_and_stops_waiting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The larger id of a scheduled pair mostly waits to be asked; it still asks at its
    boundary and then once in a while, so a partner past the round (or far behind, or gone)
    ends its window at once. It first asked only a second after its boundary, and windows
    are half a round: with rounds under 2 s (micro, a loaded machine) a node one round
    behind waited out its window at every boundary for a partner already past it, stayed
    behind, and a late joiner of tests/test_joining.py had a partner in 5 of its 16 rounds.
    (The pause between its asks made longer than the window: only the first ask can end it.)"""
    from node.algorithms.noloco import pairing as module

    monkeypatch.setattr(module, "SCHEDULED_SLOW_ASK_S", 600.0)
    async with nodes(2) as group:
        (_, pa), (b, pb) = sorted(group, key=lambda pair: pair[0].peer_id, reverse=True)  # pa: the larger id
        pb._last_round = 5  # b is past round 1: it says "never"
        pa._last_round, pa._boundary_at, pa._round_s = 0, trio.current_time(), 240.0  # a window of 60 s
        box = (memoryview(bytearray(NBYTES)), memoryview(bytearray(NBYTES)))
        with trio.fail_after(30):  # not the window's 60 s, nor the bound's 600
            assert await pa.find_partner(1, *box, [b.peer_id], timeout_s=600) is None


async def pair_while_the_larger_id_asks_the_smaller(
    group: list[tuple[Host, Pairing]], *, timeout_s: float
) -> tuple[dict[str, str | None], Pairing]:
    """Round 0 for two nodes, the larger id's question to the smaller one lasting as long as
    the smaller's pairing (a loaded machine), the smaller asking once it is out: each
    node's partner, and the smaller's pairing."""
    (large, pl), (small, ps) = sorted(group, key=lambda pair: pair[0].peer_id, reverse=True)
    small_done, asked = trio.Event(), trio.Event()

    async def stuck_question(peer_id: str, current: _Round, *, question: str = "pair?") -> str:
        asked.set()
        await small_done.wait()
        return "asking"

    pl._ask = stuck_question  # type: ignore[method-assign]
    results: dict[str, str | None] = {}

    async def one(host: Host, pairing: Pairing, after: trio.Event | None) -> None:
        if after is not None:
            await after.wait()  # the smaller id once the larger one's question is out
        box = (memoryview(bytearray(NBYTES)), memoryview(bytearray(NBYTES)))
        other = small.peer_id if host is large else large.peer_id
        results[host.peer_id] = await pairing.find_partner(0, *box, [other], timeout_s=timeout_s)
        if host is small:
            small_done.set()

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(one, large, pl, None)
            nursery.start_soon(one, small, ps, asked)
    return results, ps


async def test_the_larger_id_takes_its_scheduled_partners_question_while_asking_it_itself() -> None:
    """The larger id asks its scheduled partner once in a while (to hear a "never"); on a
    loaded machine that question can take seconds, and the smaller id's questions then
    heard "asking" until the window was gone (a second reader paired 4 of 8 times within
    it). The larger id now takes its scheduled partner's question even while asking."""
    async with nodes(2) as group:
        for _, pairing in group:
            pairing._round_s = 40.0  # a window of 10 s (a quarter of the 40 s bound)
        results, ps = await pair_while_the_larger_id_asks_the_smaller(group, timeout_s=40)
        (a, _), (b, _) = group
        assert results == {a.peer_id: b.peer_id, b.peer_id: a.peer_id}
        assert not ps.last_pulled  # paired (without the rule: a pull once its sweeps ran out)


async def test_two_nodes_asking_each_other_at_once_pair_by_id() -> None:
    """Outside any window: the larger id, asking the smaller, takes the smaller's question
    (the smaller's own hears "asking"). Before, both heard "asking" and backed off; here the
    larger id's question lasts as long as the smaller's pairing, so the smaller asked until
    its sweeps ran out and pulled instead."""
    async with nodes(2) as group:
        for _, pairing in group:
            pairing._prefer_share = 0.0  # no schedule window: asking anyone at once
        results, ps = await pair_while_the_larger_id_asks_the_smaller(group, timeout_s=8)
        (a, _), (b, _) = group
        assert results == {a.peer_id: b.peer_id, b.peer_id: a.peer_id}
        assert not ps.last_pulled


async def test_a_workers_restart_is_not_taken_for_a_round() -> None:
    """Rounds of 1 s, then 30 s down (the worker restarting) before the next boundary: the
    round time stays 1 s (it was 9.7 s: a pairing window of ~5 s at the next boundaries)."""
    async with nodes(1) as group:
        (_, pa), *_ = group
        box = (memoryview(bytearray(NBYTES)), memoryview(bytearray(NBYTES)))
        pa._round_s, pa._compute_s, pa._last_round = 1.0, 1.0, 4
        pa._boundary_at = pa._paired_at = trio.current_time() - 30.0
        pa.joining = True  # started from a peer's state: joining no more
        pa.worker_started()
        assert not pa.joining
        assert await pa.find_partner(5, *box, [], timeout_s=10) is None
        assert pa.round_s == 1.0 and pa._compute_s == 1.0
