"""The scale harness (bench/scale.py): the run-state services of many nodes in virtual time.

Small here (the suite's budget); bench/scale.py runs it at 16 to 1,000 nodes (docs/scale.md).
"""

import math

from bench.scale import Scenario, simulate
from protocol.net import memnet


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
