"""A NoLoCo node that joins late starts from a peer's state at the run's round, not from round 0."""

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from node.algorithms.joining import BOUNDARY_WAIT_S, StateOffers, resync_wait_s, vouched_round
from node.algorithms.noloco import Noloco
from node.daemon import Daemon
from tests.adversarial.harness import (
    described,
    finished,
    micro_noloco,
    run_with_a_late_joiner,
    start_trainers,
    until,
)
from tests.conftest import open_swarm

ROUNDS = 30
JOIN_AFTER = 3
TRAINING = micro_noloco(ROUNDS)
TIMEOUT_S = 240.0


def test_the_round_to_join_at_needs_a_second_peer() -> None:
    assert vouched_round([]) is None
    assert vouched_round([7]) == 7  # a run of two has no second opinion
    assert vouched_round([3, 1000, 4]) == 4  # one peer claiming a far round moves nothing
    assert vouched_round([5, 5]) == 5


def test_a_resync_waits_a_few_of_its_rounds_or_of_its_offers_whichever_is_longer() -> None:
    assert resync_wait_s(1.5, 1.5) == pytest.approx(4.5)  # micro: a save every round
    assert resync_wait_s(1.7, 8.5) == pytest.approx(17.0)  # gpt-125m on an H200: an offer every 5 rounds
    assert resync_wait_s(None, None) == BOUNDARY_WAIT_S  # nothing known: as a joiner
    assert resync_wait_s(600.0, None) == BOUNDARY_WAIT_S  # never longer than a joiner's wait


def rounds_done(daemon: Daemon) -> int:
    return daemon.training.metrics.rounds if daemon.training else 0


@pytest.mark.integration
@pytest.mark.parametrize("compression", ["none", "sparseloco"])
async def test_a_late_joiner_starts_at_the_runs_round_from_a_peers_state(
    short_tmp: Path, monkeypatch: pytest.MonkeyPatch, compression: str
) -> None:
    """With compressed payloads too (issue 16): the joiner takes a peer's φ, not its
    error feedback (what that peer has yet to send), and pairs on."""
    training = {**TRAINING, "run__settings__compression": compression}
    async with open_swarm(short_tmp) as swarm:
        first, late = await run_with_a_late_joiner(
            swarm, monkeypatch, training, run_name="join", join_after=JOIN_AFTER, timeout_s=TIMEOUT_S
        )
        assert late.training is not None and isinstance(late.training.algorithm, Noloco)
        status = late.training.status()
        assert status is not None
        assert status["joined_from"] in {n.peer_id for n in first}
        assert status["start_round"] == JOIN_AFTER + 1
        # It trained only the rounds left, and started from trained weights: its first
        # validation loss is far below a fresh model's (ln 256 ≈ 5.5 for bytes).
        assert status["rounds"] == ROUNDS
        # A point a round trained: all from its start but those skipped. No worker restart
        # and no resync left rounds out (a full run of the suite once had the curve 2 short:
        # a worker started again from a newer state, which this now names).
        said = (
            f"worker starts {status.get('worker_starts')}, session errors {status.get('session_errors')}, "
            f"resyncs {status['resyncs']}, skipped {status['rounds_skipped']}, jumped {status['rounds_jumped']}"
        )
        assert status["rounds_jumped"] == 0, said
        assert len(status["loss_curve"]) == ROUNDS - status["start_round"] - status["rounds_skipped"], said
        fresh = first[0].training.metrics.loss_curve[0][1] if first[0].training else 0.0
        assert status["loss_curve"][0][1] < fresh
        # And it trains with the others, not alone beside them: it skipped to its peers'
        # round when it fell further behind than a pull reaches (before that, in full runs of
        # the suite and under a CPU hog, it had a partner in 1-6 of its 26 rounds, then
        # refused its peers' drifted replicas; now in 17-25 of 20-26 under 2-3 CPU hogs).
        trained = len(status["loss_curve"])
        assert 2 * status["rounds_with_partner"] > trained and status["payloads_refused"] == 0, (
            f"joiner {late.peer_id[-6:]} refused {status['payloads_refused']}, pulled {status.get('rounds_pulled')}, "
            f"shortened {status.get('rounds_shortened')}\n{described([*first, late])}"
        )


