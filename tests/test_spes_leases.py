"""Expert leases: the rule every node computes alike, and the signed claims in the run document."""

import itertools
import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from node.algorithms.spes.leases import SILENT_S, LeaseKeeper, Progress, assign, lapsed, still_training
from protocol import keys
from protocol.errors import BadMessage
from protocol.runstate.state import LEASE_OWNERS_KEPT, LeaseRecord, RunState, better_lease, sign_lease

RUN = "leases-abc123"
SEEDS = [bytes([i + 1]) * 32 for i in range(12)]
PEERS = [keys.peer_id_of(s) for s in SEEDS]
SEED_OF = dict(zip(PEERS, SEEDS, strict=True))


def lease(expert: int, owner: str, epoch: int = 1, round_index: int = 0) -> LeaseRecord:
    return sign_lease(LeaseRecord(expert, owner, epoch, round_index), SEED_OF[owner], RUN)


def loads(owners: dict[int, str], active: list[str]) -> list[int]:
    counts = Counter(owners.values())
    return sorted(counts.get(p, 0) for p in active)


@given(
    num_experts=st.integers(1, 16),
    num_active=st.integers(1, 8),
    claims=st.lists(st.tuples(st.integers(0, 15), st.integers(0, 11)), max_size=20),
    order=st.randoms(use_true_random=False),
)
@settings(max_examples=200, deadline=None)
def test_every_expert_has_one_active_owner_and_the_load_is_even(
    num_experts: int, num_active: int, claims: list[tuple[int, int]], order: random.Random
) -> None:
    active = PEERS[:num_active]
    leases = {e: lease(e, PEERS[p]) for e, p in claims}
    owners = assign(num_experts, leases, active, run_id=RUN)
    assert sorted(owners) == list(range(num_experts))
    assert set(owners.values()) <= set(active)
    counts = loads(owners, active)
    assert counts[-1] - counts[0] <= 1
    # The same on every node: whatever order the active peers are listed in.
    shuffled = list(active)
    order.shuffle(shuffled)
    assert assign(num_experts, leases, shuffled, run_id=RUN) == owners


def test_an_active_owner_keeps_its_experts_and_a_gone_ones_are_shared_out() -> None:
    a, b, c, d = PEERS[:4]
    leases = {e: lease(e, [a, b, c, d][e % 4]) for e in range(8)}
    owners = assign(8, leases, [a, b, c, d], run_id=RUN)
    assert owners == {e: lease.owner for e, lease in leases.items()}  # nothing moves while even
    without_d = assign(8, leases, [a, b, c], run_id=RUN)
    assert all(without_d[e] == owners[e] for e in owners if owners[e] != d)  # only d's two move
    assert loads(without_d, [a, b, c]) == [2, 3, 3]


def test_a_joiner_is_handed_experts_until_the_load_is_even() -> None:
    a, b, c, joiner = PEERS[:4]
    leases = {e: lease(e, [a, b, c][e % 3]) for e in range(8)}
    owners = assign(8, leases, [a, b, c, joiner], run_id=RUN)
    assert loads(owners, [a, b, c, joiner]) == [2, 2, 2, 2]
    moved = [e for e in range(8) if owners[e] != leases[e].owner]
    assert len(moved) == 2 and all(owners[e] == joiner for e in moved)


def test_more_trainers_than_experts_leave_some_owning_none() -> None:
    owners = assign(3, {}, PEERS[:5], run_id=RUN)
    assert loads(owners, PEERS[:5]) == [0, 0, 1, 1, 1]
    assert assign(3, {}, [], run_id=RUN) == {}


