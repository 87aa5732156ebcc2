"""SPES, daemon side: NoLoCo on the shared weights, leased experts published and fetched.

Each round boundary (the worker's ``round_done``), on top of NoLoCo's pairing for the
shared weights (node/algorithms/noloco/):
1. our owned experts, just written to the experts block by the worker, are published as
   this round's versions (node/algorithms/spes/experts.py: signed heads, served to anyone);
2. the lease rule runs (node/algorithms/spes/leases.py) over the live trainers that have
   not lapsed, and we claim what it gives us; what our best-known claims name us owner of
   is what the worker trains next round;
3. every frozen expert (and one we just gained) whose newest fetched version is newer than
   the worker's copy goes into its slot, and ``outer_go`` names those (``swap``) with the
   owned set. A version the worker refuses (non-finite, out of bounds) bans its signer.
Versions arrive in the background: every live trainer is asked for its heads every half
second and versions newer than ours, signed by the expert's owner now, are fetched (two at
a time), so there is no barrier: a slow owner delays nobody, and a node that missed
versions takes the newest at its next boundary. Joiners and restarts get their state as
NoLoCo's do (node/algorithms/joining.py: the saved state holds every expert), then the
versions published since.
"""

import logging
from functools import partial
from typing import Any

import numpy as np
import trio

from node.algorithms.base import Context, thinned
from node.algorithms.noloco import Noloco
from node.algorithms.spes.experts import MAX_PARALLEL_FETCHES, ExpertStore, Head
from node.algorithms.spes.leases import LeaseKeeper, Progress, still_training
from node.supervisor import WorkerConnection, WorkerGone, attach_block, close_block
from protocol.net.data_channel import DataChannel
from protocol.net.peers import BAN_POINTS
from protocol.runstate.state import MAX_EXPERTS
from training.encodings import expert_versions
from training.encodings.experts import Chain

logger = logging.getLogger("node.training")

# Before its first round a node asks every live trainer for its heads, at most this long.
OPENING_ASK_S = 10.0
# Versions of rounds at most this far past ours are taken (ZO's window is the same).
MAX_VERSION_ROUNDS_AHEAD = 16