@pytest.mark.integration
async def test_a_state_is_hashed_when_a_joiner_first_asks_not_every_round(tmp_path: Path) -> None:
    """Offering after every round costs a hard link; the sha256 (seconds for a state of
    gigabytes) is computed when a joiner first asks, and its fetch checks it."""
    import hashlib

    import trio

    from node.algorithms import savedstate
    from node.algorithms.joining import StateOffers
    from protocol.net.host import open_host, parse_dial_addr

    saved = tmp_path / "worker.ckpt"
    saved.write_bytes(b"state of round 4 " * 1000)
    async with (
        open_host(identity_seed=b"\x01" * 32, listen_addrs=["/ip4/127.0.0.1/tcp/0"], announce_addrs=[]) as a,
        open_host(identity_seed=b"\x02" * 32, listen_addrs=["/ip4/127.0.0.1/tcp/0"], announce_addrs=[]) as b,
    ):
        (tmp_path / "a").mkdir()
        offers = StateOffers(a, "run", tmp_path / "a")
        offers.register()
        await offers.offer(saved, 4)
        assert offers.service.offer is not None and offers.service.offer.sha256 == savedstate.LAZY
        await b.connect(parse_dial_addr(a.addrs()[0]), timeout_s=5)
        joiner = StateOffers(b, "run", None)
        dest = tmp_path / "joined.ckpt"
        with trio.fail_after(60):
            assert await joiner.join([a.peer_id], dest, last_round=4) == dest  # the run's last: no wait
        assert dest.read_bytes() == saved.read_bytes()
        assert offers.service.offer.sha256 == hashlib.sha256(saved.read_bytes()).hexdigest()
        assert joiner.service.download is None  # the progress of a fetch ends with it


@pytest.mark.integration
async def test_a_join_waits_for_the_peers_next_boundary_only_as_long_as_it_is_told(tmp_path: Path) -> None:
    """Two peers offer round 4 of 10 and do not move (both resyncing, as the joiner is):
    the join takes their state once ``boundary_wait_s`` is over, not after BOUNDARY_WAIT_S."""
    from node.algorithms import joining
    from protocol.net.host import open_host, parse_dial_addr

    saved = tmp_path / "worker.ckpt"
    saved.write_bytes(b"state of round 4 " * 100)

    def host(seed: int) -> Any:
        return open_host(identity_seed=bytes([seed]) * 32, listen_addrs=["/ip4/127.0.0.1/tcp/0"], announce_addrs=[])

    async with host(1) as a, host(2) as b, host(3) as joiner_host:
        for i, peer in enumerate((a, b)):
            (tmp_path / str(i)).mkdir()
            offers = StateOffers(peer, "run", tmp_path / str(i))
            offers.register()
            await offers.offer(saved, 4)
            await joiner_host.connect(parse_dial_addr(peer.addrs()[0]), timeout_s=5)
        joiner = StateOffers(joiner_host, "run", None)
        dest = tmp_path / "joined.ckpt"
        with trio.fail_after(joining.BOUNDARY_WAIT_S / 10):
            assert await joiner.join([a.peer_id, b.peer_id], dest, last_round=10, boundary_wait_s=2.0) == dest
        assert dest.read_bytes() == saved.read_bytes()


