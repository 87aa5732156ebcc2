"""The DiLoCo baseline over the network: every round, every live trainer's Δ, averaged.

Unlike NoLoCo this needs everyone: at a round boundary we send our payload to every live
trainer and wait (bounded) until each of them sent us theirs for the same round. Peers
reach boundaries at different times, so payloads for later rounds are kept until we get
there. The worker averages the Δs in peer-id order, so every node sums the same way and
all hold the same slow weights. It is the comparison for NoLoCo, and what NoLoCo avoids:
the wait grows with the slowest node, and the traffic with the number of nodes.
"""

import logging
from collections.abc import Callable
from typing import Any

import trio

from node.algorithms.base import Context
from node.algorithms.rounds import SEND_TIMEOUT_S, Inbox, PayloadRounds
from node.supervisor import WorkerConnection, WorkerGone
from protocol.errors import ProtocolError
from protocol.net.exchange import Payload, TensorSpec, send_tensors
from protocol.net.hostlike import TensorHostLike
from protocol.ratelimit import UNLIMITED, RateLimit

logger = logging.getLogger(__name__)

PAYLOAD_NAME = "diloco"
# Rounds ahead of ours whose payloads we keep (a fast peer may be a little ahead).
MAX_ROUNDS_AHEAD = 2


class DilocoExchange:
    def __init__(
        self,
        host: TensorHostLike,
        *,
        send_timeout_s: float,
        is_member: Callable[[str], bool],
        upload_limit: RateLimit = UNLIMITED,
    ) -> None:
        self._host = host
        self._is_member = is_member
        self.payload_nbytes: int | None = None
        """The size every payload of this run has (the worker's); None until it is known."""
        self._send_timeout_s = send_timeout_s
        self._upload_limit = upload_limit
        self._round = 0
        self._received: dict[int, dict[str, bytes]] = {}
        self._changed = trio.Event()
        self.bytes_sent = 0
        self.bytes_received = 0

    def authorize(self, peer_id: str, round_index: int, nbytes: int) -> str | None:
        """TensorReceiver check before any allocation: a member's payload of our size for a
        round we keep, and only one per peer and round."""
        if not self._is_member(peer_id):
            return "not a member of this run"
        # Until our worker said its size (a fast peer may finish round 0 first), a member's
        # payload is taken at any size within the receiver's limit; accept_payload keeps
        # only those of our size.
        if self.payload_nbytes is not None and nbytes != self.payload_nbytes:
            return f"our payload is {self.payload_nbytes} bytes"
        if not self._round <= round_index <= self._round + MAX_ROUNDS_AHEAD:
            return f"we are at round {self._round}"
        if peer_id in self._received.get(round_index, {}):
            return "already have yours for that round"
        return None

    async def accept_payload(self, peer_id: str, payload: Payload) -> None:
        """TensorReceiver callback: keep payloads for this round and the next few."""
        if not self._round <= payload.round <= self._round + MAX_ROUNDS_AHEAD:
            logger.info("ignored %s's payload for round %d (we are at %d)", peer_id, payload.round, self._round)
            return
        if len(payload.specs) != 1 or payload.specs[0].name != PAYLOAD_NAME:
            logger.info("ignored a payload from %s that is not a DiLoCo payload", peer_id)
            return
        self._received.setdefault(payload.round, {})[peer_id] = bytes(payload.data)
        self.bytes_received += len(payload.data)
        self._changed.set()
        self._changed = trio.Event()

    async def gather(
        self, round_index: int, outbox: memoryview, peers: list[str], *, timeout_s: float
    ) -> dict[str, bytes]:
        """Send ours to ``peers`` and collect theirs for this round (those that arrive in time)."""
        self._round = round_index
        for old in [r for r in self._received if r < round_index]:
            del self._received[old]
        payload = Payload(round_index, (TensorSpec(PAYLOAD_NAME, "uint8", (len(outbox),)),), outbox)

        async def send(peer_id: str) -> None:
            try:
                await send_tensors(
                    self._host, peer_id, payload, timeout_s=self._send_timeout_s, limit=self._upload_limit
                )
                self.bytes_sent += len(outbox)
            except ProtocolError as exc:
                logger.info("DiLoCo round %d: sending to %s failed: %s", round_index, peer_id, exc)

        with trio.move_on_after(timeout_s):
            async with trio.open_nursery() as nursery:
                for peer_id in peers:
                    nursery.start_soon(send, peer_id)
                while True:
                    changed = self._changed
                    if set(peers) <= set(self._received.get(round_index, {})):
                        break
                    await changed.wait()
        got = self._received.pop(round_index, {})
        return {peer: data for peer, data in got.items() if len(data) == len(outbox)}


class Diloco(PayloadRounds):
    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.exchanges = DilocoExchange(
            ctx.host, send_timeout_s=SEND_TIMEOUT_S, is_member=ctx.is_member, upload_limit=ctx.upload_limit
        )

    def inbox(self) -> Inbox:
        return self.exchanges

    def ready(self, worker: WorkerConnection) -> None:
        self.exchanges.payload_nbytes = worker.payload_nbytes

    def traffic(self) -> dict[str, Any]:
        return {"bytes_sent": self.exchanges.bytes_sent, "bytes_received": self.exchanges.bytes_received}

    async def exchange(
        self, worker: WorkerConnection, done: dict[str, Any], outbox: memoryview, inbox: memoryview
    ) -> None:
        """Every live trainer's payload, one ``accumulate`` each (a refused one bans its
        sender), then ``outer_go`` with our own key: the worker sums in key order."""
        round_index = int(done["round"])
        payloads = await self.exchanges.gather(
            round_index, outbox, self.ctx.partners(), timeout_s=self.ctx.config.pair_timeout_s
        )
        for peer_id, data in sorted(payloads.items()):
            inbox[:] = data
            await worker.send("accumulate", round=round_index, key=peer_id)
            reply = await worker.receive()
            if reply["t"] != "accumulated":
                raise WorkerGone(f"expected 'accumulated', got {reply['t']!r}")
            if reply.get("ok") is not True:
                await self.punish_refused(peer_id, "DiLoCo", str(reply.get("reason")), drifted=reply.get("drifted"))
        logger.info("round %d: val loss %.3f, DiLoCo over %d nodes", round_index, done["val_loss"], len(payloads) + 1)
        await worker.send("outer_go", round=round_index, key=self.ctx.host.peer_id)


ALGORITHM = Diloco