def test_an_owner_lapses_after_missing_its_rounds_or_going_silent_not_for_being_slow() -> None:
    a = PEERS[0]
    since = 3  # our round when we first saw its claim

    def progress(newest: int, reported: int, answered: int, at: float = 0.0) -> Progress:
        return Progress({a: newest}, {a: reported}, {a: (answered, at)})

    later = SILENT_S
    # At its round 7 it published up to round 5: one of its rounds missed.
    assert not lapsed(a, since, progress(5, 7, 9), our_round=9, lapse_rounds=2, now=0.0)
    assert lapsed(a, since, progress(4, 7, 9), our_round=9, lapse_rounds=2, now=0.0)  # two missed
    # Slow: it is at its round 5 while we are at 12, and published each of its rounds.
    assert not lapsed(a, since, progress(4, 5, 12), our_round=12, lapse_rounds=2, now=later)
    # Silent (killed): it last answered at our round 10, SILENT_S ago.
    assert not lapsed(a, since, progress(4, 5, 10), our_round=11, lapse_rounds=2, now=later)
    assert lapsed(a, since, progress(4, 5, 10), our_round=12, lapse_rounds=2, now=later)
    # Two of our rounds in a second are not silence yet.
    assert not lapsed(a, since, progress(4, 5, 10), our_round=12, lapse_rounds=2, now=later / 2)
    nothing = Progress({}, {}, {})
    assert not lapsed(a, since, nothing, our_round=4, lapse_rounds=2, now=0.0)  # claimed a moment ago
    assert lapsed(a, since, nothing, our_round=5, lapse_rounds=2, now=0.0)  # never heard from since
    assert not lapsed(a, None, nothing, our_round=60, lapse_rounds=2, now=0.0)  # owns nothing
    # A joiner at round 5 has not asked anyone yet: silence counts from when it began
    # asking, not from the lease (it claimed every expert for a round before this rule).
    joined = Progress({}, {}, {}, listening=(5, 100.0))
    assert not lapsed(a, since, joined, our_round=7, lapse_rounds=2, now=100.0 + SILENT_S / 2)
    assert lapsed(a, since, joined, our_round=7, lapse_rounds=2, now=100.0 + SILENT_S)


def test_a_claim_naming_a_far_round_still_lapses_and_a_peer_not_training_gets_nothing() -> None:
    """The round a claim names is its signer's to choose: lapses count from when we first
    saw the claim. And only peers whose worker is in its rounds get experts: one starting,
    restarting or finished would hold them untrained."""
    a, b, c = PEERS[:3]
    state = RunState(RUN)
    keeper = LeaseKeeper(state, seed=SEED_OF[c], peer_id=c, lapse_rounds=2)
    keeper.num_experts = 2
    state.put_lease(lease(0, a, round_index=(1 << 53) - 1))
    trainers = [a, b]
    heard = Progress({a: -1, b: 3}, {a: 5, b: 5}, {a: (5, 0.0), b: (5, 0.0)}, training={a: True, b: True})
    assert keeper.active(trainers, heard, 5, now=0.0) == sorted([a, b, c])  # first seen at our round 5
    assert keeper.active(trainers, heard, 7, now=0.0) == sorted([b, c])  # it published nothing since
    b_finished = Progress({a: 4, b: 3}, {a: 5, b: 5}, {a: (7, 0.0), b: (7, 0.0)}, training={a: True, b: False})
    assert keeper.active(trainers, b_finished, 7, now=0.0) == sorted([a, c])


def test_a_finished_peers_experts_go_to_those_still_training_a_restarting_one_keeps_them() -> None:
    """A node that finished its rounds would keep its experts frozen for the nodes still
    training; one restarting its worker (seconds) says it is not training too, but must
    not lose what it holds for that."""
    a, b, c, d, e = PEERS[:5]
    said = {a: True, b: False, c: False}
    training = still_training(said, {a: 10, b: 10, c: 4}, last_round=10)
    assert training == {a: True, b: False, c: True}  # b finished; c restarts at round 4
    state = RunState(RUN)
    keeper = LeaseKeeper(state, seed=SEED_OF[d], peer_id=d, lapse_rounds=2)
    progress = Progress({}, {a: 10, b: 10, c: 4}, {p: (5, 0.0) for p in (a, b, c)}, training=training)
    assert keeper.active([a, b, c, e], progress, 5, now=0.0) == sorted([a, c, d, e])  # e: not asked yet


