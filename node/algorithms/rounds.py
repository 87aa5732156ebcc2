"""The round loop every φ/Δ algorithm shares on the daemon side (local, NoLoCo, DiLoCo).

At every round boundary the worker reports its losses and leaves φ and Δ in its outbox;
the algorithm's ``exchange`` does what the round needs with peers (NoLoCo: one partner's
payload into the inbox; DiLoCo: every live trainer's, one ``accumulate`` each; local:
nothing) and says ``outer_go``; the worker's ``outer_done`` closes the round. Payloads
arrive over the direct data channel (protocol/net/exchange.py), each authorized first by the
algorithm's ``Inbox``, before a byte is allocated.
"""

import dataclasses
import logging
import math
import os
from functools import partial
from pathlib import Path
from typing import Any, ClassVar, Protocol

import trio

from node.algorithms.base import Context
from node.algorithms.joining import BOUNDARY_WAIT_S, MEET_WAIT_S, StateOffers, resync_wait_s
from node.supervisor import RestartWorker, Supervisor, WorkerConnection, WorkerGone
from node.waiting import until
from protocol.net.data_channel import DataChannel
from protocol.net.exchange import Payload, TensorReceiver
from protocol.net.peers import BAN_POINTS, PENALTY_POINTS

logger = logging.getLogger("node.training")

# Payload exchanges are bounded too: a partner that stops reading never holds us for long.
SEND_TIMEOUT_S = 120.0
MAX_PAYLOAD_NBYTES = 4 << 30


def _seconds(value: object) -> float:
    """A duration the worker reported: a finite, non-negative float, or nothing (0)."""
    return value if isinstance(value, float) and 0.0 <= value < math.inf else 0.0


class Inbox(Protocol):
    def authorize(self, peer_id: str, round_index: int, nbytes: int) -> str | None: ...

    async def accept_payload(self, peer_id: str, payload: Payload) -> None: ...


