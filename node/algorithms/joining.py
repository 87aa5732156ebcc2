"""A φ/Δ node's saved state for late joiners: offered after each written round (each one
where the writer keeps up: training/saver.py), fetched at a join.

Without it a node that joins a NoLoCo or DiLoCo run late (or comes back having lost its
disk) starts at round 0 with fresh weights: its peers are rounds ahead, so it trains
alone (measured before: a partner in 0 of 8 rounds). Now every node offers the state its
worker saved after its last outer step (φ, outer momentum, AdamW's moments, its round;
a training/checkpoint.py safetensors file) over ``/swarmtrain/state-ckpt/1.0.0`` (the
transfer of node/algorithms/savedstate.py: header first, the file's sha256 checked as it arrives,
before anything parses it). A node with no checkpoint of its own asks every live trainer
for its header and starts from one of them, at the run's current round:

- the round is vouched for by more than one peer: we take the second-highest round
  offered, so one peer claiming a far round cannot move a joiner (with a single peer
  offering, its round is taken: a run of two has no second opinion);
- the file comes from a peer at that round or the nearest below, its bytes hash as
  announced, and the worker then refuses it unless it fits the model and is finite
  (training/algorithms/rounds.py ``start_from_peer``).

A NoLoCo node's φ is its own (partners average pairwise), so a joiner starts from one
peer's and pairing mixes it in from its first round; a DiLoCo run's φ is the same on
every node.
"""

import contextlib
import logging
import os
from pathlib import Path

import trio

from node.algorithms import savedstate
from protocol.errors import ProtocolError
from protocol.net.hostlike import TensorHostLike

logger = logging.getLogger("node.training")

PROTOCOL_ID = "/swarmtrain/state-ckpt/1.0.0"
MAX_STATE_NBYTES = 16 << 30
# How long a node without a checkpoint waits to meet a live trainer before it starts alone
# at round 0 (the first nodes of a run meet nobody who is ahead).
MEET_WAIT_S = 20.0
KEEP_OFFERED = 2
# A joiner fetches right after its peers' next round boundary (their next offer), so it
# starts that round as close behind them as the fetch allows: peers keep their payload of a
# round for pulls only until their next boundary (node/algorithms/noloco/pairing.py), so one that joined
# mid-round would stay more than a round behind, alone, for good (measured: 10 s behind
# 8 s rounds, a partner in 0 of 8). Headers are asked every BOUNDARY_POLL_S, for at most
# BOUNDARY_WAIT_S (a run whose rounds take longer is joined mid-round).
BOUNDARY_POLL_S = 0.25
BOUNDARY_WAIT_S = 300.0
# A node taking a peer's state because its replica drifted (a resync) was training with
# them a moment ago: it waits for their next boundary at most this many of its own rounds.
# Where all of them resync at once (halves of a run that trained apart refuse each other),
# none of them moves: with BOUNDARY_WAIT_S, four SPES nodes (micro-moe, rounds of ~1.5 s)
# each waited 300 s for the others.
RESYNC_WAIT_ROUNDS = 3.0
# ... and at least this many of the gaps between its own last two offers: peers offer a
# state when its checkpoint write lands, and a round whose save finds the last write still
# going skips it (training/saver.py: a 7.6 s write of gpt-125m's state against 1.7 s rounds
# on the H200), so they offer every few rounds; the join waits for two of them.
RESYNC_WAIT_OFFER_GAPS = 2.0


def resync_wait_s(round_s: float | None, offer_gap_s: float | None) -> float:
    """How long a resync waits for its peers' next offer (``BOUNDARY_WAIT_S`` where it
    knows neither its round time nor how often it offers)."""
    if round_s is None and offer_gap_s is None:
        return BOUNDARY_WAIT_S
    wait = max(RESYNC_WAIT_ROUNDS * (round_s or 0.0), RESYNC_WAIT_OFFER_GAPS * (offer_gap_s or 0.0))
    return min(BOUNDARY_WAIT_S, wait)


WATCHED = 3
# How long a starting node asks its peers whether one is past round 0 (the first to offer
# a state answers it at once). Not the header's 10 s: in `simulate --topology nat` three of
# four nodes waited that long on the one they had no direct connection to yet while it,
# answered at once, started 14 s ahead of them; it stayed 2-3 rounds ahead, alone in 10 of
# 10 rounds (2 runs of 5). A header takes milliseconds from a peer that can answer.
AHEAD_ASK_S = 5.0


def vouched_round(rounds: list[int]) -> int | None:
    """The round to join at: the second highest offered (the only one if one peer offers)."""
    ordered = sorted(rounds, reverse=True)
    if not ordered:
        return None
    return ordered[1] if len(ordered) > 1 else ordered[0]


