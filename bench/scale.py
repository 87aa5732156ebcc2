"""The swarm at scale in virtual time: N nodes' run-state services on the in-memory network.

What runs, per node, is the daemon's own code: ``RunService`` (protocol/runstate/run.py)
with its signed member record and the document's admission rule, the gossip loop
(heartbeats, pushed updates, goodbyes), anti-entropy pulls over ``StateSync``, member dials,
expiry and upkeep, on a ``FakeHost`` of protocol/net/memnet.py, with the daemon's default
intervals (node/config.py ``StateConfig``). trio's autojump clock runs it: virtual time
passes whenever every task waits, so an hour of the network takes what its work takes.

The network (seeded, one ``random.Random``):
- latency: each node draws a one-way delay to the internet's core (5–100 ms); a link's is
  the sum of its two ends' (10–200 ms);
- NAT: a share of the nodes (``--nat``) is behind a NAT: a stream to one opens only over
  a connection (its own dial, or one through a relay: a dial to it succeeds, as a relayed
  connection does);
- churn (``--churn``, the share of the nodes replaced per hour): at exponential intervals
  one node (never one of the 3 bootstrap nodes) leaves, half of them saying goodbye, half
  crashing without a word, and a new one joins (a fresh key); a newcomer connects to the
  bootstrap nodes and writes its member record, as the daemon does;
- traffic: protocol/net/memnet.py's model (libp2p framing; each gossip message costs its
  GossipSub mesh's D = 6 copies in and out at every node).

What it does not model: libp2p's Kademlia and GossipSub themselves (gossip reaches every
subscriber; its cost is the mesh model above; the real stack is measured by bench/soak.py
and ``simulate``), relays' capacity and hole punching, connection limits, Noise and yamux's
CPU, upload caps (control messages are small), and training: no worker and no payloads
(NoLoCo pairing, the ZO log and SPES leases run on the same hosts in later steps).

Per N it prints one JSON object:
    nodes, virtual_s, wall_s, cpu_s (this process), events (deliveries);
    control_bps: per node, bytes per second in and out (median, p99; nodes up for a
      whole sample window), and per label (heartbeat, update, bye, state sync, ...): the
      mean per node;
    doc_nbytes: the run document's encoding at sampled nodes, per sample window (median);
    view: the share of the live nodes a node sees as live (median over sampled nodes);
    members_in_doc: records in the document (median over sampled nodes);
    seen_99_s: per newcomer after the warm-up, the seconds until 99% of the live nodes
      hold its member record (median, max; "never" counted apart);
    joins, leaves, crashes.

    python bench/scale.py --nodes 16 64 256 [--minutes 30] [--nat 0.25] [--churn 0.25]
                          [--seed 1] [--sample-s 60] [--warmup-s 120]
"""

import argparse
import json
import logging
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import trio
import trio.testing

from node.config import StateConfig
from protocol.net import gossip
from protocol.net.hostlike import PeerAddrs
from protocol.net.memnet import FakeHost, FakeNetwork, Faults
from protocol.runstate.run import RunService
from protocol.runstate.state import Manifest, MemberRecord, RunState, sign_member

RUN = "scale-abc123"
NUM_BOOTSTRAP = 3
DIAL_TIMEOUT_S = 10.0
ONE_WAY_S = (0.005, 0.1)
SEEN_SHARE = 0.99
# Joiners whose spread is still watched at once (each look costs O(N)).
MAX_WATCHED = 64


def gossip_kind(data: bytes) -> str:
    """A gossip message's traffic label: its kind, from the message itself."""
    try:
        return "gossip:" + type(gossip.decode(data)).__name__.lower()
    except Exception:
        return "gossip:undecodable"


