"""The daemon's ZO rounds against a stand-in worker: whole rounds only, rebuild on late entries."""

from typing import Any

from node.algorithms.zo import ZoRounds
from protocol import zolog

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


def rounds() -> ZoRounds:
    return ZoRounds(
        FakeHost(),  # type: ignore[arg-type]
        run_id=RUN,
        identity_seed=SEEDS[0],
        rounds=10,
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
    from node.algorithms.zo import outvoted

    assert outvoted("ours", {}) is None
    assert outvoted("ours", {"p": "theirs"}) is None  # one peer against us: no verdict
    assert outvoted("ours", {"p": "theirs", "q": "theirs"}) == ("theirs", ["p", "q"])
    assert outvoted("ours", {"p": "theirs", "q": "theirs", "r": "ours"}) is None  # 2 against 2
    assert outvoted("ours", {"p": "a", "q": "b", "r": "a", "s": "a"}) == ("a", ["p", "r", "s"])
    assert outvoted("ours", {"p": "ours", "q": "ours"}) is None