def test_claims_hand_experts_over_through_the_document() -> None:
    """Two nodes' keepers: the rule, the claims they write, the document merging them."""
    a, b = PEERS[:2]
    state_a, state_b = RunState(RUN), RunState(RUN)
    keeper_a = LeaseKeeper(state_a, seed=SEED_OF[a], peer_id=a, lapse_rounds=2)
    keeper_b = LeaseKeeper(state_b, seed=SEED_OF[b], peer_id=b, lapse_rounds=2)
    for keeper in (keeper_a, keeper_b):
        keeper.num_experts = 4
    # a is alone at first: it claims everything.
    nothing = Progress({}, {}, {})
    for update in keeper_a.claims(keeper_a.owners(keeper_a.active([], nothing, 0, now=0.0)), 0):
        state_b.apply_remote(update)
    assert keeper_a.mine() == [0, 1, 2, 3]
    # b arrives: by the rule it takes two of a's; a lets them go once it sees the claims.
    for update in keeper_b.claims(keeper_b.owners(keeper_b.active([a], nothing, 1, now=0.0)), 1):
        state_a.apply_remote(update)
    assert len(keeper_b.mine()) == 2 and len(keeper_a.mine()) == 2
    assert set(keeper_a.mine()) | set(keeper_b.mine()) == {0, 1, 2, 3}
    heard = Progress({a: 0, b: 0}, {a: 1, b: 1}, {a: (1, 0.0), b: (1, 0.0)})
    assert keeper_a.claims(keeper_a.owners(keeper_a.active([b], heard, 1, now=0.0)), 1) == []  # even: no more moves
    keeper_a.observe(1)
    handed = [(r.expert, r.from_peer, r.to_peer) for r in keeper_a.releases if r.from_peer is not None]
    assert sorted(handed) == sorted((e, a, b) for e in keeper_b.mine())
    # a stops answering: two rounds later b takes its experts back.
    silent = Progress({a: 1, b: 3}, {a: 2, b: 4}, {a: (2, 0.0), b: (4, SILENT_S)})
    assert keeper_b.active([a], silent, 3, now=SILENT_S) == sorted([a, b])
    assert keeper_b.active([a], silent, 4, now=SILENT_S) == [b]
    for update in keeper_b.claims(keeper_b.owners(keeper_b.active([a], silent, 4, now=SILENT_S)), 4):
        state_a.apply_remote(update)
    assert keeper_b.mine() == [0, 1, 2, 3] and keeper_a.mine() == []


def test_a_banned_owner_cannot_win_back_the_experts_it_lost() -> None:
    """a banned h (its versions were refused) and took one of its two experts; h, running
    the rule on its own view where it is active and one short, claims one back. a's view
    leaves out h's claims: a keeps what it holds and claims no more (without the fall-back
    a claimed it again each round, a war whose last claim decided the owner at the end);
    b, which has not banned h, sees h's claims, and falls back too once it bans h."""
    a, b, h = PEERS[:3]
    banned_by_a: set[str] = {h}
    banned_by_b: set[str] = set()
    state_a, state_b, state_h = RunState(RUN), RunState(RUN), RunState(RUN)
    keeper_a = LeaseKeeper(state_a, seed=SEED_OF[a], peer_id=a, lapse_rounds=2, banned=banned_by_a.__contains__)
    keeper_b = LeaseKeeper(state_b, seed=SEED_OF[b], peer_id=b, lapse_rounds=2, banned=banned_by_b.__contains__)
    keeper_h = LeaseKeeper(state_h, seed=SEED_OF[h], peer_id=h, lapse_rounds=2)
    keepers = (keeper_a, keeper_b, keeper_h)

    def share(updates: list[bytes]) -> None:
        for update in updates:
            for state in (state_a, state_b, state_h):
                state.apply_remote(update)

    for keeper in keepers:
        keeper.num_experts = 6
    share([state_a.put_lease(lease(e, owner)) for e, owner in enumerate([a, a, b, b, h, h])])
    heard = Progress({}, {}, {p: (0, 0.0) for p in (a, b, h)})
    assert keeper_a.active([b, h], heard, 1, now=0.0) == sorted([a, b])  # a banned h
    taken = keeper_a.claims(keeper_a.owners(keeper_a.active([b, h], heard, 1, now=0.0)), 1)
    assert len(taken) == 1 and len(keeper_a.mine()) == 3  # the other goes to b (by a's rule)
    share(taken)
    # h: a holds 3, h 1: by the rule on h's view it takes one of a's back.
    back = keeper_h.claims(keeper_h.owners(keeper_h.active([a, b], heard, 1, now=0.0)), 1)
    assert len(back) == 1
    share(back)
    [retaken] = {e for e, r in state_a.leases.items() if r.owner == h} - {4, 5}
    assert state_b.leases[retaken].owner == h and keeper_b.view()[retaken].owner == h
    # a's view falls back to its own claim: it writes nothing and trains what it held.
    assert keeper_a.view()[retaken].owner == a
    assert keeper_a.claims(keeper_a.owners(keeper_a.active([b, h], heard, 2, now=0.0)), 2) == []
    assert len(keeper_a.mine()) == 3
    # b bans h too: its view falls back the same way, and it claims h's last expert with
    # an epoch above h's claim (which stands in the document for those that have not).
    banned_by_b.add(h)
    assert keeper_b.view()[retaken].owner == a
    claimed = keeper_b.claims(keeper_b.owners(keeper_b.active([a, h], heard, 2, now=0.0)), 2)
    share(claimed)
    assert h not in {r.owner for r in keeper_a.view().values()} | {r.owner for r in keeper_b.view().values()}
    assert keeper_a.view() == keeper_b.view()
    assert sorted(keeper_a.mine() + keeper_b.mine()) == list(range(6))


