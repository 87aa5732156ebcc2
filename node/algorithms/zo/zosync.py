"""Pulling the ZO update log from a peer: ask for what lies beyond our log vector.

Protocol flow (``/swarmtrain/zo-log/1.0.0``), one exchange per stream:

    puller                                              holder
    {t: "want", v: 2, run, have: {peer id: next seq},
     hashes: {peer id: 8 bytes}}                  ──▶  (hashes: of each chain we hold; a holder
                                                         whose chain of the same length hashes
                                                         otherwise sends its batches of that
                                                         author from the start: equivocation
                                                         shows wherever two versions meet)
                                                    ◀── {t: "batches", v: 2, batches: [bytes],
                                                         evidence: [[bytes, bytes]], more}
                                                         (the original signed batches holding
                                                         entries beyond ``have``, oldest round
                                                         first across authors, at most
                                                         MAX_BATCHES; evidence: the
                                                         two batches that convicted each author
                                                         we excluded; more: ask again)

The puller verifies every batch (node/algorithms/zo/zolog.py) before it is stored: a holder cannot
make us accept anything its authors did not sign. A bad batch ends the exchange and the
holder is penalized; batches verified before it are kept (each stands on its own). Gossip
carries new batches as hints; this pull is what makes every log complete.

Verdicts on a batch (``ZoLogSync.add``): entries past our window (the agreed round plus
``MAX_ROUNDS_AHEAD``) wait for a later pull, unblamed. A batch that convicts its author
(``zolog.Forbidden``: rounds the run does not have, more entries in a round than its
steps) bans the author; the sender is penalized too, for it should have checked. An
equivocation (two signed batches for one sequence number) is evidence: the author is
excluded from our log (and banned), the two batches are gossiped and served with every
pull, so each node excludes it once it holds them, and nobody blames the messenger.
"""

import logging
from collections import Counter
from collections.abc import Awaitable, Callable

import trio

from node.algorithms.zo import zolog
from protocol import wire
from protocol.errors import BadMessage, ProtocolError
from protocol.net.hostlike import HostLike, StreamLike, exchange
from protocol.net.peers import BAN_POINTS

logger = logging.getLogger(__name__)

PROTOCOL_ID = "/swarmtrain/zo-log/1.0.0"
# 2: replies carry the equivocation evidence.
VERSION = 2
MAX_BATCHES = 512
MAX_BATCH_NBYTES = 8 * zolog.MAX_BATCH + 512
MAX_EVIDENCE = 64
MAX_PEERS_IN_VECTOR = 4096
# A pull is small, but on a loaded machine (the soak: 32 processes on 2 cores) an exchange
# took 2-10 s even from an idle outsider, and with 10 s the nodes' own pulls timed out for
# minutes: a slow pull is no harm (three run at once), a timed-out one is wasted.
EXCHANGE_TIMEOUT_S = 30.0
# Entries are taken up to this many rounds past the agreed round (or ours, if ahead): a
# peer a round or two ahead is normal; one claiming rounds far beyond everyone is not, and
# before issue 12 a joiner started at the largest round anyone claimed.
MAX_ROUNDS_AHEAD = 16

Evidence = tuple[zolog.Batch, zolog.Batch]


def check_evidence(first: zolog.Batch, second: zolog.Batch) -> str:
    """The author two verified batches convict of equivocation; ``BadMessage`` if they do not."""
    if first.peer_id != second.peer_id:
        raise BadMessage("evidence batches of two authors")
    ours = {e.seq: e for e in first.entries()}
    if not any(e.seq in ours and ours[e.seq] != e for e in second.entries()):
        raise BadMessage("evidence batches do not contradict each other")
    return first.peer_id


