"""The scale harness (bench/scale.py): the run-state services of many nodes in virtual time.

Small here (the suite's budget); bench/scale.py runs it at 16 to 1,000 nodes (docs/scale.md).
"""

import math

from bench.scale import Scenario, simulate
from protocol.net import gossip, memnet
from protocol.runstate.run import HEARTBEATS_PER_S


def test_newcomers_spread_and_every_node_pays_for_the_heartbeats_it_hears() -> None:
    nodes = 8
    result = simulate(Scenario(nodes, minutes=4, churn=3.0, seed=2, warmup_s=60))
    assert result["joins"] >= 1 and result["joins"] == result["leaves"] + result["crashes"]
    seen = result["seen_99_s"]
    assert seen["count"] >= 1 and seen["never"] == 0
    assert seen["max"] <= 30.0  # issue 42's bound; a pushed record takes one gossip hop
    last = result["windows"][-1]
    assert last["nodes"] == nodes and last["members_in_doc"] >= nodes
    # Heartbeats: every other node's, one per interval (5 s, or its live peers over
    # HEARTBEATS_PER_S past that), each costing the mesh's copies in and out at every
    # receiver (protocol/net/memnet.py's model).
    labels = result["summary"]["bps_by_label"]
    per_heartbeat = 2 * memnet.GOSSIP_COPIES * memnet.GOSSIP_FRAME_NBYTES
    interval_s = max(5.0, math.ceil((nodes - 1) / HEARTBEATS_PER_S))
    assert labels["gossip:heartbeat"] >= (nodes - 1) / interval_s * per_heartbeat
    assert labels["/swarmtrain/state/1.0.0"] > 0  # anti-entropy pulls
    assert not math.isnan(result["summary"]["in_bps_median"])


def test_each_node_hears_a_bounded_number_of_heartbeats_however_large_the_run() -> None:
    """Every member hears every heartbeat: each node's interval grows with its live peers
    so that each hears at most HEARTBEATS_PER_S a second (7.8 a second here before)."""
    nodes, window_s = 40, 240.0  # > 5 s × HEARTBEATS_PER_S: past where the configured interval is enough
    result = simulate(Scenario(nodes, minutes=9, churn=0.0, seed=3, sample_s=window_s, warmup_s=150))
    beat = gossip.encode(gossip.Heartbeat(digest="0" * 16, role="trainer", every_s=39))
    per_heartbeat = 2 * memnet.GOSSIP_COPIES * (memnet.GOSSIP_FRAME_NBYTES + len(beat))
    last = result["windows"][-1]  # the joins (the first minute) and the first intervals are over
    heard_per_s = last["bps_by_label"]["gossip:heartbeat"] / per_heartbeat
    assert (nodes - 1) / 5.0 > HEARTBEATS_PER_S  # what the configured interval alone would give
    # With every peer live, each of the others beats every (nodes - 1) / HEARTBEATS_PER_S s:
    # a window holds at most one beat more of each than that rate.
    assert heard_per_s <= HEARTBEATS_PER_S + (nodes - 1) / window_s
    assert last["view"] == 1.0  # and nobody expired: each stays live 3 of its intervals


def test_nodes_pair_for_every_round_when_all_stay() -> None:
    """The daemon's own pairing, driven by stand-in workers of speeds 0.8-1.2: a node goes
    alone only when no peer holds its round (2 rounds behind: shorter rounds keep the
    slower ones within one) or its partner vanished mid-round, and here nobody leaves."""
    result = simulate(Scenario(8, minutes=5, churn=0.0, seed=5, warmup_s=60, algorithm="noloco", round_s=10))
    training = result["training"]
    # 4 virtual minutes after the warm-up, rounds of 10 s × 0.8-1.2 (+ pairing): ~20 a node.
    assert training["rounds"] >= 8 * 240 / (10 * 1.2 + 2)
    assert training["alone"] == 0 and training["skipped"] == 0
    assert training["paired"] + training["pulled"] == training["rounds"]
    # Payloads are training traffic, apart from the control bytes.
    labels = result["summary"]["bps_by_label"]
    assert labels["/swarmtrain/exchange/1.0.0"] > 0 and labels["/swarmtrain/pair/1.0.0"] > 0


def test_newcomers_start_at_the_runs_round_and_only_a_vanished_partner_leaves_one_alone() -> None:
    """Churn: nodes leave (half without a word) and newcomers start at the round two of
    the bootstrap nodes vouch for. A node is alone in a round only when its partner left
    between pairing and sending (once per leave at most); nobody is behind enough to skip."""
    result = simulate(Scenario(8, minutes=6, churn=12.0, seed=3, warmup_s=60, algorithm="noloco", round_s=10))
    training = result["training"]
    assert result["joins"] >= 2
    assert training["alone"] <= result["leaves"] + result["crashes"]
    assert training["skipped"] == 0
    assert training["per_node_with_partner"]["nodes"] > 8  # newcomers trained 5 rounds or more too
