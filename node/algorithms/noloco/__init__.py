"""NoLoCo, daemon side: each round, one random live trainer as partner (node/algorithms/noloco/pairing.py:
bounded wait; with nobody free, a one-way pull of a peer's payload of the round; then
alone); its payload lands in the worker's inbox. A payload the worker
refuses (non-finite, far out of the partner bounds) bans its sender; one just out of them
(a replica that drifted) costs a point, and when our worker refuses several peers in a row
that way the replica that drifted is ours: we take a peer's state (``PayloadRounds._resync``)."""

import logging
from typing import Any

import trio

from node.algorithms.base import Context
from node.algorithms.noloco.lag import catch_up_steps, rounds_to_skip, skip_horizon
from node.algorithms.noloco.pairing import Pairing
from node.algorithms.rounds import SEND_TIMEOUT_S, Inbox, PayloadRounds
from node.supervisor import WorkerConnection

logger = logging.getLogger("node.training")

# Payloads refused as drifted (too far from ours, by less than an attack's margin) since our
# worker last used one: from this many distinct partners, or this many in all, our replica is
# the odd one out and takes a peer's state. One partner could be the one that drifted; two
# that agree with each other and not with us point at us. An honest pair that drifted apart
# met 5 rounds in a row in a 3-node test (each refusal a point: a ban before either met
# anyone else), so the same partner refused again counts too: each side then takes the
# state of a peer it has not refused (not of the one that may have drifted). A stranger
# cannot drive this far: past the margin its payload bans it, and within it each refusal
# costs it a point.
RESYNC_AFTER_PEERS = 2
RESYNC_AFTER_REFUSALS = 3


class Noloco(PayloadRounds):
    REPORT_KEYS = (
        *PayloadRounds.REPORT_KEYS,
        "rounds_pulled",
        "pulls_served",
        "resyncs",
        "rounds_shortened",
        "rounds_skipped",
    )

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.pairing = Pairing(
            ctx.host,
            send_timeout_s=SEND_TIMEOUT_S,
            is_member=ctx.is_member,
            upload_limit=ctx.upload_limit,
            rounds=ctx.run.round_limit,
            schedule_seed=ctx.state.run_id,
            prefer_share=ctx.run.outer.overlap,
            overlap=self.overlap_share(),
        )
        self._partner: str | None = None
        """This round's partner, until the worker's outer step says what it made of it."""
        self.rounds_pulled = 0
        """Rounds whose partner payload was a pull (nobody was free to pair)."""
        self.rounds_shortened = 0
        """Rounds we took fewer than H steps in, to keep up with peers ahead of us."""
        self._drifted_from: list[str] = []
        """Partners whose payloads our worker refused as drifted since it last used one."""

    def ready(self, worker: WorkerConnection) -> None:
        self.pairing.worker_started()

    def joining(self, waiting: bool) -> None:
        self.pairing.joining = waiting

    def overlap_share(self) -> float:
        """The share of a round's steps our worker takes while we pair (training/algorithms/
        noloco.py runs its rounds overlapped; SPES's worker waits at each boundary)."""
        steps = self.ctx.run.inner.steps_per_round
        return self.ctx.run.outer.overlap_steps(steps) / steps if steps > 0 else 0.0

    def round_time_s(self) -> float | None:
        return self.pairing.round_s

    def inbox(self) -> Inbox:
        return self.pairing

    async def serve(self, nursery: Any) -> None:
        await nursery.start(self.pairing.run)

    def traffic(self) -> dict[str, Any]:
        return {"bytes_sent": self.pairing.bytes_sent, "bytes_received": self.pairing.bytes_received}

    def status(self) -> dict[str, Any]:
        return {
            **super().status(),
            "rounds_pulled": self.rounds_pulled,
            "pulls_served": self.pairing.pulls_served,
            "resyncs": self.resyncs,
            "rounds_shortened": self.rounds_shortened,
            "rounds_skipped": self.rounds_skipped,
        }

    async def linger(self) -> None:
        # A node a moment behind (a joiner: about a second) pulls our last round's payload
        # from the outbox, which the worker keeps until it is stopped; its wait for a
        # partner is bounded by the same setting.
        await trio.sleep(self.ctx.config.pair_timeout_s)

    async def release_outbox(self, *, grace: bool = True) -> None:
        await self.pairing.close_pulls(grace=grace)

    async def exchange(
        self, worker: WorkerConnection, done: dict[str, Any], outbox: memoryview, inbox: memoryview
    ) -> None:
        round_index = int(done["round"])
        self._partner = await self.pairing.find_partner(
            round_index, outbox, inbox, self.ctx.partners(), timeout_s=self.ctx.config.pair_timeout_s
        )
        partner = self._partner
        pulled = partner is not None and self.pairing.last_pulled
        self.rounds_pulled += int(pulled)
        logger.info(
            "round %d: val loss %.3f, %s",
            round_index,
            done["val_loss"],
            (f"pulled from {partner}" if pulled else f"paired with {partner}") if partner else "alone",
        )
        # Behind our peers (a slower machine, a late start): a shorter next round, to keep
        # to their rounds, where a partner (or a pull a round ahead) can still be found.
        # Further behind than a pull reaches: on to their round (the worker says how many
        # rounds it skipped: never past the run's last), whole rounds from there.
        # A fraction of a round behind counts too (half or more): two pairs that far apart
        # never meet (lag.py ``CATCH_UP_FROM``).
        lead = self.pairing.lead
        lag, skipped = self.pairing.vouched_lag, self.rounds_skipped
        skip = rounds_to_skip(lag, skipped=skipped, rounds=skip_horizon(self.ctx.run.rounds, round_index, lag))
        steps = catch_up_steps(self.ctx.run.inner.steps_per_round, lead - skip)
        if steps < self.ctx.run.inner.steps_per_round:
            self.rounds_shortened += 1
        if steps < self.ctx.run.inner.steps_per_round or skip:
            self.pairing.caught_up(steps / self.ctx.run.inner.steps_per_round)
            logger.info(
                "round %d: peers %.2f round(s) ahead: %d round(s) skipped, %d steps next round",
                round_index,
                lead,
                skip,
                steps,
            )
        await worker.send(
            "outer_go",
            round=round_index,
            peer=partner is not None,
            steps=steps,
            skip=skip,
            **await self.outer_fields(round_index),
        )

    async def outer_fields(self, round_index: int) -> dict[str, Any]:
        """More for this round's ``outer_go`` (SPES: experts to train and to swap in)."""
        return {}

    async def judge(self, done: dict[str, Any]) -> None:
        rejected = done.get("rejected")
        if self._partner is not None and isinstance(rejected, str):
            logger.warning("round %s: refused %s's payload: %s", done.get("round"), self._partner, rejected)
            self.ctx.metrics.payloads_refused += 1
            await self.punish_refused(self._partner, "NoLoCo", rejected, drifted=done.get("drifted"))
            if done.get("drifted") is True:
                self._drifted_from.append(self._partner)
        elif done.get("used_peer") is True:
            self._drifted_from.clear()
        refused = self._drifted_from
        if len(set(refused)) >= RESYNC_AFTER_PEERS or len(refused) >= RESYNC_AFTER_REFUSALS:
            self.resync_reason = f"{len(refused)} payloads of {len(set(refused))} partners in a row too far from ours"
            self.not_from = set(refused)
            refused.clear()
        self._partner = None


ALGORITHM = Noloco