def test_the_view_keeps_a_bounded_number_of_claims_per_expert() -> None:
    """Each owner's best claim is kept for the fall-back, up to LEASE_OWNERS_KEPT per
    expert: a stranger's many keys push out the oldest claims, not the newest."""
    state = RunState(RUN)
    seeds = [bytes([i + 100]) * 32 for i in range(LEASE_OWNERS_KEPT + 2)]
    owners = [keys.peer_id_of(seed) for seed in seeds]
    for epoch, (owner, seed) in enumerate(zip(owners, seeds, strict=True), start=1):
        state.put_lease(sign_lease(LeaseRecord(0, owner, epoch, 0), seed, RUN))
    assert state.lease_apart_from(0, lambda _: False) == state.leases[0]
    assert state.leases[0].owner == owners[-1]
    # Banning the newest owners one by one falls back through the others, newest first,
    # down to the oldest kept; past that, nothing.
    banned: set[str] = set()
    for owner in reversed(owners[2:]):
        banned.add(owner)
        fallback = state.lease_apart_from(0, banned.__contains__)
        expected = owners[owners.index(owner) - 1]
        assert (fallback and fallback.owner) == (expected if owners.index(expected) >= 2 else None)


def test_the_better_of_two_claims_wins_the_same_on_both_sides() -> None:
    a, b = PEERS[:2]
    first, second = lease(0, a, epoch=2), lease(0, b, epoch=2)
    assert better_lease(RUN, first, second) != better_lease(RUN, second, first)
    assert better_lease(RUN, lease(0, b, epoch=3), first)
    state_a, state_b = RunState(RUN), RunState(RUN)
    update_a, update_b = state_a.put_lease(first), state_b.put_lease(second)
    state_a.apply_remote(update_b)
    state_b.apply_remote(update_a)
    # The document keeps one of two concurrent writes by client id, not by our order: the
    # side whose better claim lost there writes it back (the run service's upkeep), and
    # then both agree on the better one.
    for ours, theirs in ((state_a, state_b), (state_b, state_a)):
        update = ours.restore_leases(ours.stale_leases())
        if update:
            theirs.apply_remote(update)
    winner = first if better_lease(RUN, first, second) else second
    assert state_a.leases == state_b.leases == {0: winner}
    assert state_a.stale_leases() == state_b.stale_leases() == []


def test_a_forged_or_misfiled_lease_is_refused_and_a_replayed_one_changes_nothing() -> None:
    a, b = PEERS[:2]
    state, other = RunState(RUN), RunState(RUN)
    forged = LeaseRecord(0, a, 1, 0, sig=keys.sign(SEED_OF[b], "swarmtrain/lease/1", [RUN, 0, a, 1, 0]))
    with pytest.raises(BadMessage):
        other.put_lease(forged)
    writer = RunState(RUN)
    writer.put_lease(lease(0, a, epoch=1))
    old = writer.encode()
    newer = writer.put_lease(lease(0, b, epoch=2))
    state.apply_remote(old)
    state.apply_remote(newer)
    assert state.leases[0].owner == b
    assert state.stale_leases() == []
    # A delete relayed by a stranger reaches the document but not the view; the entry is
    # named stale, and written back.
    evil = RunState(RUN)
    evil.apply_remote(state.encode())
    delete = evil._write("leases", [("0", None)])
    state.apply_remote(delete)
    assert state.leases[0].owner == b and state.stale_leases() == [0]
    evil.apply_remote(state.restore_leases([0]))
    assert evil.leases[0].owner == b and state.stale_leases() == []