class ZoLogSync:
    def __init__(self, host: HostLike, log: zolog.UpdateLog, *, current_round: Callable[[], int]) -> None:
        self._host = host
        self.log = log
        self._current_round = current_round
        self.changed = trio.Event()
        """Set when entries arrive or an author is excluded (then replaced): take it before
        checking, then wait."""
        self.entries_by_gossip = 0
        self.entries_by_pull = 0
        self.pulls_ok = 0
        self.pulls_failed = 0
        """Pull exchanges that ended well, and those that failed (timeouts most of all)."""
        self.pull_failures: Counter[str] = Counter()
        """Why pulls failed: the error's kind, and "timed out" apart (the soak's diagnosis)."""
        self.pull_failure_examples: dict[str, str] = {}
        """The last message of each kind of failure."""
        self.publish_evidence: Callable[[bytes, bytes], Awaitable[None]] | None = None
        """Gossips a new equivocation's two batches (protocol/runstate/run.py); None: pulls carry it."""

    def register(self) -> None:
        self._host.set_handler(PROTOCOL_ID, self._serve, deadline_s=EXCHANGE_TIMEOUT_S)

    def window(self) -> int:
        """The latest round we take entries for now."""
        return max(self._current_round(), self.log.agreed_round()) + MAX_ROUNDS_AHEAD

    async def add(self, batch: zolog.Batch) -> list[zolog.Entry]:
        """A verified batch (ours, gossiped or pulled) into the log; the new entries.

        ``BadMessage`` if the sender is to blame (a ``Forbidden`` batch also banned its
        author); batches not to anyone's blame (unknown author yet, past our window, an
        excluded author) add nothing; an equivocation excludes its author.
        """
        try:
            fresh = self.log.add(batch, max_round=self.window())
        except (zolog.UnknownAuthor, zolog.NotYet, zolog.Excluded) as exc:
            logger.debug("zo batch skipped: %s", exc)
            return []
        except zolog.Equivocation as exc:
            await self.convict((exc.held, exc.other))
            return []
        except zolog.Forbidden as exc:
            await self._host.punish(exc.author, f"signed a forbidden ZO batch: {exc}", points=BAN_POINTS)
            raise
        if fresh:
            self._notify()
        return fresh

    async def convict(self, evidence: Evidence) -> None:
        """Exclude an equivocating author (checked evidence), ban it, and spread the evidence."""
        author = check_evidence(*evidence)
        if not self.log.exclude(author, evidence):
            return
        logger.warning("zo: %s signed two different batches for one sequence number: excluded and banned", author)
        await self._host.punish(author, "equivocated in the ZO log", points=BAN_POINTS)
        self._notify()
        if self.publish_evidence is not None:
            await self.publish_evidence(evidence[0].encode(), evidence[1].encode())

    async def receive_evidence(self, raw_first: bytes, raw_second: bytes) -> None:
        """Gossiped evidence: both batches verified (signed by the author), then convicted.
        Evidence that does not hold is the sender's ``BadMessage``."""
        first = zolog.decode_batch(raw_first, self.log.run_id)
        second = zolog.decode_batch(raw_second, self.log.run_id)
        await self.convict((first, second))

    async def receive_hint(self, peer_id: str, raw: bytes) -> None:
        """A batch that came by gossip: verify and keep it. A bad one raises ``BadMessage``
        (the gossip guard judges the sender)."""
        self.entries_by_gossip += len(await self.add(zolog.decode_batch(raw, self.log.run_id)))

    async def pull(self, peer_id: str) -> int:
        """Fetch what ``peer_id`` holds beyond our log; returns the number of new entries.

        Raises ``ProtocolError``, already judged (a malformed answer penalized the peer).
        """
        total = 0
        for _ in range(64):  # bounded: each round trip brings up to MAX_BATCHES batches
            try:
                new, more = await self._pull_once(peer_id)
            except ProtocolError as exc:
                self.pulls_failed += 1
                kind = "timed out" if "timed out" in str(exc) else type(exc).__name__
                self.pull_failures[kind] += 1
                self.pull_failure_examples[kind] = str(exc)[:200]
                raise
            self.pulls_ok += 1
            total += new
            self.entries_by_pull += new
            if not more:
                break
        return total

    async def _pull_once(self, peer_id: str) -> tuple[int, bool]:
        new, more = 0, False
        async with exchange(
            self._host, peer_id, PROTOCOL_ID, what="zo log pull", timeout_s=EXCHANGE_TIMEOUT_S
        ) as stream:
            vector = self.log.vector()
            hashes = {peer: self.log.chain_hash(peer) for peer in vector}
            await wire.send(stream, "want", VERSION, {"run": self.log.run_id, "have": vector, "hashes": hashes})
            reply = await wire.receive(
                stream,
                msg_types=frozenset({"batches"}),
                version=VERSION,
                max_nbytes=(MAX_BATCHES + 2 * MAX_EVIDENCE) * MAX_BATCH_NBYTES,
            )
            for first, second in _evidence_of(reply):
                await self.convict(
                    (zolog.decode_batch(first, self.log.run_id), zolog.decode_batch(second, self.log.run_id))
                )
            raws = reply.get("batches")
            if not isinstance(raws, list) or len(raws) > MAX_BATCHES:
                raise BadMessage(f"batches must be a list of at most {MAX_BATCHES}")
            for raw in raws:
                if not isinstance(raw, bytes):
                    raise BadMessage("a batch is not bytes")
                new += len(await self.add(zolog.decode_batch(raw, self.log.run_id)))
            more = reply.get("more") is True and new > 0
        self._host.peers.seen(peer_id)
        return new, more

    async def _serve(self, stream: StreamLike) -> None:
        request = await wire.receive(stream, msg_types=frozenset({"want"}), version=VERSION, max_nbytes=1 << 20)
        run_id = wire.get_str(request, "run", max_len=64)
        have = wire.get_count_map(request, "have", max_items=MAX_PEERS_IN_VECTOR, lo=0, hi=1 << 40)
        hashes = _hashes_of(request)
        batches: list[bytes] = []
        evidence: list[list[bytes]] = []
        more = False
        if run_id == self.log.run_id:
            held: list[zolog.Batch] = []
            for peer_id, count in sorted(self.log.vector().items()):
                start = have.get(peer_id, 0)
                if start > count:
                    continue  # they hold more of this author than we do (they show us, not we them)
                if start and peer_id in hashes and hashes[peer_id] != self.log.chain_hash(peer_id, start):
                    start = 0  # their chain of this author is not ours: show them ours, whole
                held += self.log.batches_after(peer_id, start)
            # Oldest rounds first, across authors: a puller far behind takes what its window
            # accepts, and one author's long chain never fills the reply alone.
            held.sort(key=lambda b: (b.rounds[0], b.peer_id, b.first_seq))
            batches = [b.encode() for b in held[:MAX_BATCHES]]
            more = len(held) > MAX_BATCHES
            evidence = [[a.encode(), b.encode()] for a, b in list(self.log.excluded.values())[:MAX_EVIDENCE]]
        await wire.send(
            stream,
            "batches",
            VERSION,
            {"batches": batches, "evidence": evidence, "more": more},
        )

    def wake(self) -> None:
        """Wake whoever waits on ``changed`` (something besides entries needs a look)."""
        self._notify()

    def _notify(self) -> None:
        self.changed.set()
        self.changed = trio.Event()


def _hashes_of(request: dict[str, object]) -> dict[str, bytes]:
    raw = request.get("hashes", {})
    if not isinstance(raw, dict) or len(raw) > MAX_PEERS_IN_VECTOR:
        raise BadMessage("hashes must be a map of at most one per peer")
    if not all(isinstance(k, str) and len(k) <= 64 and isinstance(v, bytes) and len(v) <= 8 for k, v in raw.items()):
        raise BadMessage("hashes map peer ids to 8 bytes")
    return dict(raw)


def _evidence_of(reply: dict[str, object]) -> list[tuple[bytes, bytes]]:
    raw = reply.get("evidence", [])
    if not isinstance(raw, list) or len(raw) > MAX_EVIDENCE:
        raise BadMessage(f"evidence must be a list of at most {MAX_EVIDENCE} pairs")
    pairs = []
    for item in raw:
        if not (isinstance(item, list) and len(item) == 2 and all(isinstance(b, bytes) for b in item)):
            raise BadMessage("evidence is pairs of batches")
        pairs.append((item[0], item[1]))
    return pairs