class StateOffers:
    def __init__(self, host: TensorHostLike, run_id: str, directory: Path | None) -> None:
        self._run_id = run_id
        self._directory = directory
        self.service = savedstate.ZoCheckpoints(host, run_id, max_nbytes=MAX_STATE_NBYTES, protocol_id=PROTOCOL_ID)
        self._offered: list[Path] = []
        self.joined_from: str | None = None
        """The peer whose state we started from, if any."""

    def register(self) -> None:
        self.service.register()

    async def offer(self, saved: Path, round_index: int) -> None:
        """After the worker saved ``saved`` (its state before ``round_index``): offer it.
        A hard link keeps the bytes the header describes while the worker replaces the file."""
        if self._directory is None or round_index < 1:
            return
        path = self._directory / f"{self._run_id}.state-{round_index}.ckpt"
        try:
            with contextlib.suppress(FileNotFoundError):
                await trio.Path(path).unlink()
            await trio.to_thread.run_sync(os.link, saved, path)
            nbytes = (await trio.Path(path).stat()).st_size
        except OSError as exc:
            logger.info("not offering our state of round %d: %s", round_index, exc)
            return
        # Hashed when a joiner first asks (a state of gigabytes every round would cost seconds).
        self.service.offer = savedstate.Offer(round_index, {}, savedstate.LAZY, path, nbytes, savedstate.LAZY)
        self._offered.append(path)
        while len(self._offered) > KEEP_OFFERED:  # one being served may still be open: keep the previous one
            with contextlib.suppress(FileNotFoundError):
                await trio.Path(self._offered.pop(0)).unlink()

    async def gather(self, partners: list[str], directory: Path) -> list[tuple[str, Path, int]]:
        """Every partner's offered state, each into ``directory`` (``swarmtrain export
        --average``): (peer, file, round) for those that had one and sent it whole."""
        await trio.Path(directory).mkdir(parents=True, exist_ok=True)
        gathered = []
        for peer_id in partners:
            dest = directory / f"{peer_id}.ckpt"
            try:
                offer = await self.service.fetch(peer_id, dest)
            except ProtocolError as exc:
                logger.info("no state from %s: %s", peer_id, exc)
                continue
            if offer is not None:
                gathered.append((peer_id, dest, offer.round))
        return gathered

    async def _heads(self, partners: list[str], *, first: bool = False) -> dict[str, int]:
        """The round each peer offers (those that answer and offer one); ``first``: only
        until one offers."""
        heads: dict[str, int] = {}
        async with trio.open_nursery() as nursery:

            async def ask(peer_id: str) -> None:
                try:
                    head = await self.service.head(peer_id, race_connection=True)
                except ProtocolError as exc:
                    logger.info("no state header from %s: %s", peer_id, exc)
                    return
                if head is not None:
                    heads[peer_id] = head.round
                    if first:
                        nursery.cancel_scope.cancel()

            for peer_id in partners:
                nursery.start_soon(ask, peer_id)
        return heads

    async def anyone_ahead(self, partners: list[str]) -> bool:
        """Whether any of these peers offers a round's state (it is past round 0): as soon
        as one does; False once the others answered, or after ``AHEAD_ASK_S`` (a peer that
        cannot answer that soon is taken to start with us; if it was ahead after all, our
        rounds skip to its and a drifted replica resyncs: NoLoCo's pairing)."""
        heads: dict[str, int] = {}
        with trio.move_on_after(AHEAD_ASK_S) as bound:
            heads = await self._heads(partners, first=True)
        if bound.cancelled_caught:  # nobody offered by then (the first offer ends the asking)
            logger.info("asked whether anyone is past round 0: not all answered in %.0f s; starting", AHEAD_ASK_S)
        return bool(heads)

    async def join(
        self, partners: list[str], dest: Path, *, last_round: int, boundary_wait_s: float = BOUNDARY_WAIT_S
    ) -> Path | None:
        """Fetch the state of the run's current round into ``dest``, right after its peers'
        next boundary (the run's ``last_round`` has none; waited for ``boundary_wait_s`` at
        most, then the state they offer now); None if nobody is ahead."""
        heads = await self._heads(partners)
        target = vouched_round(list(heads.values()))
        if target is None:
            return None
        if target < last_round:
            watched = sorted(heads, key=lambda p: -heads[p])[:WATCHED]  # the two ahead and one more
            with trio.move_on_after(boundary_wait_s):
                while True:
                    await trio.sleep(BOUNDARY_POLL_S)
                    newer = await self._heads(watched)
                    moved = vouched_round(list(newer.values()))
                    if moved is not None and moved > target:
                        heads, target = newer, moved
                        break
        # Nearest at or below the vouched round first (they may have moved on since).
        for peer_id in sorted((p for p, r in heads.items() if r <= target), key=lambda p: -heads[p]):
            try:
                offer = await self.service.fetch(peer_id, dest)
            except ProtocolError as exc:
                logger.info("no state from %s: %s", peer_id, exc)
                continue
            if offer is None:
                continue
            if offer.round > target + 1:
                logger.info("%s's state is at round %d, past the vouched %d: not taken", peer_id, offer.round, target)
                continue
            self.joined_from = peer_id
            logger.info("joining at round %d from %s's state", offer.round, peer_id)
            return dest
        return None