class Spes(Noloco):
    REPORT_KEYS = (
        *Noloco.REPORT_KEYS,
        *("owned_experts", "trainable_params", "total_params", "optimizer_state_bytes", "grad_bytes"),
        *("expert_versions_fetched", "expert_versions_refused", "expert_bytes_sent", "expert_bytes_received"),
        *("memory_curve", "leases", "releases"),
    )

    def overlap_share(self) -> float:
        return 0.0  # its worker waits at each boundary (experts change owner there)

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.channel = DataChannel(*ctx.listen_ips, per_peer=MAX_PARALLEL_FETCHES, hashed=True)
        """Where the versions we fetch arrive (experts.py: why not on libp2p streams)."""
        self.store = ExpertStore(ctx.host, ctx.state.run_id, upload_limit=ctx.upload_limit, channel=self.channel)
        self.versions = expert_versions(ctx.run.compression)
        """How versions travel: float32, int8, or keyframes and deltas (training/encodings/experts.py)."""
        self._chains: dict[int, Chain] = {}
        """Our public copy of each expert we own and publish (deltas are against it)."""
        self._public: dict[int, tuple[bytes, np.ndarray]] = {}
        """The sha256 and values of the version of each frozen expert we last decoded: a
        delta onto it is applied alone, not its chain from the keyframe."""
        self.expert_numel = 0
        """Float32 values of one expert (known once the worker is ready)."""
        self.keeper = LeaseKeeper(
            ctx.state,
            seed=ctx.identity_seed,
            peer_id=ctx.host.peer_id,
            lapse_rounds=ctx.run.spes.lapse_rounds,
            banned=ctx.host.peers.is_banned,
        )
        self.owned: list[int] = []
        """What the worker trains (this round)."""
        self._published: list[int] = []
        """The experts we published at our last round's end (again, as of a later round, if
        the worker then skips rounds)."""
        self._worker_rounds: list[int] = []
        """The round of the version the worker holds of each expert (-1: genesis)."""
        self._swapped: dict[int, Head] = {}
        """This round's swaps: what the worker was handed, to blame a refused version's signer."""
        self._block: Any = None
        self.versions_refused = 0
        self._listening: tuple[int, float] | None = None
        """Our round and the time when our first worker was ready (we began asking owners)."""
        self.memory_curve: list[list[int]] = []
        """[round, experts owned, gradient bytes, optimizer-state bytes] at each round's end."""

    async def serve(self, nursery: trio.Nursery) -> None:
        await super().serve(nursery)
        await nursery.start(self.channel.run)  # listening before the first fetch offers it
        self.forward_data_port(self.channel.port)  # a node public through UPnP: holders reach it
        self.store.register()
        nursery.start_soon(self.store.sync_forever, self.ctx.partners, self._wanted)

    async def _session(self, worker: WorkerConnection) -> None:
        try:
            await super()._session(worker)
        finally:
            self.store.training = False  # finished, or the worker is gone: no leases for us meanwhile

    def _wanted(self, head: Head) -> bool:
        """A version signed by the expert's owner in our view, of an expert we do not train,
        for a round not far past ours (the signer picks the round: a version of round 2**40
        would stand above every honest one for good)."""
        lease = self.keeper.lease(head.expert)
        return (
            lease is not None
            and lease.owner == head.owner
            and head.expert not in self.owned
            and head.round <= self.store.round + MAX_VERSION_ROUNDS_AHEAD
        )

    def ready(self, worker: WorkerConnection) -> None:
        fields = worker.ready
        num_experts, nbytes = fields.get("num_experts"), fields.get("expert_nbytes")
        if not (
            type(num_experts) is int
            and 0 < num_experts <= MAX_EXPERTS
            and type(nbytes) is int
            and nbytes > 0
            and nbytes % 4 == 0
        ):
            raise WorkerGone(f"a SPES worker's ready names {num_experts!r} experts of {nbytes!r} bytes")
        held = fields.get("held_rounds")
        self.expert_numel = nbytes // 4  # float32 values
        numel, versions = nbytes // 4, self.versions
        self.store.configure(
            num_experts,
            *versions.sizes(numel),
            link=lambda wire: versions.link(wire, numel),
            max_chain=versions.chain,
        )
        self.keeper.num_experts = num_experts
        self._worker_rounds = list(held) if isinstance(held, list) and len(held) == num_experts else [-1] * num_experts
        if self._block is not None:
            close_block(self._block)
        self._block = attach_block(str(fields.get("experts")))
        super().ready(worker)

    async def opening(self, worker: WorkerConnection) -> None:
        self.store.round = worker.start_round
        self.store.training = True
        if self._listening is None:
            self._listening = (worker.start_round, trio.current_time())
        # Hear from every owner once before the rule runs: a joiner that had not asked anyone
        # yet took the live owners for silent and claimed every expert for a round.
        with trio.move_on_after(OPENING_ASK_S):
            await self.store.sync_once(self.ctx.partners(), self._wanted)
        self.owned = await self._lease(worker.start_round)
        await worker.send("setup", owned=self.owned)

    async def _lease(self, round_index: int) -> list[int]:
        """Run the rule, write our claims, and say what we train now."""
        store = self.store
        training = still_training(store.peers_training, store.reported, self.ctx.run.round_limit)
        listening = self._listening or (round_index, trio.current_time())
        progress = Progress(store.newest_by_owner, store.reported, store.answered, listening, training)
        active = self.keeper.active(self.ctx.partners(), progress, round_index, now=trio.current_time())
        updates = self.keeper.claims(self.keeper.owners(active), round_index)
        fights, self.keeper.fights = self.keeper.fights, []
        for peer, why in fights:
            await self.ctx.host.punish(peer, f"expert lease war: {why}")
        if self.ctx.run_service is not None:
            for update in updates:
                await self.ctx.run_service.push(update)
        return self.keeper.mine()

    async def exchange(
        self, worker: WorkerConnection, done: dict[str, Any], outbox: memoryview, inbox: memoryview
    ) -> None:
        round_index = int(done["round"])
        memory = self.ctx.metrics.memory
        self.memory_curve.append(
            [round_index, len(self.owned), memory.get("grad_bytes", 0), memory.get("optimizer_state_bytes", 0)]
        )
        self._published = list(self.owned)
        await self._publish(self._published, round_index)
        self._chains = {e: c for e, c in self._chains.items() if e in self._published}  # ours no more: gone
        self.store.round = round_index + 1
        await super().exchange(worker, done, outbox, inbox)

    async def _publish(self, experts: list[int], round_index: int) -> None:
        """Our versions of ``experts`` (owned: the worker wrote them to the experts block at
        its round's end) as of ``round_index``."""
        nbytes = 4 * self.expert_numel
        raw = [bytes(self._block.buf[expert * nbytes : (expert + 1) * nbytes]) for expert in experts]
        # A chain goes on only from our own newest version (a new owner, or one that lost
        # and took back an expert, starts one from a keyframe).
        chains = []
        for expert in experts:
            chain, held = self._chains.get(expert), self.store.held.get(expert)
            ours = held is not None and held.head.owner == self.ctx.host.peer_id
            chains.append(
                chain if chain is not None and held is not None and ours and held.head.sha256 == chain.sha256 else None
            )
        # Off the event loop: a gpt-125m-moe expert is 28 M values (~0.8 s to encode on a busy core).
        encoded = await trio.to_thread.run_sync(
            lambda: [self.versions.encode_next(data, chain) for data, chain in zip(raw, chains, strict=True)]
        )
        for expert in experts:
            self._chains.pop(expert, None)
        for expert, weights, (data, chain) in zip(experts, raw, encoded, strict=True):
            try:
                self.store.publish(self.ctx.identity_seed, expert, round_index, data)
            except ValueError:
                # A fetch replaced our newest version of it while we encoded (a hand-over
                # under way): the delta has no base here now; a new chain instead.
                data, chain = await trio.to_thread.run_sync(self.versions.encode_next, weights, None)
                self.store.publish(self.ctx.identity_seed, expert, round_index, data)
            self._worker_rounds[expert] = round_index
            if chain is not None:
                self._chains[expert] = chain

    async def _skipped(self, round_index: int, skipped: int) -> None:
        """The worker left out ``skipped`` rounds after ``round_index`` to catch up with its
        peers: our round is that much later, and so is our newest version. Without that, by
        the lease rule, an owner whose round is ``lapse_rounds`` past its newest version has
        lapsed (leases.py): its experts would be taken at each skip. The experts published at
        ``round_index`` that we still own go again, as of the last round skipped (their
        weights, as the worker left them; a chained codec sends what its last delta left
        out)."""
        again = [expert for expert in self._published if expert in self.owned]
        if again:
            await self._publish(again, round_index + skipped)
        self.store.round = max(self.store.round, round_index + 1 + skipped)

    async def outer_fields(self, round_index: int) -> dict[str, Any]:
        trained = set(self.owned)
        self.owned = await self._lease(round_index + 1)
        nbytes = 4 * self.expert_numel
        swaps = []
        self._swapped = {}
        banned = False
        for expert, held in sorted(self.store.held.items()):
            if expert in trained or held.head.owner == self.ctx.host.peer_id:
                continue  # the worker trained it this round (or it is our own): its copy is the newest
            if held.head.round <= self._worker_rounds[expert]:
                continue
            versions, base, base_depth = held.versions(), None, 0
            cached = self._public.pop(expert, None)
            at = None if cached is None else held.find(cached[0])
            if cached is not None and at is not None and at + 1 < len(versions):
                # What we decoded last (``at`` deltas past the chain's keyframe), and the deltas since.
                versions, base, base_depth = versions[at + 1 :], cached[1], at
            try:  # off the event loop, as encoding is
                values = await trio.to_thread.run_sync(
                    partial(self.versions.decode_chain, versions, self.expert_numel, base=base, base_depth=base_depth)
                )
            except ValueError as exc:  # signed by its owner (each version back to the keyframe): its own doing
                self.versions_refused += 1
                self.store.forget(held.head)
                logger.warning("refused expert %d's version from %s undecoded: %s", expert, held.head.owner, exc)
                await self.ctx.host.punish(held.head.owner, f"expert version refused: {exc}", points=BAN_POINTS)
                banned = True
                continue
            if self.versions.chain > 1:  # only a chain's next delta needs it (a float32 copy an expert)
                self._public[expert] = (held.head.sha256, values)
            self._block.buf[expert * nbytes : (expert + 1) * nbytes] = values.tobytes()
            swaps.append([expert, held.head.round])
            self._swapped[expert] = held.head
        if banned:
            # Its experts are claimed now, as ``judge`` does after a ban (after the last round
            # there is no next one to do it).
            self.owned = await self._lease(round_index + 1)
        return {"owned": self.owned, "swap": swaps}

    async def judge(self, done: dict[str, Any]) -> None:
        await super().judge(done)
        skipped = done.get("skipped")
        if type(skipped) is int and 0 < skipped < self.ctx.run.round_limit:
            await self._skipped(int(done["round"]), skipped)
        refused = done.get("rejected_experts") or []
        refused_experts = set()
        for item in refused if isinstance(refused, list) else []:
            expert, reason = (item[0], item[2]) if isinstance(item, list) and len(item) == 3 else (None, None)
            head = self._swapped.get(expert) if type(expert) is int else None
            if head is None:
                continue
            refused_experts.add(expert)
            self.versions_refused += 1
            self.store.forget(head)
            self._public.pop(head.expert, None)
            logger.warning(
                "round %s: refused expert %d's version from %s: %s", done.get("round"), expert, head.owner, reason
            )
            await self.ctx.host.punish(head.owner, f"expert version refused: {str(reason)[:200]}", points=BAN_POINTS)
        for expert, head in self._swapped.items():
            if expert not in refused_experts:
                self._worker_rounds[expert] = head.round
        self._swapped = {}
        if refused_experts:
            # The banned owner's experts are claimed now, not at our next round: after the
            # last round there is none, and the run would end with its leases standing
            # (seen once in a full test run). What we train changes at the next round.
            await self._lease(self.store.round)

    def traffic(self) -> dict[str, Any]:
        shared = super().traffic()
        return {
            "bytes_sent": shared["bytes_sent"] + self.store.bytes_sent,
            "bytes_received": shared["bytes_received"] + self.store.bytes_received,
        }

    def status(self) -> dict[str, Any]:
        memory = self.ctx.metrics.memory
        return {
            **super().status(),
            "owned_experts": list(self.owned),
            "trainable_params": memory.get("trainable_params"),
            "total_params": memory.get("total_params"),
            "optimizer_state_bytes": memory.get("optimizer_state_bytes"),
            "grad_bytes": memory.get("grad_bytes"),
            "expert_versions_fetched": self.store.fetched,
            "expert_versions_refused": self.versions_refused,
            "expert_bytes_sent": self.store.bytes_sent,
            "expert_bytes_received": self.store.bytes_received,
            "memory_curve": thinned(self.memory_curve),
            "leases": {str(e): [r.owner, r.epoch] for e, r in sorted(self.keeper.view().items())},
            "releases": [r.report() for r in self.keeper.releases],
        }

    @staticmethod
    def summary(statuses: list[dict[str, Any]]) -> dict[str, Any]:
        """Top-level report: each expert's owner at the end (the best claim any node saw)
        and every hand-over any node saw (once each)."""
        best: dict[str, tuple[int, str]] = {}
        for status in statuses:
            for expert, (owner, epoch) in (status.get("leases") or {}).items():
                if expert not in best or epoch > best[expert][0]:
                    best[expert] = (epoch, owner)
        releases: dict[tuple[Any, ...], dict[str, Any]] = {}
        for status in statuses:
            for release in status.get("releases") or []:
                releases.setdefault((release["expert"], release["to"], release["round"]), release)
        return {
            "expert_owners": {e: owner for e, (_, owner) in sorted(best.items(), key=lambda kv: int(kv[0]))},
            "releases": sorted(releases.values(), key=lambda r: (r["round"], r["expert"])),
        }


ALGORITHM = Spes
