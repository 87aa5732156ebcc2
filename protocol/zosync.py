"""Pulling the ZO update log from a peer: ask for what lies beyond our log vector.

Protocol flow (``/swarmtrain/zo-log/1.0.0``), one exchange per stream:

    puller                                              holder
    {t: "want", v: 1, run, have: {peer id: next seq}} ──▶
                                                    ◀── {t: "batches", v: 1, batches: [bytes],
                                                         more}  (the original signed batches
                                                         holding entries beyond ``have``,
                                                         oldest first, at most MAX_BATCHES;
                                                         more: ask again for the rest)

The puller verifies every batch (protocol/zolog.py) before it is stored: a holder cannot
make us accept anything its authors did not sign. A bad batch ends the exchange and the
holder is penalized; batches verified before it are kept (each stands on its own). Gossip
carries new batches as hints; this pull is what makes every log complete.
"""

import logging
from collections.abc import Callable

import trio

from protocol import wire, zolog
from protocol.errors import BadMessage, ProtocolError
from protocol.host import Host, Stream
from protocol.peers import PeerTable

logger = logging.getLogger(__name__)

PROTOCOL_ID = "/swarmtrain/zo-log/1.0.0"
VERSION = 1
MAX_BATCHES = 512
MAX_BATCH_NBYTES = 8 * zolog.MAX_BATCH + 512
MAX_PEERS_IN_VECTOR = 4096
EXCHANGE_TIMEOUT_S = 10.0
# How far past our own round an entry may be: a peer a little ahead is normal, far ahead is not.
MAX_ROUNDS_AHEAD = 1000


class ZoLogSync:
    def __init__(self, host: Host, peers: PeerTable, log: zolog.UpdateLog, *, current_round: Callable[[], int]) -> None:
        self._host = host
        self._peers = peers
        self.log = log
        self._current_round = current_round
        self.changed = trio.Event()
        """Set when entries arrive (then replaced): take it before checking, then wait."""
        self.entries_by_gossip = 0
        self.entries_by_pull = 0

    def register(self) -> None:
        self._host.set_handler(PROTOCOL_ID, self._serve)

    def add(self, batch: zolog.Batch) -> list[zolog.Entry]:
        """A verified batch (ours, gossiped or pulled) into the log; BadMessage if it is refused."""
        fresh = self.log.add(batch, max_round=self._current_round() + MAX_ROUNDS_AHEAD)
        if fresh:
            self.changed.set()
            self.changed = trio.Event()
        return fresh

    async def receive_hint(self, peer_id: str, raw: bytes) -> None:
        """A batch that came by gossip: verify and keep it; bad ones cost the sender."""
        try:
            self.entries_by_gossip += len(self.add(zolog.decode_batch(raw, self.log.run_id)))
        except zolog.UnknownAuthor:
            pass  # our member list may lag; a pull brings it again later
        except BadMessage as exc:
            if self._peers.penalize(peer_id, f"zo batch: {exc}"):
                await self._host.disconnect(peer_id)

    async def pull(self, peer_id: str) -> int:
        """Fetch what ``peer_id`` holds beyond our log; returns the number of new entries.

        Raises ``ProtocolError``; a ``BadMessage`` has already penalized the peer.
        """
        total = 0
        for _ in range(64):  # bounded: each round trip brings up to MAX_BATCHES batches
            new, more = await self._pull_once(peer_id)
            total += new
            self.entries_by_pull += new
            if not more:
                break
        return total

    async def _pull_once(self, peer_id: str) -> tuple[int, bool]:
        new, more = 0, False
        with trio.move_on_after(EXCHANGE_TIMEOUT_S) as scope:
            stream = await self._host.open_stream(peer_id, PROTOCOL_ID, timeout_s=EXCHANGE_TIMEOUT_S)
            try:
                await wire.send(stream, "want", VERSION, {"run": self.log.run_id, "have": self.log.vector()})
                reply = await wire.receive(
                    stream,
                    msg_types=frozenset({"batches"}),
                    version=VERSION,
                    max_nbytes=MAX_BATCHES * MAX_BATCH_NBYTES,
                )
                raws = reply.get("batches")
                if not isinstance(raws, list) or len(raws) > MAX_BATCHES:
                    raise BadMessage(f"batches must be a list of at most {MAX_BATCHES}")
                for raw in raws:
                    if not isinstance(raw, bytes):
                        raise BadMessage("a batch is not bytes")
                    try:
                        new += len(self.add(zolog.decode_batch(raw, self.log.run_id)))
                    except zolog.UnknownAuthor as exc:
                        logger.debug("skipped a batch from %s: %s", peer_id, exc)
                more = reply.get("more") is True and new > 0
            except BadMessage as exc:
                await stream.reset()
                if self._peers.penalize(peer_id, f"zo log pull: {exc}"):
                    await self._host.disconnect(peer_id)
                raise
            await stream.close()
        if scope.cancelled_caught:
            raise ProtocolError(f"zo log pull from {peer_id} timed out")
        self._peers.seen(peer_id)
        return new, more

    async def _serve(self, stream: Stream) -> None:
        if self._peers.is_banned(stream.peer_id):
            await stream.reset()
            return
        try:
            with trio.fail_after(EXCHANGE_TIMEOUT_S):
                request = await wire.receive(stream, msg_types=frozenset({"want"}), version=VERSION, max_nbytes=1 << 20)
                run_id = wire.get_str(request, "run", max_len=64)
                have = wire.get_count_map(request, "have", max_items=MAX_PEERS_IN_VECTOR, lo=0, hi=1 << 40)
                batches: list[bytes] = []
                if run_id == self.log.run_id:
                    for peer_id in sorted(self.log.vector()):
                        batches += [b.encode() for b in self.log.batches_after(peer_id, have.get(peer_id, 0))]
                await wire.send(
                    stream, "batches", VERSION, {"batches": batches[:MAX_BATCHES], "more": len(batches) > MAX_BATCHES}
                )
        except BadMessage as exc:
            if self._peers.penalize(stream.peer_id, f"zo log request: {exc}"):
                await self._host.disconnect(stream.peer_id)
            raise
        except trio.TooSlowError as exc:
            raise ProtocolError(f"zo log request from {stream.peer_id} timed out") from exc
