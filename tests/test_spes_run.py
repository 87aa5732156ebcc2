"""SPES with real daemons and workers on loopback: every expert has one owner, each node trains
only its own, versions travel, and a killed owner's experts are taken over."""

import math
from pathlib import Path

import numpy as np
import pytest
import trio

from node.algorithms.spes import Spes
from node.daemon import Daemon
from tests.adversarial.harness import described, finished, run_with_a_late_joiner, start_trainers, until
from tests.conftest import open_swarm
from training.encodings.experts import DELTA, Chain, Sparse

pytestmark = pytest.mark.integration
ROUNDS = 8
NUM_EXPERTS = 8  # micro-moe
TRAINING = {
    "run__settings__algorithm": "spes",
    "run__settings__model": "micro-moe",
    "run__settings__rounds": ROUNDS,
    "run__settings__inner__steps_per_round": 5,
    "training__pair_timeout_s": 20.0,
}
TIMEOUT_S = 300.0


def spes_of(node: Daemon) -> Spes:
    assert node.training is not None and isinstance(node.training.algorithm, Spes)
    return node.training.algorithm


def rounds_done(node: Daemon) -> int:
    return node.training.metrics.rounds if node.training else 0


@pytest.mark.parametrize("compression", ["none", "sparseloco"])
async def test_each_node_trains_only_its_experts_and_fetches_the_others(
    short_tmp: Path, compression: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """float32 versions; and, under sparseloco, int8 keyframes and sparse deltas, which every
    holder rebuilds bit for bit (training/encodings/experts.py)."""
    training = {**TRAINING, "run__settings__compression": compression}
    # Every public copy an owner's encoder made, by its version's sha256: a holder's last
    # decode is of some version, most often not the owner's newest (the owner publishes again
    # at each round's end, and its last version may come after a holder's last round).
    encoded: dict[bytes, Chain] = {}
    encode_next = Sparse.encode_next

    def recorded(self: Sparse, data: bytes, chain: Chain | None) -> tuple[bytes, Chain]:
        wire, after = encode_next(self, data, chain)
        encoded[after.sha256] = after
        return wire, after

    monkeypatch.setattr(Sparse, "encode_next", recorded)
    async with open_swarm(short_tmp) as swarm:
        nodes = await start_trainers(swarm, 3, training, run_name="spes")
        await until(nodes, lambda: all(finished(n) for n in nodes), timeout_s=TIMEOUT_S)
        owned = [set(spes_of(n).owned) for n in nodes]
        assert set().union(*owned) == set(range(NUM_EXPERTS))
        assert sum(len(o) for o in owned) == NUM_EXPERTS  # one owner each
        assert sorted(len(o) for o in owned) == [2, 3, 3]
        for node in nodes:
            status = node.training.status() if node.training else None
            assert status is not None and status["rounds"] == ROUNDS
            assert math.isfinite(status["final_loss"]) and status["final_loss"] < status["loss_curve"][0][1]
            assert status["trainable_params"] < status["total_params"]
            # Versions of every frozen expert came in, signed by its owner (the newest at each
            # look: rounds here take a fraction of a second, and nodes started seconds
            # apart, so a node may skip versions or finish before its peers' last ones).
            frozen = set(range(NUM_EXPERTS)) - set(status["owned_experts"])
            assert status["expert_versions_fetched"] >= len(frozen)
            held = spes_of(node).store.held
            assert all(e in held and held[e].head.owner != node.peer_id for e in frozen)
            assert status["expert_versions_refused"] == 0
            assert status["rounds_with_partner"] >= 1
        # Every node sees the same owners.
        assert len({tuple(sorted(spes_of(n).ctx.state.leases.items())) for n in nodes}) == 1
        if compression == "sparseloco":
            # Deltas travelled (chains past their keyframe), and every frozen copy a holder
            # decoded is its owner's public copy of that version, bit for bit.
            assert any(c.depth > 0 for c in encoded.values())
            decoded = [(sha256, values) for n in nodes for sha256, values in spes_of(n)._public.values()]
            assert decoded, "no holder decoded a version"
            for sha256, values in decoded:
                assert sha256 in encoded, "a holder decoded a version no owner encoded"
                assert np.array_equal(values.view(np.uint32), encoded[sha256].public.view(np.uint32))


async def test_a_killed_owners_experts_are_taken_over_by_the_survivors(short_tmp: Path) -> None:
    """How many rounds the take-over costs depends on round length against the silence and
    liveness bounds, so it is measured by bench/spes.py; here: it happens, while training,
    and the load ends even. Even at the end, not at the first moment every expert is held: a
    survivor that looks gone for a moment (the tests' 3 s liveness against a loaded machine's
    pauses) loses its experts to the other and takes half back by the balance rule; once seen
    in a full run, [0, 8] where [4, 4] was then asserted."""
    async with open_swarm(short_tmp) as swarm:
        nodes = await start_trainers(swarm, 3, {**TRAINING, "run__settings__rounds": 1000}, run_name="spes")
        *survivors, victim = nodes
        await until(nodes, lambda: rounds_done(victim) >= 2 and bool(spes_of(victim).owned), timeout_s=TIMEOUT_S)
        swarm.kill(victim)

        def owned() -> list[set[int]]:
            return [set(spes_of(s).owned) for s in survivors]

        def taken_over() -> bool:
            for node in survivors:
                leases = node.run_service.state.leases if node.run_service else {}
                if victim.peer_id in {lease.owner for lease in leases.values()}:
                    return False
            return set().union(*owned()) == set(range(NUM_EXPERTS)) and sorted(map(len, owned())) == [4, 4]

        try:
            await until(survivors, taken_over, timeout_s=TIMEOUT_S)
        except trio.TooSlowError:
            releases = [[r.report() for r in spes_of(s).keeper.releases] for s in survivors]
            pytest.fail(f"not taken over evenly: owned {owned()}, releases seen {releases}")
        assert any(r.from_peer == victim.peer_id for s in survivors for r in spes_of(s).keeper.releases)


JOIN_AFTER = 3


async def test_a_late_joiner_takes_a_peers_state_is_handed_experts_and_its_sparse_versions_travel(
    short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under sparseloco, where versions are chains of deltas: the joiner starts at the run's
    round from a peer's state, decodes chains whose keyframes it never saw (fetched back
    along each chain), is handed experts to even the load (the new owner starts a chain of
    its own, keyframe first), and its peers take its versions. 20 steps a round: with 5, the
    joiner's first round took as long as 3 of its peers' and it spent the run 2-3 rounds
    behind (skipping helps, not always enough: docs/training.md)."""
    rounds = 16
    training = {
        **TRAINING,
        "run__settings__rounds": rounds,
        "run__settings__inner__steps_per_round": 20,
        "run__settings__compression": "sparseloco",
    }
    published: list[tuple[str, int]] = []  # (publisher, kind of version) as each goes out
    publish = Spes._publish

    async def recorded(self: Spes, experts: list[int], round_index: int) -> None:
        await publish(self, experts, round_index)
        published.extend((self.ctx.host.peer_id, self.store.held[e].data[0]) for e in experts)

    monkeypatch.setattr(Spes, "_publish", recorded)
    async with open_swarm(short_tmp) as swarm:
        first, late = await run_with_a_late_joiner(
            swarm, monkeypatch, training, run_name="spes", join_after=JOIN_AFTER, timeout_s=TIMEOUT_S
        )
        nodes = [*first, late]
        status = late.training.status() if late.training else None
        assert status is not None
        assert status["joined_from"] in {n.peer_id for n in first}
        assert status["start_round"] == JOIN_AFTER + 1 and status["rounds"] == rounds
        trained = len(status["loss_curve"])
        assert 2 * status["rounds_with_partner"] > trained, described(nodes)
        # Handed experts by the rule (8 over 3), and every node sees the same owners.
        owned = [set(spes_of(n).owned) for n in nodes]
        assert set().union(*owned) == set(range(NUM_EXPERTS)) and sum(map(len, owned)) == NUM_EXPERTS
        assert len(owned[-1]) >= 2, owned
        assert len({tuple(sorted(spes_of(n).ctx.state.leases.items())) for n in nodes}) == 1
        for node in nodes:
            node_status = node.training.status() if node.training else None
            assert node_status is not None and node_status["expert_versions_refused"] == 0
        # The joiner's own chains went past their keyframes (a delta each version but every
        # eighth), and its peers hold its versions (taken without a refusal, above; not all of
        # them: experts of a peer that finished go to the joiner, still training, at the end).
        assert any(kind == DELTA for peer, kind in published if peer == late.peer_id), published
        held = [spes_of(node).store.held.get(expert) for node in first for expert in owned[-1]]
        assert any(h is not None and h.head.owner == late.peer_id for h in held)
