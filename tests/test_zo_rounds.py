"""The daemon's ZO rounds against a stand-in worker: whole rounds only, rebuild on late entries."""

from dataclasses import replace
from pathlib import Path
from typing import Any

import trio
import trio.testing

from node.algorithms import savedstate
from node.algorithms.zo import rounds as zo_module
from node.algorithms.zo import zolog
from node.algorithms.zo.journal import Journal
from node.algorithms.zo.rounds import ZoRounds

RUN = "zo-run-abcdef"
SEEDS = [bytes([i + 1]) * 32 for i in range(3)]
IDS = [zolog.peer_id_of(s) for s in SEEDS]


class FakeHost:
    peer_id = IDS[0]

    def set_handler(self, protocol_id: str, handler: object) -> None:
        pass


class FakeWorker:
    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []

    async def send(self, msg_type: str, **fields: Any) -> None:
        self.sent.append({"t": msg_type, **fields})


def rounds(num_rounds: int = 10) -> ZoRounds:
    return ZoRounds(
        FakeHost(),  # type: ignore[arg-type]
        run_id=RUN,
        identity_seed=SEEDS[0],
        rounds=num_rounds,
        updates_per_round=2,
        partners=lambda: IDS[1:],
        is_member=set(IDS).__contains__,
        wait_s=1.0,
    )


async def publish(zo: ZoRounds, who: int, first_seq: int, round_index: int) -> None:
    await zo.sync.add(zolog.sign_batch(SEEDS[who], RUN, first_seq, [round_index] * 2, bytes([who + 1, who + 2])))


async def test_rounds_go_to_the_worker_whole_and_in_order_then_a_late_entry_rebuilds() -> None:
    zo, worker = rounds(), FakeWorker()
    await publish(zo, 1, 0, 0)
    await publish(zo, 2, 0, 0)
    await publish(zo, 1, 2, 1)
    await zo._send_updates(worker, below_round=2)  # type: ignore[arg-type]
    assert [(m["rebuild"], len(m["updates"])) for m in worker.sent] == [(False, 4), (False, 2)]
    worker.sent.clear()
    await publish(zo, 2, 2, 1)  # peer 2's round-1 updates arrive after round 1 was applied
    await zo._send_updates(worker, below_round=2)  # type: ignore[arg-type]
    assert [(m["rebuild"], len(m["updates"])) for m in worker.sent] == [(True, 4), (False, 4)]
    assert zo.rebuilds == 1
    worker.sent.clear()
    await publish(zo, 1, 4, 2)
    await zo._send_updates(worker, below_round=3)  # type: ignore[arg-type]
    assert [(m["rebuild"], len(m["updates"])) for m in worker.sent] == [(False, 2)]
    # The seeds are the derived ones, in the canonical order (peer id, then seq, within a round).
    assert worker.sent[0]["updates"] == [[zolog.seed_of(RUN, IDS[1], 2, seq), 2 + seq - 4] for seq in (4, 5)]


async def test_a_late_entry_replays_from_the_worker_s_copy_before_its_round_not_from_genesis() -> None:
    # Seen in a 16-node soak: each round's late entries made every node replay the whole
    # log (~900 entries) from genesis, and the replays kept both cores saturated.
    zo, worker = rounds(), FakeWorker()
    zo._snapshot_capacity = 2
    for r in range(3):
        await publish(zo, 1, 2 * r, r)
    await zo._send_updates(worker, below_round=3)  # type: ignore[arg-type]
    # A copy after each of the last two groups (the worker keeps two): keys 2 and 3.
    assert [m["snapshot"] for m in worker.sent] == [None, 2, 3]
    worker.sent.clear()
    await publish(zo, 2, 0, 2)  # peer 2's round-2 updates arrive after round 2 was applied
    await zo._send_updates(worker, below_round=3)  # type: ignore[arg-type]
    assert [(m["rebuild"], m["rewind"], len(m["updates"]), m["snapshot"]) for m in worker.sent] == [(False, 2, 4, 3)]
    assert (zo.rewinds, zo.rebuilds) == (1, 0)
    worker.sent.clear()
    await publish(zo, 0, 0, 0)  # one for round 0: older than any copy the worker keeps
    await zo._send_updates(worker, below_round=3)  # type: ignore[arg-type]
    assert [(m["rebuild"], m["rewind"], len(m["updates"])) for m in worker.sent] == [
        (True, None, 4),
        (False, None, 2),
        (False, None, 4),
    ]
    assert (zo.rewinds, zo.rebuilds) == (1, 1)
    assert [m["snapshot"] for m in worker.sent] == [None, 2, 3] and zo._snapshots == [2, 3]


async def test_an_author_excluded_after_its_entries_were_applied_rebuilds_without_them() -> None:
    # Seen in CI: the log shrank below what the worker held and indexing past its end
    # killed the daemon's training task.
    zo, worker = rounds(), FakeWorker()
    await publish(zo, 1, 0, 0)
    await publish(zo, 2, 0, 0)
    await publish(zo, 1, 2, 1)
    await publish(zo, 2, 2, 1)
    await zo._send_updates(worker, below_round=2)  # type: ignore[arg-type]
    worker.sent.clear()
    held = zo.log.batches_after(IDS[2], -1)
    assert zo.log.exclude(IDS[2], (held[0], held[0]))
    await zo._send_updates(worker, below_round=2)  # type: ignore[arg-type]
    assert [(m["rebuild"], len(m["updates"])) for m in worker.sent] == [(True, 2), (False, 2)]
    assert all(u[0] != zolog.seed_of(RUN, IDS[2], 0, 0) for m in worker.sent for u in m["updates"])


