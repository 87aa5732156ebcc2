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

With ``--algorithm noloco`` every node also trains, as far as the network sees it: the
daemon's own ``Pairing`` (the schedule, asks, pulls, its lead and lag) and a
``TensorReceiver`` for payloads, driven by a stand-in worker that computes nothing. Each
node draws a speed (a round of ``--round-s`` × 0.8–1.2); at each boundary it pairs for its
round (``pair_timeout_s`` as the daemon's default), turns its peers' lead into a shorter
next round or skipped rounds as node/algorithms/noloco/__init__.py does (lag.py's rules),
and reaches its next boundary when ``next_boundary`` says (the run's ``outer.overlap`` of
the steps go on while it pairs). Payloads are ``--payload-nbytes`` of zeros over the
exchange protocol (their bytes are counted apart from control bytes). A newcomer starts at
the round two of its bootstrap nodes vouch for (joining.py ``vouched_round``), as if its
state fetch took no time. Candidates are a node's live trainer members, as the daemon's.

What it does not model: libp2p's Kademlia and GossipSub themselves (gossip reaches every
subscriber; its cost is the mesh model above; the real stack is measured by bench/soak.py
and ``simulate``), relays' capacity and hole punching, connection limits, Noise and yamux's
CPU, upload caps, the worker's compute and the outer step (a boundary comes on the clock),
state fetches of joiners, the ZO log and SPES leases.

Per N it prints one JSON object:
    nodes, virtual_s, wall_s, cpu_s (this process), events (deliveries);
    control_bps: per node, bytes per second in and out (median, p99; nodes up for a
      whole sample window; payloads left out), and per label (heartbeat, update, bye,
      state sync, pairing, payloads, ...): the mean per node;
    doc_nbytes: the run document's encoding at sampled nodes, per sample window (median);
    view: the share of the live nodes a node sees as live (median over sampled nodes);
    members_in_doc: records in the document (median over sampled nodes);
    seen_99_s: per newcomer after the warm-up, the seconds until 99% of the live nodes
      hold its member record (median, max; "never" counted apart);
    joins, leaves, crashes;
    training (``--algorithm noloco``): rounds after the warm-up, over all nodes, and their
      shares paired, pulled (both: with a partner) and alone; rounds skipped and shortened;
      the per-node share with a partner (median, p1; nodes with 5 such rounds or more).

    python bench/scale.py --nodes 16 64 256 [--minutes 30] [--nat 0.25] [--churn 0.25]
                          [--seed 1] [--sample-s 60] [--warmup-s 120]
                          [--algorithm noloco] [--round-s 30] [--payload-nbytes 4096]
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

from node.algorithms.joining import vouched_round
from node.algorithms.noloco.lag import catch_up_steps, rounds_to_skip, skip_horizon
from node.algorithms.noloco.pairing import Pairing, next_boundary
from node.algorithms.rounds import SEND_TIMEOUT_S
from node.config import StateConfig, TrainingConfig
from protocol.net import exchange, gossip
from protocol.net.exchange import TensorReceiver
from protocol.net.hostlike import PeerAddrs
from protocol.net.memnet import FakeHost, FakeNetwork, Faults
from protocol.runstate.run import RunService
from protocol.runstate.state import Manifest, MemberRecord, RunState, sign_member
from training.settings import InnerConfig, OuterConfig

RUN = "scale-abc123"
NUM_BOOTSTRAP = 3
DIAL_TIMEOUT_S = 10.0
ONE_WAY_S = (0.005, 0.1)
SEEN_SHARE = 0.99
# Joiners whose spread is still watched at once (each look costs O(N)).
MAX_WATCHED = 64
ALGORITHMS = ("none", "noloco")
# A node's speed: its round takes the scenario's round time times a uniform draw from this.
SPEED_SPREAD = (0.8, 1.2)
# Bootstrap nodes a newcomer asks which round to start at (vouched_round needs two).
JOIN_ASKS = 3
# A node's share of rounds with a partner is reported for nodes with at least this many rounds.
MIN_ROUNDS_PER_NODE = 5
# Labels whose bytes are training payloads, not control traffic.
PAYLOAD_LABELS = frozenset({exchange.PROTOCOL_ID})


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
    algorithm: str = "none"
    """``none``: run state only; ``noloco``: nodes also pair for rounds (the module docstring)."""
    round_s: float = 30.0
    """A round's computing time at speed 1 (``noloco``)."""
    payload_nbytes: int = 4096
    """A NoLoCo payload's size (``noloco``): small, since payload bytes are not what is measured."""

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm: one of {ALGORITHMS}, got {self.algorithm!r}")


@dataclass(slots=True)
class Trainer:
    """A node's stand-in worker and its pairing: rounds on the clock, no compute."""

    pairing: Pairing
    step_s: float
    """Seconds per inner step on this node."""
    round_index: int
    """The round whose boundary it computes towards."""
    outbox: memoryview
    inbox: memoryview
    overlap: float
    """The share of a round's steps the worker takes while the node pairs."""
    skipped: int = 0


@dataclass(slots=True)
class Node:
    host: FakeHost
    service: RunService
    scope: trio.CancelScope
    since: float
    trainer: Trainer | None = None


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
    rounds: dict[str, dict[str, int]] = field(default_factory=dict)
    """Per node (its id), after the warm-up: rounds, paired, pulled, alone, skipped, shortened."""


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
        trainer = self._trainer(host, state) if self.args.algorithm == "noloco" else None
        node = Node(host, service, trio.CancelScope(), trio.current_time(), trainer)
        node.scope = await nursery.start(self._live, node)
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

    def _trainer(self, host: FakeHost, state: RunState) -> Trainer:
        def is_member(peer_id: str) -> bool:
            record = state.members.get(peer_id)
            return record is not None and record.role == "trainer"

        inner, outer = InnerConfig(), OuterConfig()
        overlap = outer.overlap_steps(inner.steps_per_round) / inner.steps_per_round
        pairing = Pairing(
            host,
            send_timeout_s=SEND_TIMEOUT_S,
            is_member=is_member,
            schedule_seed=RUN,
            prefer_share=outer.overlap,
            overlap=overlap,
        )
        TensorReceiver(
            host,
            pairing.accept_payload,
            authorize=pairing.authorize,
            max_payload_nbytes=self.args.payload_nbytes,
            timeout_s=SEND_TIMEOUT_S,
        ).register()
        live = [n.trainer.round_index for n in self.nodes.values() if n.trainer is not None]
        asked = self.random.sample(live, min(JOIN_ASKS, len(live)))
        start = vouched_round(asked) or 0
        step_s = self.args.round_s * self.random.uniform(*SPEED_SPREAD) / inner.steps_per_round
        zeros = memoryview(bytearray(self.args.payload_nbytes))
        return Trainer(pairing, step_s, start, zeros, memoryview(bytearray(self.args.payload_nbytes)), overlap)

    async def _live(self, node: Node, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        with trio.CancelScope() as scope:
            task_status.started(scope)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(node.service.run)
                if node.trainer is not None:
                    await nursery.start(node.trainer.pairing.run)
                    nursery.start_soon(self._train, node, node.trainer)

    def _partners(self, node: Node) -> list[str]:
        """The daemon's candidates (node/training.py ``_partners``): live trainer members."""
        members, peers = node.service.state.members, node.host.peers
        return sorted(
            p
            for p in peers.live()
            if (record := members.get(p)) is not None and record.role == "trainer" and not peers.is_banned(p)
        )

    async def _train(self, node: Node, trainer: Trainer) -> None:
        """The stand-in worker and the daemon's NoLoCo round (node/algorithms/noloco/__init__.py
        ``exchange``) without the outer step: pair at each boundary, then shorten or skip
        by the peers' lead, and reach the next boundary when ``next_boundary`` says."""
        pairing, steps_per_round = trainer.pairing, InnerConfig().steps_per_round
        timeout_s = TrainingConfig().pair_timeout_s
        await trio.sleep(trainer.step_s * steps_per_round)
        while True:
            boundary_at = trio.current_time()
            await pairing.close_pulls()  # the worker's next payload overwrites the outbox
            partner = await pairing.find_partner(
                trainer.round_index, trainer.outbox, trainer.inbox, self._partners(node), timeout_s=timeout_s
            )
            paired_at = trio.current_time()
            lead, lag = pairing.lead, pairing.vouched_lag
            skip = rounds_to_skip(lag, skipped=trainer.skipped, rounds=skip_horizon(0, trainer.round_index, lag))
            steps = catch_up_steps(steps_per_round, lead - skip)
            if steps < steps_per_round or skip:
                pairing.caught_up(steps / steps_per_round)
            trainer.skipped += skip
            if boundary_at >= self.args.warmup_s:
                counts = self.report.rounds.setdefault(node.host.peer_id, dict.fromkeys(ROUND_FIELDS, 0))
                counts["rounds"] += 1
                outcome = "alone" if partner is None else "pulled" if pairing.last_pulled else "paired"
                counts[outcome] += 1
                counts["skipped"] += skip
                counts["shortened"] += int(steps < steps_per_round)
            trainer.round_index += 1 + skip
            compute_s = steps * trainer.step_s
            await trio.sleep_until(next_boundary(boundary_at, paired_at, compute_s, trainer.overlap))

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
                    if label not in PAYLOAD_LABELS:
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


ROUND_FIELDS = ("rounds", "paired", "pulled", "alone", "skipped", "shortened")


def training_summary(rounds: dict[str, dict[str, int]]) -> dict[str, Any]:
    """``Report.rounds`` over all nodes: totals, shares of rounds, and the per-node share
    with a partner (median, p1) among nodes with ``MIN_ROUNDS_PER_NODE`` rounds or more."""
    totals = {k: sum(c[k] for c in rounds.values()) for k in ROUND_FIELDS}
    n = max(1, totals["rounds"])
    kept = [c for c in rounds.values() if c["rounds"] >= MIN_ROUNDS_PER_NODE]
    per_node = [(c["paired"] + c["pulled"]) / c["rounds"] for c in kept]
    return {
        **totals,
        "with_partner_share": round((totals["paired"] + totals["pulled"]) / n, 4),
        "pulled_share": round(totals["pulled"] / n, 4),
        "alone_share": round(totals["alone"] / n, 4),
        "per_node_with_partner": {
            "median": round(_median(per_node), 4),
            "p1": round(percentile(per_node, 0.01), 4),
            "nodes": len(per_node),
        },
    }


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
        **({"training": training_summary(report.rounds)} if args.algorithm != "none" else {}),
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
    parser.add_argument("--algorithm", choices=ALGORITHMS, default="none", help="noloco: nodes pair for rounds too")
    parser.add_argument("--round-s", type=float, default=30.0, help="a round's computing time at speed 1")
    parser.add_argument("--payload-nbytes", type=int, default=4096)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    for num_nodes in args.nodes:
        scenario = Scenario(
            num_nodes,
            args.minutes,
            args.nat,
            args.churn,
            args.seed,
            args.sample_s,
            args.warmup_s,
            args.algorithm,
            args.round_s,
            args.payload_nbytes,
        )
        print(json.dumps(simulate(scenario)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