@pytest.mark.integration
async def test_a_starting_node_asks_whether_anyone_is_ahead_without_waiting_on_a_silent_peer(tmp_path: Path) -> None:
    """One peer that never answers (behind a NAT, not yet directly connected: it kept three
    of four nodes 10 s, the header's timeout, while the fourth started 14 s ahead of
    them): a peer offering a state answers it at once; with none, the ask ends after
    AHEAD_ASK_S, well inside the header's timeout."""
    from node.algorithms import joining, savedstate
    from protocol.net.host import Stream, open_host, parse_dial_addr

    assert joining.AHEAD_ASK_S <= savedstate.HEADER_TIMEOUT_S / 2
    saved = tmp_path / "worker.ckpt"
    saved.write_bytes(b"state of round 4 " * 100)

    async def silent(stream: Stream) -> None:
        await trio.sleep_forever()

    def host(seed: int) -> Any:
        return open_host(identity_seed=bytes([seed]) * 32, listen_addrs=["/ip4/127.0.0.1/tcp/0"], announce_addrs=[])

    async with host(1) as ahead, host(2) as quiet, host(3) as fresh, host(4) as asker:
        (tmp_path / "a").mkdir()
        offers = StateOffers(ahead, "run", tmp_path / "a")
        offers.register()
        await offers.offer(saved, 4)
        StateOffers(fresh, "run", None).register()  # at round 0: offers nothing
        quiet.set_handler(joining.PROTOCOL_ID, silent, deadline_s=600)
        for other in (ahead, quiet, fresh):
            await asker.connect(parse_dial_addr(other.addrs()[0]), timeout_s=5)
        states = StateOffers(asker, "run", None)
        with trio.fail_after(savedstate.HEADER_TIMEOUT_S / 2):
            assert await states.anyone_ahead([quiet.peer_id, ahead.peer_id]) is True
        with trio.fail_after(joining.AHEAD_ASK_S + savedstate.HEADER_TIMEOUT_S / 4):  # not the header's 10 s
            assert await states.anyone_ahead([quiet.peer_id, fresh.peer_id]) is False


@pytest.mark.integration
async def test_a_host_hears_of_connections_it_dialled_or_was_dialled_and_their_end() -> None:
    """``Host.connections_changed`` (libp2p's connection notifications), what the ask above
    waits on: a connection the peer made to us ends ``until_connected`` as ours does."""
    from protocol.net.host import open_host, parse_dial_addr
    from protocol.net.hostlike import until_connected

    def host(seed: int) -> Any:
        return open_host(identity_seed=bytes([seed]) * 32, listen_addrs=["/ip4/127.0.0.1/tcp/0"], announce_addrs=[])

    async with host(1) as a, host(2) as b:
        changed = a.connections_changed
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(until_connected, a, b.peer_id)
                await b.connect(parse_dial_addr(a.addrs()[0]), timeout_s=5)  # theirs, not ours
        assert changed.is_set() and b.peer_id in a.connected_peers()
        changed = a.connections_changed
        await b.disconnect(a.peer_id)
        with trio.fail_after(5):
            await changed.wait()
        changed = a.connections_changed
        await a.connect(parse_dial_addr(b.addrs()[0]), timeout_s=5)  # ours
        assert changed.is_set()
        with trio.fail_after(5):  # an ask waits for nothing once connected
            await until_connected(a, b.peer_id)


# When the member dials or a hole punch connect a NATed peer, in virtual seconds: under
# AHEAD_ASK_S, the bound an ask that dialled the peer itself waited out.
PUNCH_AFTER_S = 1.0


