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
    # Heartbeats: every other node's, one per interval (5 s) at least, each costing the
    # mesh's copies in and out at every receiver (protocol/net/memnet.py's model).
    labels = result["summary"]["bps_by_label"]
    per_heartbeat = 2 * memnet.GOSSIP_COPIES * memnet.GOSSIP_FRAME_NBYTES
    assert labels["gossip:heartbeat"] >= (nodes - 1) / 5.0 * per_heartbeat
    assert labels["/swarmtrain/state/1.0.0"] > 0  # anti-entropy pulls
    assert not math.isnan(result["summary"]["in_bps_median"])


def test_each_node_hears_a_bounded_number_of_heartbeats_however_large_the_run() -> None:
    """Every member hears every heartbeat: each node's interval grows with its live peers
    so that each hears at most HEARTBEATS_PER_S a second (7.8 a second here before)."""
    nodes = 40  # > 5 s × HEARTBEATS_PER_S: past where the configured interval is enough
    result = simulate(Scenario(nodes, minutes=3, churn=0.0, seed=3, warmup_s=90))
    beat = gossip.encode(gossip.Heartbeat(digest="0" * 16, role="trainer", every_s=10))
    per_heartbeat = 2 * memnet.GOSSIP_COPIES * (memnet.GOSSIP_FRAME_NBYTES + len(beat))
    heard_per_s = result["summary"]["bps_by_label"]["gossip:heartbeat"] / per_heartbeat
    assert (nodes - 1) / 5.0 > HEARTBEATS_PER_S  # what the configured interval alone would give
    assert heard_per_s <= HEARTBEATS_PER_S * 1.01
    assert result["windows"][-1]["view"] == 1.0  # and nobody expired: each stays live 3 of its intervals
