"""Zeroth-order rounds over the network: the daemon's side of ``--algorithm zo``.

Each round r the worker gets every logged update of rounds < r in the canonical order
(node/algorithms/zo/zolog.py), computes H updates of its own (H = steps_per_round, each g for
``seed_of(run, us, r, seq)``, all at the round's weights), and we sign them as one batch
and add it to our log; peers pull it (node/algorithms/zo/zosync.py). One signature per round is
shared by its H updates. The weights are therefore the genesis
weights (the same initial seed on every node) plus the replayed log, on every node.

Before round r we wait, bounded, until every live trainer that has published anything has
published round r − 1, so that usually nothing arrives late. When something does arrive late (an entry that sorts
before what the worker already applied), the worker rebuilds from the genesis weights and
replays the whole log: the rule every node agrees on is that only the log counts, not
when an entry arrived. A node that joins late replays the log it pulls and starts at the
newest round it finds, so it ends bit-identical to the others.
"""

import contextlib
import itertools
import logging
import math
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import trio

from node.algorithms import savedstate
from node.algorithms.zo import zolog, zosync
from node.algorithms.zo.journal import Journal
from node.supervisor import WorkerConnection, WorkerGone
from protocol.errors import ProtocolError
from protocol.net.hostlike import TensorHostLike

logger = logging.getLogger(__name__)

PULL_INTERVAL_S = 0.25
# Anti-entropy cycles that bring nothing back off, doubling up to this: gossip carries most
# batches, pulls repair what it dropped, and 16 nodes each pulling 15 peers every quarter
# second opened hundreds of streams a second on the soak's 2 cores. A round that waits for
# a peer's batch asks for a cycle at once.
MAX_PULL_INTERVAL_S = 2.0
# After the last round the final weights follow late entries once the log was quiet this
# long (at most MAX_QUIET_WAIT_S after the first of them).
QUIET_S = 2.0
MAX_QUIET_WAIT_S = 30.0
# Pulls of one anti-entropy cycle under way at once.
PARALLEL_PULLS = 3
# Every this many rounds the worker saves its weights as a checkpoint peers can fetch.
CHECKPOINT_EVERY = 4
MAX_CHECKPOINT_NBYTES = 8 << 30
# How often our latest checkpoint's weights are compared with the peers' (a head request
# each: a few hundred bytes), and how many peers must agree against us before we yield.
AGREE_INTERVAL_S = 2.0
MIN_MAJORITY = 2
# A round's updates go to the worker in messages of at most this many (training/algorithms/zo.py
# takes 20,000 a message: 1 MiB frames), the last with more = False.
MAX_UPDATES_PER_MESSAGE = 20_000


def outvoted(ours: str, heads: dict[str, str]) -> tuple[str, list[str]] | None:
    """(the majority's hash, the peers holding it) if at least MIN_MAJORITY peers agree on
    other weights than ours and outnumber those that hold ours (us included); else None."""
    counts = Counter(heads.values())
    if not counts:
        return None
    top, count = counts.most_common(1)[0]
    if top == ours or count < MIN_MAJORITY or count <= 1 + counts.get(ours, 0):
        return None
    return top, sorted(p for p, h in heads.items() if h == top)


