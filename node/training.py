"""A node's training: supervises its worker and runs each round's outer step with a peer.

What to train is the run's decision, not each node's: the run manifest (written by the
node that started the run, replicated to all) carries its RunSettings
(training/settings.py), whole. A trainer waits until it holds the manifest, adopts them
(saying so when its own differ), hands them to its worker unchanged, and keeps only local
settings: data shard, threads, pairing bound, upload cap. A run whose algorithm is "none" trains nothing.

At every round boundary the worker reports its losses and leaves φ and Δ in its outbox.
For NoLoCo we pair with one random live trainer (protocol/pairing.py; bounded wait, then
alone), the partner's payload lands in the worker's inbox, and the worker applies the
outer step. "local" trains alone, the baseline. Metrics feed ``status`` and the simulation
report: the loss curve, bytes moved, and how the time split between compute and waiting.
"""

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from node.config import TrainingConfig
from node.diloco import DilocoExchange
from node.supervisor import Supervisor, WorkerConnection, WorkerGone
from node.zo import ZoRounds
from protocol.data_channel import DataChannel
from protocol.exchange import TensorReceiver
from protocol.host import Host
from protocol.pairing import Pairing
from protocol.peers import BAN_POINTS, PeerTable
from protocol.ratelimit import RateLimit
from protocol.run import RunService
from protocol.state import Manifest, RunState
from training import settings
from training.settings import RunSettings
from training.worker_config import WorkerConfig

if TYPE_CHECKING:
    from trio_typing import TaskStatus

logger = logging.getLogger(__name__)

# Payload exchanges are bounded too: a partner that stops reading never holds us for long.
SEND_TIMEOUT_S = 120.0
MAX_PAYLOAD_NBYTES = 4 << 30


@dataclass(slots=True)
class TrainingMetrics:
    loss_curve: list[list[float]] = field(default_factory=list)
    """[step, validation loss] at the end of each round's inner steps."""
    rounds: int = 0
    rounds_with_partner: int = 0
    compute_s: float = 0.0
    """Inner steps and payload export, as the worker timed them."""
    sync_wait_s: float = 0.0
    """From a round's end until the worker was told to apply its outer step."""
    train_wall_s: float = 0.0
    """From the first worker's "ready" to the last outer step: compute_s / train_wall_s is
    the worker's utilization (the rest: waiting, evaluation, outer steps, restarts)."""
    finished: bool = False
    worker_starts: int = 0
    checkpoint_error: str | None = None
    """Why the last checkpoint could not be written (a full disk...), None once one was."""
    payloads_refused: int = 0
    """Partner payloads the worker refused (non-finite, out of bounds): each cost its sender."""


def adopt(ours: RunSettings, manifest: Manifest) -> RunSettings | None:
    """The run's settings (its creator's, whatever ``ours`` say); None if the run trains
    nothing or asks what this node cannot do (a model of a newer release): the node then
    stays on the network without training."""
    if not manifest.settings:
        logger.info("the run trains nothing (no settings): network only")
        return None
    try:
        theirs = settings.decode(manifest.settings)
    except settings.SettingsError as exc:
        logger.error("cannot train in this run (%s); staying on the network without training", exc)
        return None
    differ = ours.differences(theirs)
    if differ and ours != RunSettings():  # settings of our own: say they do not count here
        logger.warning("the run's settings replace ours: %s", ", ".join(differ))
    if not theirs.trains:
        logger.info("the run trains nothing (algorithm none): network only")
        return None
    logger.info(
        "training as the run says: %s, model %s, H=%d, %d rounds, compression %s",
        *(theirs.algorithm, theirs.model, theirs.inner.steps_per_round, theirs.rounds, theirs.compression),
    )
    return theirs