def test_outvoted_only_by_a_majority_of_at_least_two() -> None:
    from node.algorithms.zo.rounds import outvoted

    assert outvoted("ours", {}) is None
    assert outvoted("ours", {"p": "theirs"}) is None  # one peer against us: no verdict
    assert outvoted("ours", {"p": "theirs", "q": "theirs"}) == ("theirs", ["p", "q"])
    assert outvoted("ours", {"p": "theirs", "q": "theirs", "r": "ours"}) is None  # 2 against 2
    assert outvoted("ours", {"p": "a", "q": "b", "r": "a", "s": "a"}) == ("a", ["p", "r", "s"])
    assert outvoted("ours", {"p": "ours", "q": "ours"}) is None


class FakeCheckpoints:
    """Each peer's checkpoint header, and how often each was asked for it."""

    def __init__(self, offer: savedstate.Offer) -> None:
        self.offer: savedstate.Offer | None = offer
        self.heads: dict[str, savedstate.Offer | None] = {}
        self.asked: dict[str, int] = {}

    async def head(self, peer_id: str) -> savedstate.Offer | None:
        self.asked[peer_id] = self.asked.get(peer_id, 0) + 1
        return self.heads.get(peer_id)


async def test_the_weights_agreement_asks_each_peer_once_per_checkpoint_then_finds_us_outvoted(
    autojump_clock: trio.testing.MockClock,
) -> None:
    zo = rounds()
    ours = savedstate.Offer(4, {IDS[0]: 8}, "a" * 64, Path("ours"), 1, "0" * 64)
    checkpoints = FakeCheckpoints(ours)
    zo.checkpoints = checkpoints  # type: ignore[assignment]
    checkpoints.heads = {IDS[1]: replace(ours, round=2), IDS[2]: ours}  # peer 1 is behind, peer 2 agrees
    async with trio.open_nursery() as nursery:
        nursery.start_soon(zo.agree_forever)
        await trio.sleep(10 * zo_module.AGREE_INTERVAL_S + 0.5)
        # The one that agreed was asked once; the one behind, every interval until it got there.
        assert checkpoints.asked == {IDS[1]: 10, IDS[2]: 1}
        assert zo._outvoted is None
        # Our next checkpoint: both reach it, holding other weights than ours on the same log.
        theirs = replace(ours, round=8, param_hash="b" * 64)
        checkpoints.offer = replace(ours, round=8)
        checkpoints.heads = {IDS[1]: theirs, IDS[2]: theirs}
        await trio.sleep(zo_module.AGREE_INTERVAL_S)
        assert zo._outvoted == (8, "b" * 64, [IDS[1], IDS[2]])
        assert checkpoints.asked == {IDS[1]: 11, IDS[2]: 2}
        nursery.cancel_scope.cancel()


def journaled(path: Path) -> ZoRounds:
    zo = rounds()
    zo._journal = Journal(path, RUN)
    return zo


async def test_a_restarted_node_takes_its_chain_back_from_its_journal(tmp_path: Path) -> None:
    """Killed before any peer pulled its last batch, a node that came back with an empty
    log would sign those sequence numbers again (equivocation: excluded and banned)."""
    before = journaled(tmp_path / "run.zo-journal")
    for round_index in range(3):
        seq = before.log.next_seq(IDS[0])
        batch = zolog.sign_batch(SEEDS[0], RUN, seq, [round_index] * 2, bytes([1, 2]))
        await before._journal_own(batch)
        await before.sync.add(batch)
    after = journaled(tmp_path / "run.zo-journal")  # the same node after a SIGKILL
    await after._restore_own_batches()
    assert after.log.vector() == {IDS[0]: 6}
    assert after.log.batches_after(IDS[0], 0) == before.log.batches_after(IDS[0], 0)


async def test_a_record_a_crash_cut_short_is_ignored_and_overwritten(tmp_path: Path) -> None:
    path = tmp_path / "run.zo-journal"
    first, second = (zolog.sign_batch(SEEDS[0], RUN, 2 * k, [k] * 2, bytes([1, 2])) for k in range(2))
    await Journal(path, RUN).append(first)
    with path.open("ab") as f:  # the crash: a length and half a batch
        f.write(len(second.encode()).to_bytes(4, "big") + second.encode()[:10])
    journal = Journal(path, RUN)
    assert await journal.read() == [first]
    await journal.append(second)
    assert await Journal(path, RUN).read() == [first, second]


async def test_a_journal_comes_back_whole_however_far_its_rounds_are_past_the_window(tmp_path: Path) -> None:
    """A node that joined late signs rounds far past what an empty log's window takes
    (agreed round + 16): restored through the window, those entries waited for a pull, and
    the next signature reused their sequence numbers (equivocation)."""
    path = tmp_path / "run.zo-journal"
    for k, round_index in enumerate([40, 41, 42]):
        await Journal(path, RUN).append(zolog.sign_batch(SEEDS[0], RUN, 2 * k, [round_index] * 2, bytes([1, 2])))
    zo = rounds(100)
    zo._journal = Journal(path, RUN)
    await zo._restore_own_batches()
    assert zo.log.vector() == {IDS[0]: 6} and zo.log.last_round(IDS[0]) == 42