class ZoRounds:
    def __init__(
        self,
        host: TensorHostLike,
        *,
        run_id: str,
        identity_seed: bytes,
        rounds: int,
        updates_per_round: int,
        partners: Callable[[], list[str]],
        pull_from: Callable[[], list[str]] | None = None,
        is_member: Callable[[str], bool],
        wait_s: float,
        checkpoint_dir: Path | None = None,
        gossip: Callable[[bytes], Awaitable[None]] | None = None,
        journal: Journal | None = None,
    ) -> None:
        self._host = host
        self._run_id = run_id
        self._identity_seed = identity_seed
        self._rounds = rounds
        self._updates_per_round = updates_per_round
        self._partners = partners
        self._pull_from = pull_from or partners
        self._pull_soon = trio.Event()
        """Whom anti-entropy pulls: live trainers, and trainer members we are connected to
        (a peer whose heartbeats do not reach us still serves its log)."""
        self._wait_s = wait_s
        self.round = 0
        self.log = zolog.UpdateLog(run_id, is_member=is_member, rounds=rounds, max_per_round=updates_per_round)
        self.sync = zosync.ZoLogSync(host, self.log, current_round=lambda: self.round)
        self._applied: list[tuple[zolog.Entry, int]] = []
        """What the worker holds: genesis plus these (entry, applied g code), in canonical order."""
        self._snapshot_capacity = 0
        """How many copies of its weights at round ends the worker keeps (its ``ready``)."""
        self._snapshots: list[int] = []
        """The keys of the copies it keeps, oldest first: each the number of round groups of
        ``_applied`` the copy holds (training/algorithms/zo.py Snapshots, the same rule)."""
        self.rewinds = 0
        self.replay: tuple[int, int] | None = None
        """(round groups sent, groups to send) while the worker replays the log (progress)."""
        self.clipped = 0
        self.silenced = 0
        self.recoveries = 0
        self._silenced_authors: set[str] = set()
        self._recovered_rounds: set[int] = set()
        self._outvoted: tuple[int, str, list[str]] | None = None
        """(round, the majority's weights hash, peers holding it), once agree_forever found us outvoted."""
        self._own_seq = 0
        self.bytes_published = 0
        self.rebuilds = 0
        self.param_hash: str | None = None
        self.final_val_loss: float | None = None
        """The final weights' loss on the curve's validation blocks (``zo_done``)."""
        self.full_val_loss: float | None = None
        """And on the whole validation split (training/validation.py)."""
        self.start_round = 0
        self.checkpoint_round: int | None = None
        """The round of the checkpoint we started from (fetched from a peer), if any."""
        self._checkpoint_dir = checkpoint_dir
        self._gossip = gossip
        self._journal = journal
        """Our own batches on disk (node/algorithms/zo/journal.py): a restart takes them back."""
        self.checkpoints = savedstate.ZoCheckpoints(host, run_id, max_nbytes=MAX_CHECKPOINT_NBYTES)
        self._saved: list[Path] = []
        self._hashed_entries = 0

    def register(self) -> None:
        self.sync.register()
        self.checkpoints.register()

    async def pull_forever(self) -> None:
        """Anti-entropy: pull from every live trainer, again and again; every PULL_INTERVAL_S
        while pulls bring entries, backing off to MAX_PULL_INTERVAL_S while they do not,
        and at once when a round waits for a peer's batch (``_pull_soon``)."""
        interval = PULL_INTERVAL_S
        while True:
            before = self.sync.entries_by_pull
            await self._catch_up_once()
            interval = PULL_INTERVAL_S if self.sync.entries_by_pull > before else min(2 * interval, MAX_PULL_INTERVAL_S)
            with trio.move_on_after(interval):
                await self._pull_soon.wait()
            self._pull_soon = trio.Event()

    def status(self) -> dict[str, Any]:
        published = self._own_seq
        return {
            "param_hash": self.param_hash,
            "bytes_per_update": round(self.bytes_published / published, 2) if published else None,
            "log_entries": sum(self.log.vector().values()),
            # Entries held per author's chain (bench/soak.py compares them across nodes).
            "log_vector": self.log.vector(),
            # Entries behind the reported param_hash (not merely sent to the worker).
            "log_entries_applied": self._hashed_entries,
            "entries_by_gossip": self.sync.entries_by_gossip,
            "entries_by_pull": self.sync.entries_by_pull,
            "pulls_ok": self.sync.pulls_ok,
            "pulls_failed": self.sync.pulls_failed,
            "pull_failures": dict(self.sync.pull_failures),
            "pull_failure_examples": self.sync.pull_failure_examples,
            "rebuilds": self.rebuilds,
            "rewinds": self.rewinds,
            "download": self.checkpoints.download,
            "replay": self.replay,
            "g_clipped": self.clipped,
            "g_silenced": self.silenced,
            "authors_excluded": sorted(self.log.excluded),
            "authors_silenced": sorted(self._silenced_authors),
            "recoveries": self.recoveries,
            "start_round": self.start_round,
            "checkpoint_round": self.checkpoint_round,
        }

    async def session(
        self,
        worker: WorkerConnection,
        on_step: Callable[[dict[str, Any]], None],
        on_finished: Callable[[], None],
    ) -> None:
        """Drive one worker from its genesis weights through the remaining rounds, then keep
        following the log: an update for a past round that arrives after the end (a late
        joiner's, a slow peer's) is applied too, and the final weights recomputed. Returns
        only if the worker goes away."""
        self._applied = []  # a new worker holds the genesis weights
        self._snapshots = []
        self._snapshot_capacity = max(0, int(worker.ready.get("zo_snapshots", 0)))
        await self._restore_own_batches()
        await self._catch_up_once()
        # After a restart of this node our chain may already be in peers' logs: go on from
        # its end (reusing a sequence number would read as equivocation).
        self._own_seq = max(self._own_seq, self.log.next_seq(self._host.peer_id))
        if self.log.max_round() >= CHECKPOINT_EVERY and self._checkpoint_dir is not None:
            await self._start_from_checkpoint(worker)
        # Where the run is, robustly (not the largest round anyone claims: zolog.agreed_round),
        # and never a round our own chain already has (a restart ahead of the median would
        # sign it again: its entries would contradict our own).
        me = self._host.peer_id
        self.start_round = self.round = max(self.round, self.log.agreed_round(), self.log.last_round(me) + 1)
        for round_index in range(self.round, self._rounds):
            self.round = round_index
            await self._wait_for_round(round_index - 1)
            await self._recover_if_outvoted(worker)
            await self._send_updates(worker, below_round=round_index)
            if round_index > 0 and round_index % CHECKPOINT_EVERY == 0:
                await self._save_checkpoint(worker, round_index)
            # Our chain may have grown behind our back (a pull brought entries we signed
            # before losing our disk): never sign a sequence number twice.
            self._own_seq = max(self._own_seq, self.log.next_seq(me))
            seqs = range(self._own_seq, self._own_seq + self._updates_per_round)
            seeds = [zolog.seed_of(self._run_id, self._host.peer_id, round_index, seq) for seq in seqs]
            await worker.send("zo_go", round=round_index, seeds=seeds)
            step = await worker.receive()
            if step["t"] != "zo_step" or step.get("round") != round_index:
                raise WorkerGone(f"expected zo_step for round {round_index}, got {step['t']!r}")
            codes = step.get("g_codes")
            if not (isinstance(codes, list) and len(codes) == len(seeds)) or not all(
                type(c) is int and 0 <= c <= 0xFF for c in codes
            ):
                raise WorkerGone(f"worker sent g codes {str(codes)[:80]}")
            batch = zolog.sign_batch(
                self._identity_seed, self._run_id, self._own_seq, [round_index] * len(codes), bytes(codes)
            )
            await self._journal_own(batch)
            await self.sync.add(batch)
            self._own_seq += len(codes)
            raw = batch.encode()
            self.bytes_published += len(raw)
            if self._gossip is not None:
                await self._gossip(raw)  # a hint: peers' pulls are the truth
            on_step(step)
        self.round = self._rounds
        await self._wait_for_round(self._rounds - 1)
        await self._catch_up_once()
        await self._finish(worker)
        on_finished()
        while True:
            changed = self.sync.changed
            recovered = await self._recover_if_outvoted(worker)
            if recovered or list(self.log.ordered(below_round=self._rounds)) != [e for e, _ in self._applied]:
                await self._quiet()
                await self._finish(worker)
                on_step({"round": self._rounds, "val_loss": self.final_val_loss, "final": True})
            else:
                await changed.wait()

    async def _quiet(self) -> None:
        """Until the log has not changed for QUIET_S (at most MAX_QUIET_WAIT_S): a catch-up
        brings entries in bursts, and each final pass replays and evaluates the weights
        (in the soak, 16 workers doing that for every trickled entry kept 2 cores busy)."""
        with trio.move_on_after(MAX_QUIET_WAIT_S):
            while True:
                changed = self.sync.changed
                with trio.move_on_after(QUIET_S):
                    await changed.wait()
                    continue
                return

    async def _restore_own_batches(self) -> None:
        """After a restart: our chain back from the journal, before anything is pulled or
        signed, whatever the window (``sync.add`` would leave entries past it for a later
        pull, and our next signature would reuse their numbers)."""
        if self._journal is None:
            return
        restored = 0
        for batch in await self._journal.read():
            try:
                fresh = self.log.add(batch, max_round=zolog.MAX_ROUND)
            except ProtocolError as exc:
                logger.error("zo: a batch of our journal is refused (%s); the rest is not restored", exc)
                break
            restored += len(fresh)
        if restored:
            self.sync.wake()
            logger.info("zo: %d of our own entries restored from %s", restored, self._journal.path)

    async def _journal_own(self, batch: zolog.Batch) -> None:
        if self._journal is None:
            return
        try:
            await self._journal.append(batch)
        except OSError as exc:
            # Published anyway: withholding it would stall our chain for good. Only a
            # crash before a peer pulls it can make our restart sign its numbers again.
            logger.error("zo: could not write our batch to %s: %s", self._journal.path, exc.strerror or exc)

    async def agree_forever(self) -> None:
        """The param-hash agreement: every AGREE_INTERVAL_S, compare our latest checkpoint's
        weights with what live trainers hold for the same round and log; outvoted, we
        recover from one of the majority at the next round boundary (``_recover_if_outvoted``).

        Each peer is asked until it answered for our checkpoint's round (or moved past it),
        then not again until we save the next one: one header per peer per checkpoint,
        not one every interval (16 nodes asking 15 peers every 2 s opened ~120 streams a
        second on the soak's 2 cores, more than all ZO pulls together)."""
        compared: tuple[int, str] | None = None
        heads: dict[str, str] = {}
        settled: set[str] = set()
        """Peers we need not ask again about this checkpoint (answered, or past its round)."""
        while True:
            await trio.sleep(AGREE_INTERVAL_S)
            offer = self.checkpoints.offer
            if offer is None or self._outvoted is not None or offer.round in self._recovered_rounds:
                continue  # once per checkpoint round: a second verdict there would only loop
            if compared != (offer.round, offer.param_hash):
                compared, heads, settled = (offer.round, offer.param_hash), {}, set()
            for peer_id in self._partners():
                if peer_id in settled:
                    continue
                try:
                    head = await self.checkpoints.head(peer_id)
                except ProtocolError as exc:
                    logger.debug("no checkpoint head from %s: %s", peer_id, exc)
                    continue
                if head is None or head.round < offer.round:
                    continue  # not there yet: ask again next time
                settled.add(peer_id)
                if head.round == offer.round and head.vector == offer.vector:
                    heads[peer_id] = head.param_hash
            verdict = outvoted(offer.param_hash, heads)
            if verdict is not None:
                logger.error(
                    "zo: our weights at round %d (%s) differ from %d peers' (%s) on the same log: recovering",
                    offer.round,
                    offer.param_hash[:16],
                    len(verdict[1]),
                    verdict[0][:16],
                )
                self._outvoted = (offer.round, *verdict)
                self.sync.wake()

    async def _recover_if_outvoted(self, worker: WorkerConnection) -> bool:
        """Take a majority peer's checkpoint when ``agree_forever`` found us outvoted."""
        if self._outvoted is None or self._checkpoint_dir is None:
            return False
        round_index, param_hash, peers = self._outvoted
        self._outvoted = None
        self._recovered_rounds.add(round_index)
        dest = self._checkpoint_dir / f"{self._run_id}.zo-recovered.ckpt"
        for peer_id in peers:
            try:
                offer = await self.checkpoints.fetch(peer_id, dest)
            except ProtocolError as exc:
                logger.info("recovery checkpoint from %s: %s", peer_id, exc)
                continue
            if offer is None or offer.round != round_index or offer.param_hash != param_hash:
                continue
            if self.log.count_below(offer.round) != offer.vector:
                # Weights of entries our log does not hold as such (an author excluded since):
                # nothing we replay could stay consistent with them.
                logger.info("recovery checkpoint of %s does not match our log; not taken", peer_id)
                continue
            await worker.send("zo_load", path=str(dest), param_hash=param_hash)
            reply = await worker.receive()
            if reply["t"] != "zo_loaded":
                raise WorkerGone(f"expected zo_loaded, got {reply['t']!r}")
            if reply.get("ok") is True:
                self._applied = self._held_by(offer.vector, offer.round)
                self._snapshots = []  # the worker dropped its copies
                self.checkpoints.offer = replace(offer, path=dest)  # we hold what the majority holds now
                self.recoveries += 1
                logger.warning("zo: recovered the majority's weights at round %d from %s", round_index, peer_id)
                return True
        logger.error("zo: outvoted, but no majority peer's checkpoint could be taken; carrying on")
        return False

    def _held_by(self, vector: dict[str, int], round_index: int) -> list[tuple[zolog.Entry, int]]:
        """What weights loaded from a checkpoint hold: genesis plus each author's first
        ``vector`` entries (all of rounds < ``round_index``), in the canonical order. Not
        the log's entries below that round now: some may have arrived while the worker
        loaded, and those the weights lack (``_send_updates`` applies them, or rebuilds)."""
        below = [e for e in self.log.ordered(below_round=round_index) if e.seq < vector.get(e.peer_id, 0)]
        return list(zip(below, zolog.robust_codes(below).codes, strict=True))

    async def _finish(self, worker: WorkerConnection) -> None:
        await self._send_updates(worker, below_round=self._rounds)
        await worker.send("zo_finish")
        done = await worker.receive()
        if done["t"] != "zo_done":
            raise WorkerGone(f"expected zo_done, got {done['t']!r}")
        self.param_hash = str(done.get("param_hash"))
        self.final_val_loss = float(done.get("val_loss", 0.0))
        full = done.get("full_val_loss")
        self.full_val_loss = full if isinstance(full, float) and math.isfinite(full) else None
        self._hashed_entries = len(self._applied)
        logger.info("zo: %d log entries applied, weights %s", len(self._applied), self.param_hash[:16])

    async def _save_checkpoint(self, worker: WorkerConnection, round_index: int) -> None:
        """The worker holds genesis + rounds < ``round_index``: offer that to late joiners."""
        if self._checkpoint_dir is None:
            return
        path = self._checkpoint_dir / f"{self._run_id}.zo-{round_index}.ckpt"
        # What the worker holds, exactly: entries may reach the log while it saves, and a
        # vector counting those would describe other weights than the file's.
        vector = dict(Counter(entry.peer_id for entry, _ in self._applied if entry.round < round_index))
        await worker.send("zo_save", path=str(path), round=round_index)
        reply = await worker.receive()
        if reply["t"] != "zo_saved":
            raise WorkerGone(f"expected zo_saved, got {reply['t']!r}")
        if reply.get("save_error"):
            logger.error("zo: no checkpoint at round %d: %s", round_index, str(reply["save_error"])[:300])
            return  # peers keep fetching our previous one, if any
        nbytes = (await trio.Path(path).stat()).st_size
        sha256 = await savedstate.file_sha256(path)
        self.checkpoints.offer = savedstate.Offer(
            round_index, vector, str(reply.get("param_hash")), path, nbytes, sha256
        )
        self._saved.append(path)
        while len(self._saved) > 2:  # one being served may still be open: keep the previous one
            with contextlib.suppress(FileNotFoundError):
                await trio.Path(self._saved.pop(0)).unlink()

    async def _start_from_checkpoint(self, worker: WorkerConnection) -> None:
        """A late joiner: take a peer's checkpoint that matches our log, instead of replaying it all."""
        assert self._checkpoint_dir is not None
        dest = self._checkpoint_dir / f"{self._run_id}.zo-fetched.ckpt"
        for peer_id in self._partners():
            try:
                offer = await self.checkpoints.fetch(peer_id, dest)
                if offer is not None and self.log.count_below(offer.round) != offer.vector:
                    await self.sync.pull(peer_id)  # it may know entries we have not pulled yet
            except ProtocolError as exc:
                logger.info("no checkpoint from %s: %s", peer_id, exc)
                continue
            if offer is None:
                continue
            if self.log.count_below(offer.round) != offer.vector:
                logger.info("checkpoint of %s at round %d does not match our log; not taken", peer_id, offer.round)
                continue
            await worker.send("zo_load", path=str(dest), param_hash=offer.param_hash)
            reply = await worker.receive()
            if reply["t"] != "zo_loaded":
                raise WorkerGone(f"expected zo_loaded, got {reply['t']!r}")
            if reply.get("ok") is True:
                self._applied = self._held_by(offer.vector, offer.round)
                self._snapshots = []  # the worker dropped its copies
                self.checkpoint_round = offer.round
                logger.info("zo: started from %s's checkpoint at round %d", peer_id, offer.round)
                return
            logger.info("checkpoint of %s refused by the worker: %s", peer_id, reply.get("reason"))

    async def _catch_up_once(self) -> None:
        """One pull from every peer ``pull_from`` names, PARALLEL_PULLS at a time (one at a
        time, a cycle through 15 loaded peers took minutes); a failed one is only logged."""
        limiter = trio.CapacityLimiter(PARALLEL_PULLS)

        async def pull(peer_id: str) -> None:
            async with limiter:
                try:
                    await self.sync.pull(peer_id)
                except ProtocolError as exc:
                    logger.debug("zo log pull from %s: %s", peer_id, exc)

        async with trio.open_nursery() as nursery:
            for peer_id in self._pull_from():
                nursery.start_soon(pull, peer_id)

    async def _wait_for_round(self, round_index: int) -> None:
        """Until every producing live trainer's chain reaches ``round_index`` (bounded by ``wait_s``)."""
        if round_index < 0:
            return
        with trio.move_on_after(self._wait_s):
            while True:
                changed = self.sync.changed
                # Only peers already producing: one that is live but has published nothing
                # yet is still starting (a late joiner replaying the log) or not training.
                missing = [p for p in self._partners() if -1 < self.log.last_round(p) < round_index]
                if not missing:
                    return
                self._pull_soon.set()  # gossip may have dropped it: repair now, not after a back-off
                with trio.move_on_after(PULL_INTERVAL_S):
                    await changed.wait()
        logger.info("round %d: going on without every peer's update (late ones are replayed)", round_index + 1)

    async def _send_updates(self, worker: WorkerConnection, *, below_round: int) -> None:
        """Bring the worker to genesis + every round < ``below_round`` of the log.

        The arithmetic groups by round (kernels/zo_apply.py sums one round's updates, then
        subtracts once), so a worker only ever applies whole rounds, one message each; if
        what it holds is not a prefix of whole rounds of the log (an entry arrived late, an
        author was excluded, a late entry changed the robust scale of later rounds), it
        starts over from the genesis weights. Codes are the robust ones (zolog.robust_codes):
        a function of the log alone, so every node applies the same.
        """
        canonical = list(self.log.ordered(below_round=below_round))
        robust = zolog.robust_codes(canonical)
        self.clipped, self.silenced = robust.clipped, robust.silenced
        for author in robust.silenced_authors - self._silenced_authors:
            # Counted zero on every node alike; not banned: g are spread wide, and only a
            # rule a signed batch breaks (zolog.Forbidden) is proof of an attack.
            self._silenced_authors.add(author)
            logger.warning("zo: %s's g sit far above the run's scale: its updates count zero", author)
        target = list(zip(canonical, robust.codes, strict=True))
        wanted = [list(group) for _, group in itertools.groupby(target, key=lambda pair: pair[0].round)]
        held = [list(group) for _, group in itertools.groupby(self._applied, key=lambda pair: pair[0].round)]
        # Whole round groups the worker holds as the log has them now. The log can also
        # shrink (an author excluded for equivocation drops its whole chain), and a late
        # entry or a changed robust scale alters a group: from there the worker goes back to
        # the newest copy it keeps at or before that point, or to the genesis weights.
        same = 0
        while same < min(len(held), len(wanted)) and held[same] == wanted[same]:
            same += 1
        start, rewind, rebuild = same, None, False
        if same < len(held):
            kept = [key for key in self._snapshots if key <= same]
            if kept:
                start = rewind = max(kept)
                self.rewinds += 1
                logger.info(
                    "zo: the log changed in round group %d; replaying %d groups from a copy", same, len(wanted) - start
                )
            else:
                start, rebuild = 0, True
                self.rebuilds += 1
                logger.info("zo: the log changed below what we applied; replaying %d entries from genesis", len(target))
            self._snapshots = [key for key in self._snapshots if key <= start] if rewind is not None else []
            if start == len(wanted):
                await worker.send("zo_apply", rebuild=rebuild, rewind=rewind, updates=[])
        try:
            for i, group in enumerate(wanted[start:]):
                self.replay = (i, len(wanted) - start)
                updates = [[zolog.seed_of(self._run_id, e.peer_id, e.round, e.seq), code] for e, code in group if code]
                # One round is one summed group, however many messages carry it (the worker
                # applies once the last part came): a round of many members never overflows.
                parts = [
                    updates[k : k + MAX_UPDATES_PER_MESSAGE] for k in range(0, len(updates), MAX_UPDATES_PER_MESSAGE)
                ]
                parts = parts or [[]]  # a round whose updates all count zero is still one group
                key = start + i + 1
                keep = self._snapshot_capacity > 0 and key > len(wanted) - self._snapshot_capacity
                for k, part in enumerate(parts):
                    first, last = i == 0 and k == 0, k == len(parts) - 1
                    await worker.send(
                        "zo_apply",
                        rebuild=rebuild and first,
                        rewind=rewind if first else None,
                        updates=part,
                        more=not last,
                        snapshot=key if last and keep else None,
                    )
                if keep:
                    self._snapshots = [*self._snapshots, key][-self._snapshot_capacity :]
        finally:
            self.replay = None
        self._applied = target