def percentile(values: list[float], share: float) -> float:
    """The ``share`` quantile (nearest rank) of ``values``; NaN when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(share * len(ordered)) - 1))]


@dataclass(frozen=True, slots=True)
class Scenario:
    nodes: int
    minutes: float = 10.0
    """Virtual minutes."""
    nat: float = 0.25
    """The share of nodes behind NAT."""
    churn: float = 0.25
    """The share of the nodes replaced per hour."""
    seed: int = 1
    sample_s: float = 60.0
    warmup_s: float = 120.0
    """Newcomers before this are not watched; windows before it are left out of ``summary``."""


@dataclass(slots=True)
class Node:
    host: FakeHost
    service: RunService
    scope: trio.CancelScope
    since: float


@dataclass(slots=True)
class Watch:
    """A newcomer whose record is spreading."""

    peer_id: str
    since: float


@dataclass(slots=True)
class Report:
    windows: list[dict[str, Any]] = field(default_factory=list)
    seen_s: list[float] = field(default_factory=list)
    never_seen: int = 0
    joins: int = 0
    leaves: int = 0
    crashes: int = 0


class Swarm:
    def __init__(self, args: Scenario) -> None:
        self.args = args
        self.num_nodes = args.nodes
        self.random = random.Random(args.seed)
        self.config = StateConfig()
        self.one_way: dict[str, float] = {}
        self.net = FakeNetwork(args.seed, Faults(), latency=self._latency, gossip_label=gossip_kind, keep_log=False)
        self.nodes: dict[str, Node] = {}
        self.bootstrap: list[str] = []
        self.watching: list[Watch] = []
        self.report = Report()
        self._num_keys = 0

    def _latency(self, a: str, b: str) -> float:
        return self.one_way.get(a, 0.0) + self.one_way.get(b, 0.0)

    def _seed(self) -> bytes:
        self._num_keys += 1
        return self._num_keys.to_bytes(4, "big") + bytes(self.random.getrandbits(8) for _ in range(28))

    async def join(self, nursery: trio.Nursery) -> Node:
        seed = self._seed()
        host = self.net.add_host(seed, peer_ttl_s=self.config.peer_ttl_s)
        self.one_way[host.peer_id] = self.random.uniform(*ONE_WAY_S)
        host.behind_nat = len(self.bootstrap) >= NUM_BOOTSTRAP and self.random.random() < self.args.nat
        state = RunState(RUN)
        if not self.nodes:
            state.create_manifest(Manifest(RUN, "scale", host.peer_id, 1.7e9), seed)
        service = RunService(
            host,
            state,
            host.peers,
            role="trainer",
            heartbeat_interval_s=self.config.heartbeat_interval_s,
            anti_entropy_interval_s=self.config.anti_entropy_interval_s,
            dial_timeout_s=DIAL_TIMEOUT_S,
        )
        scope = await nursery.start(self._live, service)
        node = Node(host, service, scope, trio.current_time())
        self.nodes[host.peer_id] = node
        for peer_id in self.bootstrap:  # as the daemon's --bootstrap
            if peer_id in self.net.hosts:
                await host.connect(PeerAddrs(peer_id, ()), timeout_s=DIAL_TIMEOUT_S)
        if len(self.bootstrap) < NUM_BOOTSTRAP:
            self.bootstrap.append(host.peer_id)
        address = f"/ip4/10.{self._num_keys >> 16 & 255}.{self._num_keys >> 8 & 255}.{self._num_keys & 255}/tcp/4001"
        record = MemberRecord(host.peer_id, (address,), "trainer", "cpu", 1 << 30, 1.7e9, 1)
        await service.push(state.put_member(sign_member(record, seed, RUN)))
        return node

    @staticmethod
    async def _live(service: RunService, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        with trio.CancelScope() as scope:
            task_status.started(scope)
            await service.run()

    async def leave(self, node: Node, *, graceful: bool) -> None:
        if graceful:
            await node.service.say_bye()
            self.report.leaves += 1
        else:
            self.report.crashes += 1
        node.scope.cancel()
        del self.nodes[node.host.peer_id]
        self.net.remove_host(node.host.peer_id)

    async def churn(self, nursery: trio.Nursery, until: float) -> None:
        """One node replaced at exponential intervals: ``--churn`` of the nodes an hour."""
        rate_per_s = self.args.churn * self.num_nodes / 3600.0
        if rate_per_s <= 0:
            return
        while True:
            await trio.sleep(self.random.expovariate(rate_per_s))
            if trio.current_time() >= until:
                return
            candidates = [p for p in self.nodes if p not in self.bootstrap]
            if candidates:
                leaving = self.nodes[self.random.choice(sorted(candidates))]
                await self.leave(leaving, graceful=self.random.random() < 0.5)
            node = await self.join(nursery)
            self.report.joins += 1
            if trio.current_time() >= self.args.warmup_s:
                self.watching.append(Watch(node.host.peer_id, trio.current_time()))

    async def watch_spread(self) -> None:
        """Each second: which watched newcomers 99% of the live nodes now hold."""
        while True:
            await trio.sleep(1.0)
            now = trio.current_time()
            kept = []
            for watch in self.watching[:MAX_WATCHED]:
                if watch.peer_id not in self.nodes:
                    self.report.never_seen += 1  # gone before it spread
                    continue
                others = [n for p, n in self.nodes.items() if p != watch.peer_id]
                holding = sum(1 for n in others if n.service.state.has_member(watch.peer_id))
                if holding >= SEEN_SHARE * len(others):
                    self.report.seen_s.append(now - watch.since)
                else:
                    kept.append(watch)
            self.watching = kept + self.watching[MAX_WATCHED:]

    async def sample(self, until: float) -> None:
        """Every ``--sample-s``: each node's traffic over the window, and a sample's view."""
        window_s = self.args.sample_s
        last = self._traffic()
        while trio.current_time() + window_s <= until + 1e-9:
            began = trio.current_time()
            await trio.sleep(window_s)
            now = self._traffic()
            whole = [p for p, n in self.nodes.items() if n.since <= began]
            rates_in, rates_out = [], []
            by_label: dict[str, float] = {}
            for peer_id in whole:
                got, sent = 0, 0
                for label, (b_in, b_out) in now.get(peer_id, {}).items():
                    a_in, a_out = last.get(peer_id, {}).get(label, (0, 0))
                    got, sent = got + b_in - a_in, sent + b_out - a_out
                    by_label[label] = by_label.get(label, 0.0) + (b_in - a_in + b_out - a_out) / window_s
                rates_in.append(got / window_s)
                rates_out.append(sent / window_s)
            sampled = self.random.sample(sorted(whole), min(16, len(whole)))
            live = len(self.nodes) - 1
            self.report.windows.append(
                {
                    "at_s": round(trio.current_time()),
                    "nodes": len(self.nodes),
                    "in_bps_median": _median(rates_in),
                    "in_bps_p99": percentile(rates_in, 0.99),
                    "out_bps_median": _median(rates_out),
                    "out_bps_p99": percentile(rates_out, 0.99),
                    "bps_by_label": {k: round(v / max(1, len(whole))) for k, v in sorted(by_label.items())},
                    "doc_nbytes": _median([len(self.nodes[p].service.state.encode()) for p in sampled]),
                    "members_in_doc": _median([len(self.nodes[p].service.state.members) for p in sampled]),
                    "view": _median([len(self.nodes[p].host.peers.live()) / max(1, live) for p in sampled]),
                }
            )
            last = now

    def _traffic(self) -> dict[str, dict[str, tuple[int, int]]]:
        out: dict[str, dict[str, tuple[int, int]]] = {}
        for (peer_id, label), (b_in, b_out) in self.net.traffic.items():
            out.setdefault(peer_id, {})[label] = (b_in, b_out)
        return out


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan


async def run(args: Scenario) -> dict[str, Any]:
    swarm = Swarm(args)
    virtual_s = args.minutes * 60.0
    async with swarm.net.running(), trio.open_nursery() as nursery:
        # The first nodes come over the first minute (a run announced, people starting).
        spacing_s = min(60.0, virtual_s / 4) / args.nodes
        for _ in range(args.nodes):
            await swarm.join(nursery)
            await trio.sleep(swarm.random.uniform(0, 2 * spacing_s))
        nursery.start_soon(swarm.churn, nursery, virtual_s)
        nursery.start_soon(swarm.watch_spread)
        await swarm.sample(virtual_s)
        nursery.cancel_scope.cancel()
    report = swarm.report
    return {
        "nodes": args.nodes,
        "windows": report.windows,
        "seen_99_s": {
            "median": _median(report.seen_s),
            "max": max(report.seen_s, default=math.nan),
            "count": len(report.seen_s),
            "never": report.never_seen + len(swarm.watching),
        },
        "joins": report.joins,
        "leaves": report.leaves,
        "crashes": report.crashes,
        "events": dict(sorted(swarm.net.fates.items())),
    }


def simulate(scenario: Scenario) -> dict[str, Any]:
    """One scenario under trio's autojump clock: the JSON object the module docstring names."""
    random.seed(scenario.seed)  # the services' own draws (anti-entropy's peer, pauses)
    wall, cpu = time.perf_counter(), time.process_time()
    result = trio.run(run, scenario, clock=trio.testing.MockClock(autojump_threshold=0))
    result["virtual_s"] = scenario.minutes * 60.0
    result["wall_s"] = round(time.perf_counter() - wall, 1)
    result["cpu_s"] = round(time.process_time() - cpu, 1)
    result["summary"] = summary(result["windows"], scenario.warmup_s)
    return result


def summary(windows: list[dict[str, Any]], skip_s: float) -> dict[str, Any]:
    """The windows after the warm-up, in one line each figure (medians of the windows')."""
    kept = [w for w in windows if w["at_s"] > skip_s] or windows
    keys = ("in_bps_median", "in_bps_p99", "out_bps_median", "out_bps_p99", "doc_nbytes", "view", "members_in_doc")
    out: dict[str, Any] = {k: round(_median([w[k] for w in kept]), 3) for k in keys}
    labels = sorted({label for w in kept for label in w["bps_by_label"]})
    out["bps_by_label"] = {label: round(_median([w["bps_by_label"].get(label, 0) for w in kept])) for label in labels}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--minutes", type=float, default=10.0, help="virtual minutes per run")
    parser.add_argument("--nat", type=float, default=0.25, help="share of nodes behind NAT")
    parser.add_argument("--churn", type=float, default=0.25, help="share of the nodes replaced per hour")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--sample-s", type=float, default=60.0)
    parser.add_argument("--warmup-s", type=float, default=120.0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    for num_nodes in args.nodes:
        scenario = Scenario(num_nodes, args.minutes, args.nat, args.churn, args.seed, args.sample_s, args.warmup_s)
        print(json.dumps(simulate(scenario)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