@pytest.mark.parametrize("epoch", [0, 1 << 41])
def test_a_lease_out_of_range_cannot_be_written(epoch: int) -> None:
    state = RunState(RUN)
    record = sign_lease(LeaseRecord(0, PEERS[0], epoch, 0), SEEDS[0], RUN)
    with pytest.raises(ValueError):
        state.put_lease(record)


def test_rank_ties_do_not_always_favour_one_peer() -> None:
    a, b = PEERS[:2]
    wins = Counter(
        a if better_lease(RUN, lease(e, a, epoch=k), lease(e, b, epoch=k)) else b
        for e, k in itertools.product(range(8), range(1, 5))
    )
    assert wins[a] > 0 and wins[b] > 0


def test_a_member_fighting_for_an_expert_it_lost_is_penalized_an_honest_take_back_is_not() -> None:
    """t claims a's expert 0 (a higher epoch wins the document); a, one short, takes one of
    t's back by the rule. t takes that one back, and again a round later: the rule never
    does that while a is active (a would hold fewer than t), so a, and b if it looked in
    between, penalize t once a has stayed active as long as lapsing takes; five such
    points ban it, and a banned peer's claims are left out. a's own take-back, a balance
    move, costs a nothing; so does a first take-back, and one from an owner that then
    lapses."""
    a, b, t = PEERS[:3]
    states = {p: RunState(RUN) for p in (a, b, t)}
    keepers = {p: LeaseKeeper(states[p], seed=SEED_OF[p], peer_id=p, lapse_rounds=2) for p in (a, b, t)}

    def share(updates: list[bytes]) -> None:
        for update in updates:
            for state in states.values():
                state.apply_remote(update)

    def steal(expert: int, round_index: int) -> None:
        top = states[t].leases[expert]
        share([states[t].put_lease(lease(expert, t, top.epoch + 1, round_index))])

    for keeper in keepers.values():
        keeper.num_experts = 6
    share([states[a].put_lease(lease(e, owner)) for e, owner in enumerate([a, a, b, b, t, t])])

    def look(peer: str, round_index: int, *, silent: str | None = None) -> list[tuple[str, str]]:
        """One round boundary of ``peer``'s (rounds SILENT_S apart); everyone answered just
        now but ``silent``, which last answered at round 0."""
        now = round_index * SILENT_S
        answered = {p: (0, 0.0) if p == silent else (round_index, now) for p in (a, b, t)}
        heard = Progress({p: round_index for p in (a, b, t)}, {}, answered)
        keeper = keepers[peer]
        share(keeper.claims(keeper.owners(keeper.active([a, b, t], heard, round_index, now=now)), round_index))
        fights, keeper.fights = keeper.fights, []
        return fights

    assert look(a, 0) == look(b, 0) == []
    steal(0, 1)
    assert look(a, 1) == []  # a fresh claim: the owner takes one back by the rule
    [taken] = [e for e in keepers[a].mine() if e != 1]
    assert states[b].leases[taken].owner == a
    assert look(b, 1) == []  # a's take-back was a balance move (t held 3, a 1)
    steal(taken, 2)  # t's first take-back: excused (as one after a ban would be)
    assert look(b, 2) == [] and look(a, 2) == []  # b looked before a took it back again
    assert keepers[a].view()[taken].owner == a
    assert look(b, 2) == []  # and after: it sees each claim
    steal(taken, 3)  # t again: a war
    assert look(b, 3) == [] and look(a, 3) == []  # suspected: a might lapse yet
    assert look(a, 4) == look(b, 4) == []
    (fight_a,) = look(a, 5)
    (fight_b,) = look(b, 5)
    assert fight_a[0] == fight_b[0] == t
    assert f"claimed expert {taken} back from {a} again" in fight_a[1]
    assert keepers[a].view()[taken].owner == a
    # t takes it back again, and this time a goes silent for b: b excuses t.
    steal(taken, 6)
    assert look(b, 6) == []
    assert look(b, 7, silent=a) == look(b, 8, silent=a) == look(b, 9, silent=a) == []
    assert a not in {lease.owner for lease in keepers[b].view().values()}  # it lapsed for b