class TrainingService:
    def __init__(
        self,
        host: Host,
        peers: PeerTable,
        config: TrainingConfig,
        state: RunState,
        *,
        own_settings: RunSettings | None = None,
        listen_ip: str,
        log_path: str,
        upload_limit_mbps: float = 0.0,
        checkpoint_path: str | None = None,
        device: str = "cpu",
        identity_seed: bytes = b"",
        run_service: RunService | None = None,
    ) -> None:
        self._host = host
        self._peers = peers
        self._config = config
        self._own_settings = own_settings or RunSettings()
        """What we would train (the user's, for a run we create): the run's replace them."""
        self._run = RunSettings()
        """The run's settings, once adopted."""
        self._state = state
        self._listen_ip = listen_ip
        self._log_path = log_path
        self._checkpoint_path = checkpoint_path
        self._device = device
        self._supervisor: Supervisor | None = None
        self._zo: ZoRounds | None = None
        self._partner: str | None = None
        """This round's NoLoCo partner, until the worker's outer step says what it made of it."""
        self._identity_seed = identity_seed
        self._run_service = run_service
        self.adopted = trio.Event()
        """Set once the run's settings are known (training or not)."""
        self.metrics = TrainingMetrics()
        self._first_ready: float | None = None
        upload_limit = RateLimit.from_mbps(upload_limit_mbps)  # one cap for every send of this node
        self._pairing = Pairing(
            host, send_timeout_s=SEND_TIMEOUT_S, is_member=self._is_trainer_member, upload_limit=upload_limit
        )
        self._diloco = DilocoExchange(
            host, send_timeout_s=SEND_TIMEOUT_S, is_member=self._is_trainer_member, upload_limit=upload_limit
        )

    async def run(self, *, task_status: "TaskStatus[None]" = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while (manifest := self._state.manifest) is None:
            changed = self._state.changed
            if self._state.manifest is None:
                await changed.wait()
        run = adopt(self._own_settings, manifest)
        self.adopted.set()
        if run is None:
            return
        self._run = run
        config = self._config
        worker_config = WorkerConfig(
            run=run,
            node_index=config.shard_index,
            num_nodes=config.num_shards,
            threads=config.threads,
            checkpoint_path=self._checkpoint_path,
            device=self._device,
            compile=config.compile,
            # Without a shard of its own every node reads the whole corpus: draw other batches.
            batch_seed=None if config.num_shards > 1 else int.from_bytes(self._host.peer_id.encode()[-4:], "big"),
        )
        if run.algorithm == "zo":
            self._zo = ZoRounds(
                self._host,
                run_id=self._state.run_id,
                identity_seed=self._identity_seed,
                rounds=run.rounds,
                updates_per_round=run.inner.steps_per_round,
                partners=self._partners,
                # Our own batches always count (a stranger deleting our record must not stop us).
                is_member=lambda peer_id: peer_id == self._host.peer_id or peer_id in self._state.members,
                wait_s=config.pair_timeout_s,
                checkpoint_dir=Path(self._checkpoint_path).parent if self._checkpoint_path else None,
                gossip=self._run_service.push_zo if self._run_service else None,
            )
            self._zo.register()
            if self._run_service is not None:
                self._run_service.zo_hint = self._zo.sync.receive_hint
                self._run_service.zo_evidence = self._zo.sync.receive_evidence
                self._zo.sync.publish_evidence = self._run_service.push_zo_evidence
            self._supervisor = Supervisor(worker_config, self._zo_session, log_path=self._log_path)
            await self._train_zo(self._zo, self._supervisor)
            return
        self._supervisor = Supervisor(worker_config, self._session, log_path=self._log_path)
        await self._train(self._supervisor)

    async def _train_zo(self, zo: ZoRounds, supervisor: Supervisor) -> None:
        """Runs until the node stops: after the last round the log is still followed."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(zo.pull_forever)
            nursery.start_soon(zo.agree_forever)
            await supervisor.run()
            nursery.cancel_scope.cancel()

    async def _zo_session(self, worker: WorkerConnection) -> None:
        assert self._zo is not None
        if self._first_ready is None:
            self._first_ready = trio.current_time()

        def on_step(step: dict[str, Any]) -> None:
            point = [float(step["round"]), float(step["val_loss"])]
            if step.get("final"):  # the final weights changed: late updates arrived
                self.metrics.loss_curve[-1:] = [point]
                return
            self.metrics.rounds += 1
            self.metrics.loss_curve.append(point)
            self.metrics.compute_s += float(step.get("compute_s", 0.0))
            self.metrics.train_wall_s = trio.current_time() - (self._first_ready or 0.0)

        def on_finished() -> None:
            assert self._zo is not None and self._zo.final_val_loss is not None
            self.metrics.loss_curve.append([float(self._run.rounds), self._zo.final_val_loss])
            self.metrics.finished = True

        self.metrics.rounds = 0
        self.metrics.loss_curve.clear()
        await self._zo.session(worker, on_step, on_finished)

    async def _train(self, supervisor: Supervisor) -> None:
        channel = DataChannel(self._listen_ip)
        inbox = self._diloco if self._run.algorithm == "diloco" else self._pairing
        receiver = TensorReceiver(
            self._host,
            inbox.accept_payload,
            authorize=inbox.authorize,
            max_payload_nbytes=MAX_PAYLOAD_NBYTES,
            timeout_s=SEND_TIMEOUT_S,
            channel=channel,
        )
        async with trio.open_nursery() as nursery:
            await nursery.start(channel.run)
            await nursery.start(self._pairing.run)
            receiver.register()
            await supervisor.run()
            self.metrics.finished = True
            logger.info(
                "training finished: %d rounds, %d with a partner", self.metrics.rounds, self.metrics.rounds_with_partner
            )
            nursery.cancel_scope.cancel()

    def status(self) -> dict[str, Any] | None:
        """None while not training (no manifest yet, or the run trains nothing)."""
        if self._supervisor is None:
            return None
        m = self.metrics
        return {
            "algorithm": self._run.algorithm,
            "rounds": m.rounds,
            "rounds_with_partner": m.rounds_with_partner,
            "final_loss": m.loss_curve[-1][1] if m.loss_curve else None,
            "loss_curve": m.loss_curve,
            "bytes_sent": self._pairing.bytes_sent + self._diloco.bytes_sent,
            "bytes_received": self._pairing.bytes_received + self._diloco.bytes_received,
            "compute_s": round(m.compute_s, 3),
            "sync_wait_s": round(m.sync_wait_s, 3),
            "train_wall_s": round(m.train_wall_s, 3),
            "utilization": round(m.compute_s / m.train_wall_s, 4) if m.train_wall_s > 0 else None,
            "finished": m.finished,
            "worker_starts": self._supervisor.num_starts,
            "payloads_refused": m.payloads_refused,
            "checkpoint_error": m.checkpoint_error,
            **(self._zo.status() if self._zo else {}),
        }

    def _note_save(self, done: dict[str, Any]) -> None:
        """A checkpoint the worker could not write (a full disk): said once per new error, shown
        in status until a save succeeds again."""
        error = done.get("save_error")
        error = str(error)[:300] if error else None
        if error and error != self.metrics.checkpoint_error:
            logger.error("the worker could not save its checkpoint: %s; training goes on, it retries", error)
        elif not error and self.metrics.checkpoint_error:
            logger.info("checkpoints are saved again")
        self.metrics.checkpoint_error = error

    async def _judge_partner(self, done: dict[str, Any]) -> None:
        """A partner whose payload the worker refused (non-finite, out of bounds) pays for it."""
        rejected = done.get("rejected")
        if self._partner is not None and isinstance(rejected, str):
            logger.warning("round %s: refused %s's payload: %s", done.get("round"), self._partner, rejected)
            self.metrics.payloads_refused += 1
            # Honest partners stay far inside the bounds (training/noloco.py: measured ≤ 1.74
            # and 3.7 against 8 and 16), and a NaN is never honest: no second chance.
            await self._host.punish(self._partner, f"NoLoCo payload refused: {rejected[:200]}", points=BAN_POINTS)

    def _partners(self) -> list[str]:
        return sorted(
            p for p, info in self._peers.live().items() if info.role == "trainer" and self._is_trainer_member(p)
        )

    def _is_trainer_member(self, peer_id: str) -> bool:
        """A peer we train with: its member record (signed by it) says it trains in this run."""
        record = self._state.members.get(peer_id)
        return record is not None and record.role == "trainer" and not self._peers.is_banned(peer_id)

    async def _session(self, worker: WorkerConnection) -> None:
        assert worker.outbox is not None and worker.inbox is not None
        assert worker.outbox.buf is not None and worker.inbox.buf is not None
        if self._first_ready is None:
            self._first_ready = trio.current_time()
        # A restarted worker resumes from its checkpoint: rounds after it are done again.
        self.metrics.rounds = worker.start_round
        del self.metrics.loss_curve[worker.start_round :]
        if worker.start_round >= self._run.rounds:
            return
        self._diloco.payload_nbytes = worker.payload_nbytes
        outbox = worker.outbox.buf[: worker.payload_nbytes]
        inbox = worker.inbox.buf[: worker.payload_nbytes]
        try:
            while True:
                message = await worker.receive()
                if message["t"] == "round_done":
                    await self._outer(worker, message, outbox, inbox)
                elif message["t"] == "accumulated":
                    raise WorkerGone("an 'accumulated' nobody asked for")
                elif message["t"] == "outer_done":
                    await self._judge_partner(message)
                    self._note_save(message)
                    self.metrics.rounds += 1
                    self.metrics.train_wall_s = trio.current_time() - self._first_ready
                    self.metrics.rounds_with_partner += int(message.get("used_peer") is True)
                    if self.metrics.rounds >= self._run.rounds:
                        return
                else:
                    raise WorkerGone(f"unexpected {message['t']!r} from the worker")
        finally:
            for view in (outbox, inbox):
                try:
                    view.release()
                except BufferError:
                    # A send of this round still reads it (the worker died mid-exchange); the
                    # view goes when that send ends. Never let this take the node down.
                    logger.info("worker buffers still in use by a transfer; released later")

    async def _outer(
        self, worker: WorkerConnection, done: dict[str, Any], outbox: memoryview, inbox: memoryview
    ) -> None:
        round_index = int(done["round"])
        self.metrics.loss_curve.append([float(done.get("step", 0)), float(done["val_loss"])])
        self.metrics.compute_s += float(done.get("compute_s", 0.0))
        started = trio.current_time()
        if self._run.algorithm == "diloco":
            await self._diloco_outer(worker, round_index, outbox, inbox)
            self.metrics.sync_wait_s += trio.current_time() - started
            return
        partner = None
        self._partner = None
        if self._run.algorithm == "noloco":
            partner = self._partner = await self._pairing.find_partner(
                round_index, outbox, inbox, self._partners(), timeout_s=self._config.pair_timeout_s
            )
        self.metrics.sync_wait_s += trio.current_time() - started
        logger.info(
            "round %d: val loss %.3f, %s",
            round_index,
            done["val_loss"],
            f"paired with {partner}" if partner else "alone",
        )
        await worker.send("outer_go", round=round_index, peer=partner is not None)

    async def _diloco_outer(
        self, worker: WorkerConnection, round_index: int, outbox: memoryview, inbox: memoryview
    ) -> None:
        payloads = await self._diloco.gather(
            round_index, outbox, self._partners(), timeout_s=self._config.pair_timeout_s
        )
        for peer_id, data in sorted(payloads.items()):
            inbox[:] = data
            await worker.send("accumulate", round=round_index, key=peer_id)
            reply = await worker.receive()
            if reply["t"] != "accumulated":
                raise WorkerGone(f"expected 'accumulated', got {reply['t']!r}")
            if reply.get("ok") is not True:
                reason = str(reply.get("reason"))[:200]
                await self._host.punish(peer_id, f"DiLoCo payload refused: {reason}", points=BAN_POINTS)
        logger.info("round %d: DiLoCo over %d nodes", round_index, len(payloads) + 1)
        await worker.send("outer_go", round=round_index, key=self._host.peer_id)
