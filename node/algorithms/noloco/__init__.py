"""NoLoCo, daemon side: each round, one random live trainer as partner (node/algorithms/noloco/pairing.py:
bounded wait; with nobody free, a one-way pull of a peer's payload of the round; then
alone); its payload lands in the worker's inbox. A payload the worker
refuses (non-finite, out of the partner bounds) bans its sender."""

import logging
from typing import Any

import trio

from node.algorithms.base import Context
from node.algorithms.noloco.pairing import Pairing
from node.algorithms.rounds import SEND_TIMEOUT_S, Inbox, PayloadRounds
from node.supervisor import WorkerConnection

logger = logging.getLogger("node.training")


class Noloco(PayloadRounds):
    REPORT_KEYS = (*PayloadRounds.REPORT_KEYS, "rounds_pulled", "pulls_served")

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.pairing = Pairing(
            ctx.host, send_timeout_s=SEND_TIMEOUT_S, is_member=ctx.is_member, upload_limit=ctx.upload_limit
        )
        self._partner: str | None = None
        """This round's partner, until the worker's outer step says what it made of it."""
        self.rounds_pulled = 0
        """Rounds whose partner payload was a pull (nobody was free to pair)."""

    def inbox(self) -> Inbox:
        return self.pairing

    async def serve(self, nursery: Any) -> None:
        await nursery.start(self.pairing.run)

    def traffic(self) -> dict[str, Any]:
        return {"bytes_sent": self.pairing.bytes_sent, "bytes_received": self.pairing.bytes_received}

    def status(self) -> dict[str, Any]:
        return {**super().status(), "rounds_pulled": self.rounds_pulled, "pulls_served": self.pairing.pulls_served}

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
        await worker.send(
            "outer_go", round=round_index, peer=partner is not None, **await self.outer_fields(round_index)
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
        self._partner = None


ALGORITHM = Noloco