class PayloadRounds:
    """The shared loop; a subclass says what a round exchanges (``exchange``)."""

    REPORT_KEYS: ClassVar[tuple[str, ...]] = ("start_round", "rounds_jumped", "joined_from", "memory", "expert_load")

    async def punish_refused(self, peer_id: str, what: str, reason: str, *, drifted: object) -> None:
        """A payload the worker refused costs its sender: a NaN or one far past the bounds is
        never honest (a ban); one just past them is a replica that drifted (a point;
        training/noloco.py PartnerBounds). ``drifted``: the worker's word, True or not."""
        points = PENALTY_POINTS if drifted is True else BAN_POINTS
        await self.ctx.host.punish(peer_id, f"{what} payload refused: {reason[:200]}", points=points)

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        config = dataclasses.replace(ctx.worker_config, ask_start_from=True)
        self.supervisor = Supervisor(config, self._session, log_path=ctx.log_path)
        self.supervisor.starting_point = self._join
        self.supervisor.before_start = self._set_aside
        self.states = StateOffers(ctx.host, ctx.state.run_id, ctx.checkpoint_dir)
        self.start_round = 0
        self._late = False
        self.resync_reason: str | None = None
        """Set by a subclass when our replica has drifted from its peers': after this round
        the worker starts again from a peer's state (``_resync``)."""
        self.not_from: set[str] = set()
        """Peers whose state a resync does not take (their payloads were refused as too far)."""
        self.resyncs = 0
        self._forwarded: list[int] = []
        """Our data channels' ports a node public through UPnP has forwarded (``forward_data_port``)."""
        self._curve_rounds: list[int] = []
        """The round of each point of the loss curve (a skipped round has none)."""
        self._skips: list[tuple[int, int]] = []
        """(round, rounds skipped after it) per skip our worker made (NoLoCo: ``rounds_skipped``)."""
        self._jumps: list[tuple[int, int]] = []
        """(round, rounds left out before it) per worker that started past the rounds done
        (``rounds_jumped``)."""
        self._own_aside: Path | None = None
        """Our own state, moved aside by a resync: where we start if no peer offers one."""
        self._offered_at: float | None = None
        self._offer_gap_s: float | None = None
        """The time between our last two offers of a state (``resync_wait_s``)."""
        self._aside_reason: str | None = None
        """Why our state goes aside before the next worker starts (a resync), if it does."""

    @property
    def rounds_jumped(self) -> int:
        """Rounds no worker of ours trained because the next one started from a state
        further on (a resync: a peer's state at the run's round; a joiner's worker restarted
        before its first checkpoint, which fetches a newer state). Not skips: those are
        bounded (``lag.rounds_to_skip``) against peers lying about their rounds, and a
        restart is a different matter. A loss curve has a point for every round from
        ``start_round`` but these and the skipped ones (``_restart_at``)."""
        return sum(k for _, k in self._jumps)

    @property
    def rounds_skipped(self) -> int:
        """Rounds our worker left out to catch up with peers far ahead (NoLoCo), as of its state."""
        return sum(k for _, k in self._skips)

    # What a subclass provides.

    def inbox(self) -> Inbox | None:
        """Where peers' payloads land (None: this algorithm takes none)."""
        return None

    async def serve(self, nursery: trio.Nursery) -> None:
        """Start what must run while training (a pairing service...)."""

    def ready(self, worker: WorkerConnection) -> None:
        """A worker said ready (its payload size is known now)."""

    async def opening(self, worker: WorkerConnection) -> None:
        """Before the worker's first round (SPES: which experts it trains)."""

    async def exchange(
        self, worker: WorkerConnection, done: dict[str, Any], outbox: memoryview, inbox: memoryview
    ) -> None:
        """This round's exchange with peers (``done``: the worker's ``round_done``), ending
        with ``outer_go`` to the worker."""
        raise NotImplementedError

    async def linger(self) -> None:
        """After the last round, before the worker stops: serve what peers still need of it
        (NoLoCo: pulls of the last round by a node just behind us)."""

    async def release_outbox(self, *, grace: bool = True) -> None:
        """The worker is about to overwrite its outbox (or is gone): nothing may read last
        round's payload after this returns (NoLoCo: peers pulling it; ``grace``: a pull under
        way may finish within a bound, else it is cut at once)."""

    async def judge(self, done: dict[str, Any]) -> None:
        """The worker's ``outer_done``: penalize a peer whose payload it refused."""

    # The shared part.

    @staticmethod
    def settled(statuses: list[dict[str, Any]]) -> bool:
        return True

    @staticmethod
    def summary(statuses: list[dict[str, Any]]) -> dict[str, Any]:
        return {}

    def traffic(self) -> dict[str, Any]:
        """Payload bytes moved (``bytes_sent``, ``bytes_received``)."""
        return {"bytes_sent": 0, "bytes_received": 0}

    def status(self) -> dict[str, Any]:
        return {
            **self.traffic(),
            "start_round": self.start_round,
            "rounds_jumped": self.rounds_jumped,
            "joined_from": self.states.joined_from,
            "memory": self.ctx.metrics.memory,
            "expert_load": self.ctx.metrics.expert_load,
            "download": self.states.service.download,
        }

    async def train(self) -> None:
        inbox = self.inbox()
        self.states.register()
        self._late = await self._anyone_ahead()
        self.joining(self._late)  # from now: our worker builds its model before ``_join``
        try:
            await self._train(inbox)
        finally:
            for port in self._forwarded:  # the channels closed with the nursery: so do their forwards
                self.ctx.host.unforward_data_port(port)
            self._forwarded.clear()

    def forward_data_port(self, port: int) -> None:
        """A data channel of ours listens on ``port`` for as long as ``train`` runs: a node
        public through UPnP has the router forward it (its senders reach it), until then."""
        self._forwarded.append(port)
        self.ctx.host.forward_data_port(port)

    async def _train(self, inbox: "Inbox | None") -> None:
        async with trio.open_nursery() as nursery:
            if inbox is not None:
                channel = DataChannel(*self.ctx.listen_ips)
                receiver = TensorReceiver(
                    self.ctx.host,
                    inbox.accept_payload,
                    authorize=inbox.authorize,
                    max_payload_nbytes=MAX_PAYLOAD_NBYTES,
                    timeout_s=SEND_TIMEOUT_S,
                    channel=channel,
                )
                await nursery.start(channel.run)
                self.forward_data_port(channel.port)
                receiver.register()
            await self.serve(nursery)
            await self.supervisor.run()
            self._finished()
            nursery.cancel_scope.cancel()

    def _finished(self) -> None:
        metrics = self.ctx.metrics
        if not metrics.finished:
            metrics.finished = True
            logger.info("training finished: %d rounds, %d with a partner", metrics.rounds, metrics.rounds_with_partner)

    async def _anyone_ahead(self) -> bool:
        """Whether we start late: no checkpoint of our own, and a peer already offers a
        round's state (asked when the node starts, so nodes that start a run together all
        begin at round 0, however long one's worker takes to build its model)."""
        own = self.ctx.worker_config.checkpoint_path
        if own is None or self.ctx.checkpoint_dir is None or await trio.Path(own).exists():
            return False
        me = self.ctx.host.peer_id
        if not any(p != me and r.role == "trainer" for p, r in self.ctx.state.members.items()):
            return False  # the run's first trainer: nobody can be ahead
        with trio.move_on_after(MEET_WAIT_S):  # a bounded wait to meet the live ones, then we ask
            await until(lambda: bool(self.ctx.partners()), lambda: [self.ctx.peers_changed(), self.ctx.state.changed])
        return await self.states.anyone_ahead(self.ctx.partners())

    def round_time_s(self) -> float | None:
        """Our rounds' time, boundary to boundary (None: not known; NoLoCo's pairing measures it)."""
        return None

    def joining(self, waiting: bool) -> None:
        """We will start from a peer's state, or no longer (from when we know we are late, or
        resync, until ``_join`` ends): NoLoCo's pairing then tells askers we will not be at
        their round."""

    async def _join(self) -> str | None:
        """The worker built its model and has no checkpoint of its own: if we start late, a
        peer's state at the run's round to start from (node/algorithms/joining.py), fetched
        now that the worker is ready for it, at the peers' next round boundary, so the
        joiner starts as close behind them as it can; else None (round 0)."""
        try:
            if not self._late or self.ctx.checkpoint_dir is None:
                return None
            dest = self.ctx.checkpoint_dir / f"{self.ctx.state.run_id}.joined.ckpt"
            # A resync: we trained with them a moment ago, and know how long our rounds take.
            wait_s = (
                BOUNDARY_WAIT_S if self._own_aside is None else resync_wait_s(self.round_time_s(), self._offer_gap_s)
            )
            self.joining(True)
            fetched = await self.states.join(
                self._state_sources(), dest, last_round=self.ctx.run.round_limit, boundary_wait_s=wait_s
            )
        finally:
            self.joining(False)
        if fetched is None and self._own_aside is not None:
            logger.warning("no peer offers its state: going on from our own (%s)", self._own_aside)
            fetched = self._own_aside
        self._own_aside = None
        return None if fetched is None else str(fetched)

    async def _resync(self) -> None:
        """Our worker refused several peers' payloads in a row as too far from ours
        (``resync_reason``): the replica that drifted is ours (in the soak, restarted nodes
        that trained mostly alone drifted 16–25 updates away and were refused by everyone,
        for good). Like a joiner, we take a peer's state at the run's round; our own is kept
        aside (``_set_aside``, once the worker has exited: its last checkpoint write lands
        first), and is where we go on if no peer offers one."""
        reason, self.resync_reason = self.resync_reason, None
        own = self.ctx.worker_config.checkpoint_path
        if own is None or self.ctx.checkpoint_dir is None:
            logger.warning("our weights drifted from our peers' (%s), but we keep no state to replace", reason)
            return
        if not self._state_sources():
            # A run of two: nobody else to tell which of us drifted, nor to take a state from.
            logger.warning("our weights and our peers' are far apart (%s); no other peer to take a state from", reason)
            return
        self._aside_reason = reason
        self.resyncs += 1
        self.joining(True)  # from now: the worker stops and starts again before ``_join``
        raise RestartWorker(f"our weights drifted from our peers' ({reason}): taking a peer's state")

    def _state_sources(self) -> list[str]:
        """The peers a join (or a resync) takes a state from: those whose payloads we did not
        refuse as too far from ours; where that is none and we have more than one, all of
        them (they agree with each other, not with us: the replica that drifted is ours).
        Without the second rule a node in a run of three that drifted refused both its peers
        and never resynced: seen in a full run of the suite, a late joiner refused its peers'
        payloads to the end of the run, a point each, and banned one of them."""
        partners = self.ctx.partners()
        others = [p for p in partners if p not in self.not_from]
        # Counted among our partners now: one of the refused may be gone or banned since.
        return others if others or len(partners) < 2 else partners

    async def _set_aside(self) -> None:
        """Before the worker starts again after ``_resync``: our state moved aside, so the
        new worker starts from a peer's."""
        reason, self._aside_reason = self._aside_reason, None
        own = self.ctx.worker_config.checkpoint_path
        if reason is None or own is None:
            return
        aside = Path(f"{own}.drifted")
        try:
            await trio.to_thread.run_sync(os.replace, own, aside)
        except OSError as exc:
            logger.warning("our weights drifted from our peers' (%s); cannot move our state aside: %s", reason, exc)
            return
        self._late, self._own_aside = True, aside

    def _restart_at(self, start: int) -> None:
        """A worker starts at round ``start``: the bookkeeping of the rounds before it. A
        restarted worker resumes from its checkpoint, and rounds from there are done again:
        their points, and the parts of skips and jumps from there, go. One that starts past
        the rounds counted done (``metrics.rounds``: a resync's state, a joiner's newer
        fetch) leaves those rounds out: a jump, and a point of a round whose outer step never
        came goes with it. Where nothing is left before ``start``, the node begins there
        (a joiner: its peer's round). Every round from ``start_round`` then has a point, or
        is skipped or jumped."""
        metrics = self.ctx.metrics
        done = metrics.rounds
        kept = sum(1 for r in self._curve_rounds if r < min(start, done))
        del metrics.loss_curve[kept:], self._curve_rounds[kept:]
        # A skip (r, k) left out rounds r + 1 .. r + k; a jump (s, k) rounds s − k .. s − 1.
        self._skips = [(r, min(k, start - 1 - r)) for r, k in self._skips if r + 1 < start]
        self._jumps = [(min(s, start), k - max(0, s - start)) for s, k in self._jumps if s - k < start]
        if not (metrics.loss_curve or self._skips or self._jumps):
            self.start_round = start
        elif start > done:
            self._jumps.append((start, start - done))
        metrics.rounds = start
        if start < self.ctx.run.round_limit:  # the run's last round is (again) to come
            metrics.full_val_loss = None
        metrics.outer_s_rounds[:] = [entry for entry in metrics.outer_s_rounds if entry[0] < start]

    async def _session(self, worker: WorkerConnection) -> None:
        assert worker.outbox is not None and worker.inbox is not None
        assert worker.outbox.buf is not None and worker.inbox.buf is not None
        metrics = self.ctx.metrics
        if metrics.first_ready is None:
            metrics.first_ready = trio.current_time()
        self._restart_at(worker.start_round)
        if worker.start_round >= self.ctx.run.round_limit:
            return
        self.ready(worker)
        await self.opening(worker)
        worker.on_saved = self._saved
        outbox = worker.outbox.buf[: worker.payload_nbytes]
        inbox = worker.inbox.buf[: worker.payload_nbytes]
        try:
            while True:
                message = await worker.receive()
                if message["t"] == "inner_done":
                    await self.release_outbox()
                    await worker.send("outbox_free", round=message.get("round"))
                elif message["t"] == "round_done":
                    metrics.loss_curve.append([float(message.get("step", 0)), float(message["val_loss"])])
                    self._curve_rounds.append(int(message["round"]))
                    metrics.compute_s += float(message.get("compute_s", 0.0))
                    metrics.eval_s += _seconds(message.get("eval_s"))
                    tokens = message.get("tokens")
                    metrics.tokens += tokens if type(tokens) is int and tokens > 0 else 0
                    memory = message.get("memory")
                    if isinstance(memory, dict):
                        metrics.memory = {k: int(v) for k, v in memory.items() if type(v) is int}
                    load = message.get("expert_load")
                    if isinstance(load, list) and all(isinstance(v, float) for v in load):
                        metrics.expert_load = load
                    # The last round's checkpoint is offered as soon as it is written, pairing or not.
                    await worker.while_taking_saved(partial(self.exchange, worker, message, outbox, inbox))
                elif message["t"] == "accumulated":
                    raise WorkerGone("an 'accumulated' nobody asked for")
                elif message["t"] == "outer_done":
                    await self.judge(message)
                    # Rounds the worker left out to catch up with its peers count as done.
                    skipped = message.get("skipped")
                    skipped = skipped if type(skipped) is int and 0 <= skipped < self.ctx.run.round_limit else 0
                    if skipped:
                        self._skips.append((int(message["round"]), skipped))
                    metrics.rounds += 1 + skipped
                    # The run's final full validation comes after its last outer step: not training time.
                    full_eval_s = _seconds(message.get("eval_s"))
                    metrics.train_wall_s = trio.current_time() - metrics.first_ready - full_eval_s
                    metrics.rounds_with_partner += int(message.get("used_peer") is True)
                    overlapped = message.get("overlapped")
                    metrics.overlapped_steps += overlapped if type(overlapped) is int and overlapped >= 0 else 0
                    metrics.sync_wait_s += _seconds(message.get("wait_s"))
                    metrics.outer_s += _seconds(message.get("outer_s"))
                    metrics.outer_s_rounds.append([int(message["round"]), round(_seconds(message.get("outer_s")), 3)])
                    metrics.save_wait_s += _seconds(message.get("save_wait_s"))
                    metrics.full_eval_s += full_eval_s
                    full = message.get("full_val_loss")
                    if isinstance(full, float) and math.isfinite(full):
                        metrics.full_val_loss = full
                    if metrics.rounds >= self.ctx.run.round_limit:
                        self._finished()
                        await self.linger()
                        return
                    if self.resync_reason is not None:
                        await self._resync()
                else:
                    raise WorkerGone(f"unexpected {message['t']!r} from the worker")
        finally:
            with trio.CancelScope(shield=True):
                await self.release_outbox(grace=False)
            for view in (outbox, inbox):
                try:
                    view.release()
                except BufferError:
                    # A send of this round still reads it (the worker died mid-exchange); the
                    # view goes when that send ends. Never let this take the node down.
                    logger.info("worker buffers still in use by a transfer; released later")

    async def _saved(self, saved: dict[str, Any]) -> None:
        """The worker's checkpoint of a round is on disk (training/saver.py): offered to
        joiners from the round after it; or it could not be written (a full disk): said once
        per new error, shown in status until a save succeeds again."""
        own = self.ctx.worker_config.checkpoint_path
        round_index = saved.get("round")
        if own is not None and not saved.get("save_error") and type(round_index) is int and round_index >= 0:
            await self.states.offer(Path(own), round_index + 1)
            now = trio.current_time()
            if self._offered_at is not None:
                self._offer_gap_s = now - self._offered_at
            self._offered_at = now
        metrics = self.ctx.metrics
        error = saved.get("save_error")
        error = str(error)[:300] if error else None
        if error and error != metrics.checkpoint_error:
            logger.error("the worker could not save its checkpoint: %s; training goes on, it retries", error)
        elif not error and metrics.checkpoint_error:
            logger.info("checkpoints are saved again")
        metrics.checkpoint_error = error