async def test_a_starting_node_asks_a_peer_behind_a_nat_once_connected(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.testing.MockClock
) -> None:
    """A live peer behind a NAT, no connection to it yet: a stream to it dials its addresses
    and hangs (the NAT drops the SYNs), and the connection a hole punch makes meanwhile goes
    unused. Three of four nodes starting behind NATs waited out AHEAD_ASK_S on the first
    one and started a round behind it (3 runs of 5). The ask's stream is now opened again
    over the connection as soon as it comes (``open_stream_racing``); a peer whose
    addresses answer is asked at once still, with nobody else connecting us (a second
    reader's finding against waiting first); one exchange, one judgment of a bad answer
    (a third reader's finding against racing two asks)."""
    from node.algorithms import joining
    from protocol.net.hostlike import PeerAddrs
    from protocol.net.memnet import FakeHost, FakeNetwork, Faults
    from protocol.net.peers import PENALTY_POINTS

    assert PUNCH_AFTER_S < joining.AHEAD_ASK_S
    saved = tmp_path / "worker.ckpt"
    saved.write_bytes(b"state of round 4 " * 100)
    net = FakeNetwork(1, Faults())
    async with net.running():
        asker, first, ahead, reachable = (net.add_host(bytes([seed]) * 32) for seed in (1, 2, 3, 4))
        for peer in (first, ahead, reachable):
            peer.behind_nat = peer is not reachable
        StateOffers(first, "run", None).register()
        for peer in (ahead, reachable):
            (tmp_path / peer.peer_id).mkdir()
            offers = StateOffers(peer, "run", tmp_path / peer.peer_id)
            offers.register()
            await offers.offer(saved, 4)
            await offers.service._resolved()  # hashed now: a thread would let the clock jump
        states = StateOffers(asker, "run", None)
        served: list[str] = []
        serve = FakeHost._serve

        async def counted(host: FakeHost, protocol_id: str, stream: Any) -> None:
            served.append(host.peer_id)
            await serve(host, protocol_id, stream)

        monkeypatch.setattr(FakeHost, "_serve", counted)
        asked_at = trio.current_time()
        assert await states.anyone_ahead([reachable.peer_id]) is True
        assert trio.current_time() == asked_at  # (virtual time: nothing waited)
        assert served == [reachable.peer_id]  # (here the open that dialled wins at once: no second stream)

        async def punch(peer: FakeHost) -> None:
            await trio.sleep(PUNCH_AFTER_S)
            await peer.connect(PeerAddrs(asker.peer_id, ()), timeout_s=1.0)

        for peer, is_ahead in ((first, False), (ahead, True)):
            net.nursery.start_soon(punch, peer)
            asked_at = trio.current_time()
            assert await states.anyone_ahead([peer.peer_id]) is is_ahead
            assert trio.current_time() - asked_at == pytest.approx(PUNCH_AFTER_S)  # virtual time
        assert served.count(first.peer_id) == served.count(ahead.peer_id) == 1

        async def garbled(stream: Any) -> None:
            await stream.write(b"\xff" * 64)  # no header of ours

        liar = net.add_host(bytes([5]) * 32)
        liar.behind_nat = True
        liar.set_handler(joining.PROTOCOL_ID, garbled)
        net.nursery.start_soon(punch, liar)
        assert await states.anyone_ahead([liar.peer_id]) is False
        assert asker.peers.penalty(liar.peer_id) == PENALTY_POINTS  # judged once, whichever stream asked


# A stand-in host's timings, virtual seconds: our own dial, a stream's negotiation, and
# libp2p's shielded reset of a stream cancelled mid-negotiation; the caller's bound falls
# after the winner opened (DIAL_S + NEGOTIATE_S) and inside the loser's reset.
DIAL_S, NEGOTIATE_S, RESET_S = 0.1, 0.05, 0.05
CALLER_BOUND_S = DIAL_S + NEGOTIATE_S + RESET_S / 2


async def test_a_stream_won_by_a_racing_open_is_reset_when_the_caller_gives_up_meanwhile(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """``open_stream_racing``: our own dial makes the connection, which wakes the second open
    too; the first stream opened wins and the loser is cancelled, which libp2p answers with
    a shielded reset. A caller's bound landing then (``anyone_ahead``'s, the first offer
    of several asks) must not leave the won stream open: its peer waits for our request,
    then judges us (a third reader's probe)."""
    from protocol.net.hostlike import open_stream_racing

    class Stream:
        reset_done = False

        async def reset(self) -> None:
            self.reset_done = True

    class Host:
        def __init__(self) -> None:
            self.connected: set[str] = set()
            self.connections_changed = trio.Event()
            self.streams: list[Stream] = []

        def connected_peers(self) -> set[str]:
            return set(self.connected)

        async def open_stream(self, peer_id: str, protocol_id: str, *, timeout_s: float) -> Stream:
            if peer_id not in self.connected:
                await trio.sleep(DIAL_S)
                self.connected.add(peer_id)
                changed, self.connections_changed = self.connections_changed, trio.Event()
                changed.set()
            try:
                await trio.sleep(NEGOTIATE_S)
            except trio.Cancelled:
                with trio.CancelScope(shield=True):
                    await trio.sleep(RESET_S)
                raise
            self.streams.append(Stream())
            return self.streams[-1]

    host = Host()
    with trio.move_on_after(CALLER_BOUND_S) as bound:
        await open_stream_racing(host, "peer", "/p/1", timeout_s=10.0)  # type: ignore[arg-type]
    assert bound.cancelled_caught
    assert len(host.streams) == 1 and host.streams[0].reset_done


# A partner's φ shifted by this many of its own updates: past the bound of 16 (honest Δ
# ratios reach 1.74, so ≥ 16 for most tensors) and within the attack margin of 128 (at most
# 30 × 1.74 + the honest gap of 3.7): refused as a replica that drifted, not as an attack.
DRIFT_UPDATES = 30.0
# Rounds long enough that the asking and pulls of a node a moment behind its peers (its
# worker started last) are small beside them: with rounds of ~0.1 s such a node falls
# behind for good and never meets a partner.
DRIFT_TRAINING = {**TRAINING, "run__settings__inner__steps_per_round": 20}


def drift_what_it_receives(daemon: Daemon) -> Callable[[], None]:
    """From now on, until its first resync, ``daemon``'s worker finds every partner's φ far
    from its own, as if its replica had drifted; returns the undo. (Undone by the resync
    itself: a test notices it up to LOOK_AGAIN_S later, and the worker that took a peer's
    state may pair in between; once it paired on a drifted payload and refused it.)"""
    import numpy as np

    assert daemon.training is not None and isinstance(daemon.training.algorithm, Noloco)
    algorithm = daemon.training.algorithm
    pairing = algorithm.pairing
    find = pairing.find_partner

    async def drifted(round_index: int, outbox: memoryview, inbox: memoryview, *args: Any, **kwargs: Any) -> Any:
        partner = await find(round_index, outbox, inbox, *args, **kwargs)
        if partner is not None and algorithm.resyncs == 0:
            data = np.frombuffer(inbox, dtype=np.float32)  # a view: φ then Δ
            half = data.size // 2
            data[:half] += DRIFT_UPDATES * data[half:]
        return partner

    pairing.find_partner = drifted  # type: ignore[method-assign]
    return lambda: setattr(pairing, "find_partner", find)


@pytest.mark.integration
async def test_a_replica_that_drifted_from_its_peers_takes_a_peers_state_and_pairs_again(short_tmp: Path) -> None:
    """A node whose worker refuses two partners in a row as too far from its own weights is
    the one that drifted: it takes a peer's state (as a joiner does) instead of training on
    alone, refused by everyone, to the end of the run.

    What the resync promises, asserted: the partner payloads that come after it are used
    (the first one and most), its replica never drifts far enough again to resync, nobody
    is banned. Not that no payload is ever refused again: it restarts its worker, comes
    back rounds behind and skips rounds to catch up (their steps not taken), as a straggler
    does, and a replica that skipped rounds can drift near the bound honestly. Seen (1 in 10
    runs beside 2 CPU hogs, ~1 in 3 full runs of the suite): the state came from a peer that
    had skipped 10 rounds itself, the drifter skipped 10 after its restart, and at round 28
    it refused an honest partner at 16.9 of its updates away (the bound is 16)."""
    async with open_swarm(short_tmp) as swarm:
        nodes = await start_trainers(swarm, 4, DRIFT_TRAINING, run_name="drift")
        await until(nodes, lambda: all(rounds_done(n) >= 2 for n in nodes), timeout_s=TIMEOUT_S)
        # One in step with its peers (it paired most): a node whose worker started last can
        # stay a round behind them, alone, and would meet no partner to refuse.
        drifter = max(nodes, key=lambda n: n.training.metrics.rounds_with_partner if n.training else -1)
        others = [n for n in nodes if n is not drifter]
        assert drifter.training is not None
        undo = drift_what_it_receives(drifter)
        algorithm = drifter.training.algorithm
        assert isinstance(algorithm, Noloco)
        # (round, partner, refusal or None where used, resyncs then) of each round with a partner.
        outcomes: list[tuple[object, ...]] = []
        judge = algorithm.judge

        async def judged(done: dict[str, Any]) -> None:
            partner = algorithm._partner
            await judge(done)
            rejected = done.get("rejected")
            if partner is not None:
                why = rejected if isinstance(rejected, str) else None if done.get("used_peer") is True else "unused"
                outcomes.append((done.get("round"), partner[-6:], why, algorithm.resyncs))

        algorithm.judge = judged  # type: ignore[method-assign]
        await until(nodes, lambda: algorithm.resyncs >= 1 or finished(drifter), timeout_s=TIMEOUT_S)
        undo()
        metrics = drifter.training.metrics
        assert algorithm.resyncs == 1, f"{metrics}, {algorithm.status()}"
        partnered_before = drifter.training.metrics.rounds_with_partner
        try:
            await until(nodes, lambda: all(finished(n) for n in nodes), timeout_s=TIMEOUT_S)
        except trio.TooSlowError:
            # Seen once in a full run of the suite (the resync done, then not all finished in
            # 240 s); not understood yet: where each node stood.
            raise AssertionError(
                f"not finished in {TIMEOUT_S} s after the resync:\n{outcomes}\n"
                f"{drifter.peer_id[-6:]} drifted\n{described(nodes)}"
            ) from None
        status = drifter.training.status()
        assert status is not None
        assert status["joined_from"] in {n.peer_id for n in others}
        assert status["rounds"] == ROUNDS
        said = f"{outcomes}\n{drifter.peer_id[-6:]} drifted\n{described(nodes)}"
        before = [o for o in outcomes if o[3] == 0]
        after = [o for o in outcomes if o[3] == 1]
        assert sum(o[2] not in (None, "unused") for o in before) >= 2, said
        # From a peer it did not refuse since it last used a payload (the resync's rule:
        # ``not_from``; two of its three peers at most, so one was left).
        refused: set[object] = set()
        for _, partner, why, _ in before:
            if why is None:
                refused = set()
            elif why != "unused":
                refused.add(partner)
        assert 0 < len(refused) < len(others) and status["joined_from"][-6:] not in refused, said
        # Its peers' weights are its own again: partners' payloads are used.
        assert after and after[0][2] is None, said
        assert 2 * sum(o[2] is None for o in after) > len(after), said
        assert algorithm.resyncs == 1, said
        assert drifter.training.metrics.rounds_with_partner > partnered_before
        # A point a round it trained: the rounds the resync's state left out are counted
        # (``rounds_jumped``), as skipped ones are; before, the curve came out short.
        left_out = status["rounds_skipped"] + status["rounds_jumped"]
        assert len(status["loss_curve"]) == ROUNDS - status["start_round"] - left_out, said
        bans = {(a.peer_id, b.peer_id) for a in nodes for b in nodes if a.peers.is_banned(b.peer_id)}
        assert not bans, f"{metrics}, {status}"


def test_every_round_from_the_start_has_a_point_or_is_skipped_or_jumped_across_restarts() -> None:
    """The daemon's bookkeeping of a node's rounds as its workers start, stop and skip:
    len(curve) = rounds counted − start_round − skipped − jumped, whatever the restarts
    (a second reader's cases: a restart at the same round, below it, inside a skip or a
    jump, a round whose outer step never came, one below where the node began)."""
    from types import SimpleNamespace

    from node.algorithms.base import TrainingMetrics
    from node.algorithms.rounds import PayloadRounds
    from training.settings import RunSettings

    rounds = PayloadRounds.__new__(PayloadRounds)
    metrics = TrainingMetrics()
    rounds.ctx = SimpleNamespace(metrics=metrics, run=RunSettings(rounds=100))  # type: ignore[assignment]
    rounds.start_round, rounds._curve_rounds, rounds._skips, rounds._jumps = 0, [], [], []

    def trained(r: int, skipped: int = 0, *, outer: bool = True) -> None:
        assert r == metrics.rounds
        metrics.loss_curve.append([float(r), 1.0])
        rounds._curve_rounds.append(r)
        if outer:  # as ``_session`` counts an outer_done
            if skipped:
                rounds._skips.append((r, skipped))
            metrics.rounds += 1 + skipped

    def holds() -> None:
        points = len(metrics.loss_curve)
        assert points == metrics.rounds - rounds.start_round - rounds.rounds_skipped - rounds.rounds_jumped
        covered = set(rounds._curve_rounds)  # each round at most once: a point, a skip or a jump
        for r, k in rounds._skips:
            assert covered.isdisjoint(range(r + 1, r + 1 + k))
            covered |= set(range(r + 1, r + 1 + k))
        for s, k in rounds._jumps:
            assert covered.isdisjoint(range(s - k, s))
            covered |= set(range(s - k, s))
        assert covered == set(range(rounds.start_round, metrics.rounds))

    rounds._restart_at(4)  # a joiner, from its peer's round 4
    assert rounds.start_round == 4 and rounds.rounds_jumped == 0
    trained(4)
    trained(5, skipped=3)  # 6, 7, 8 left out
    trained(9)
    holds()
    rounds._restart_at(10)  # a restart at the same round: nothing changes
    assert (rounds.rounds_skipped, rounds.rounds_jumped) == (3, 0)
    trained(10, outer=False)  # its point, and the worker gone before the outer step
    rounds._restart_at(13)  # a resync's state at 13: 10, 11, 12 jumped, 10's point goes
    assert rounds.rounds_jumped == 3 and rounds._curve_rounds[-1] == 9
    holds()
    trained(13)
    trained(14)
    rounds._restart_at(12)  # back inside the jump (a slower peer's state): 12 trained again
    assert rounds.rounds_jumped == 2
    holds()
    trained(12)
    rounds._restart_at(7)  # inside the skip (an older checkpoint): 7 on trained again
    assert (rounds.rounds_skipped, rounds.rounds_jumped) == (1, 0)
    holds()
    trained(7)
    rounds._restart_at(2)  # below where it began (a refused state: from an older one)
    assert rounds.start_round == 2 and not metrics.loss_curve
    holds()
    # The final model's full validation holds only while the run's last round is done.
    metrics.full_val_loss = 2.5
    rounds._restart_at(100)  # a restarted worker of a finished run: nothing to train again
    assert metrics.full_val_loss == 2.5
    rounds._restart_at(99)
    assert metrics.full_val_loss is None


def test_a_resync_takes_a_state_from_peers_it_refused_only_where_they_are_all_it_has_and_more_than_one() -> None:
    """In a run of three, a node that drifted refused both its peers: they agree with each
    other, not with it, so it takes one of their states (it never resynced before: a late
    joiner in a full run of the suite refused its peers' payloads to the end of the run)."""
    from types import SimpleNamespace

    from node.algorithms.rounds import PayloadRounds

    rounds = PayloadRounds.__new__(PayloadRounds)

    def sources(partners: list[str], refused: set[str]) -> list[str]:
        rounds.ctx = SimpleNamespace(partners=lambda: partners)  # type: ignore[assignment]
        rounds.not_from = refused
        return rounds._state_sources()

    assert sources(["a", "b", "c"], {"a", "b"}) == ["c"]  # one we did not refuse
    assert sources(["a", "b"], {"a", "b"}) == ["a", "b"]  # every peer refused, more than one: we drifted
    assert sources(["a", "b"], {"a"}) == ["b"]
    assert sources(["a"], {"a"}) == []  # a run of two: nobody to tell which of us drifted
    assert sources(["a"], {"a", "b"}) == []  # the same once the other refused one is banned or gone
    assert sources(["a", "b"], set()) == ["a", "b"]  # a joiner


@pytest.mark.integration
async def test_nodes_that_all_resync_at_once_take_each_others_state_without_waiting_out_the_bound(
    short_tmp: Path,
) -> None:
    """Halves of a run that trained apart refuse each other's payloads, and every node
    resyncs at once (seen with SPES beside a CPU hog: four nodes, 14 rounds in two pairs).
    A joiner waits for its peers' next boundary, for BOUNDARY_WAIT_S (300 s) at most; here
    nobody moves (all are resyncing), and each waited all of it. A resync waits for
    RESYNC_WAIT_ROUNDS of its own rounds at most, then takes the state offered now."""
    from node.algorithms import joining

    async with open_swarm(short_tmp) as swarm:
        nodes = await start_trainers(swarm, 3, DRIFT_TRAINING, run_name="drift-all")
        await until(nodes, lambda: all(rounds_done(n) >= 2 for n in nodes), timeout_s=TIMEOUT_S)
        for node in nodes:
            drift_what_it_receives(node)  # each undone by its own resync
        algorithms = [n.training.algorithm for n in nodes if n.training is not None]
        assert all(isinstance(a, Noloco) for a in algorithms) and len(algorithms) == len(nodes)
        with trio.fail_after(joining.BOUNDARY_WAIT_S * 0.8):  # a bound the old wait did not meet
            await until(nodes, lambda: all(finished(n) for n in nodes), timeout_s=joining.BOUNDARY_WAIT_S)
        assert sum(a.resyncs for a in algorithms if isinstance(a, Noloco)) >= 2, described(nodes)
        for node in nodes:
            status = node.training.status() if node.training else None
            assert status is not None and status["rounds"] == ROUNDS, described(nodes)
