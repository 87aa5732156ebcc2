"""A node's training: adopts the run's settings and hands over to the run's algorithm.

What to train is the run's decision, not each node's: the run manifest (written by the
node that started the run, replicated to all) carries its RunSettings
(training/settings.py), whole. A trainer waits until it holds the manifest, adopts them
(saying so when its own differ), hands them to its worker unchanged, and keeps only local
settings: data shard, threads, pairing bound, upload cap. A run whose algorithm is "none" trains nothing.

The algorithm (node/algorithms/: NoLoCo, DiLoCo, local, ZO) supervises the worker and
does each round's exchange with peers. Metrics feed ``status`` and the simulation report:
the loss curve, bytes moved, and how the time split between compute and waiting.
"""

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from node import algorithms
from node.algorithms import Algorithm, Context, TrainingMetrics
from node.algorithms.base import thinned
from node.config import TrainingConfig
from protocol.net.hostlike import TensorHostLike
from protocol.net.peers import PeerTable
from protocol.net.traffic import TRAFFIC
from protocol.ratelimit import RateLimit
from protocol.runstate.run import RunService
from protocol.runstate.state import Manifest, RunState
from training import corpus, settings, tokenizer, validation
from training.files import write_atomic
from training.settings import RunSettings
from training.worker_config import WorkerConfig

if TYPE_CHECKING:
    from trio_typing import TaskStatus

logger = logging.getLogger(__name__)

__all__ = ["TrainingMetrics", "TrainingService", "adopt"]


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
    budget = f"{theirs.rounds} rounds" if theirs.rounds else "until the nodes stop"
    logger.info(
        "training as the run says: %s, model %s, H=%d, %s, compression %s",
        *(theirs.algorithm, theirs.model, theirs.inner.steps_per_round, budget, theirs.compression),
    )
    return theirs


def data_for_run(run: RunSettings, path: str | None, ours: str) -> tuple[str | None, str | None]:
    """The data path the worker trains on in this run (None: the embedded corpus), and why we
    cannot train in it (None if we can). ``path``, ``ours``: our --data and its hash."""
    if not run.data_sha256:
        if path is not None:
            logger.warning("the run trains on the built-in corpus: --data %s is not used", path)
        return None, None
    if path is None:
        return None, (
            f"the run trains on its own data (SHA-256 {run.data_sha256[:16]}…): "
            "start the node with --data pointing at a copy of it"
        )
    if ours != run.data_sha256:
        return None, (
            f"--data {path} (SHA-256 {ours[:16]}…) is not the run's data (SHA-256 {run.data_sha256[:16]}…): "
            "every trainer needs the same files"
        )
    return path, None


def tokenizer_for_run(run: RunSettings, data_path: str | None, cache: Path) -> tuple[Path | None, str | None]:
    """The run's tokenizer file (None: bytes), trained here on the run's text once and kept
    at ``cache``, and why we cannot train with it (ours is not the creator's). Blocking:
    it reads the text and trains (about a second on the embedded corpus)."""
    vocab = tokenizer.bpe_vocab(run.tokenizer)
    if vocab is None:
        return None, None
    try:
        ours = cache.read_text(encoding="utf-8")
    except FileNotFoundError:
        ours = ""
    if not ours or (run.tokenizer_sha256 and tokenizer.sha256(ours) != run.tokenizer_sha256):
        logger.info("training the run's tokenizer (%s) on its text", run.tokenizer)
        ours = tokenizer.train_bpe(corpus.read_corpus(None if data_path is None else Path(data_path)), vocab)
        write_atomic(cache, ours.encode())
    if run.tokenizer_sha256 and tokenizer.sha256(ours) != run.tokenizer_sha256:
        return None, (
            f"the tokenizer this node trained (SHA-256 {tokenizer.sha256(ours)[:16]}…) is not the run's "
            f"({run.tokenizer_sha256[:16]}…): another release of the tokenizers library? Install the creator's"
        )
    return cache, None


class TrainingService:
    def __init__(
        self,
        host: TensorHostLike,
        peers: PeerTable,
        config: TrainingConfig,
        state: RunState,
        *,
        own_settings: RunSettings | None = None,
        data_path: str | None = None,
        tokenizer_file: Path | None = None,
        listen_ips: list[str],
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
        self._data_path = data_path
        self._tokenizer_file = tokenizer_file
        """Where the run's BPE tokenizer is kept once trained (a run with one needs it)."""
        self.refusal: str | None = None
        """Why this node does not train in the run it is in (its data is not the run's...)."""
        self._state = state
        self._listen_ips = listen_ips
        self._log_path = log_path
        self._checkpoint_path = checkpoint_path
        self._device = device
        self._identity_seed = identity_seed
        self._run_service = run_service
        self._upload_limit = RateLimit.from_mbps(upload_limit_mbps)  # one cap for every send of this node
        self.algorithm: Algorithm | None = None
        """The run's algorithm (node/algorithms/), once its settings are adopted."""
        self.adopted = trio.Event()
        """Set once the run's settings are known (training or not)."""
        self.started = trio.Event()
        """Set once ``algorithm`` is there (before its worker starts), or the run trains nothing."""
        self.metrics = TrainingMetrics()

    async def run(self, *, task_status: "TaskStatus[None]" = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while (manifest := self._state.manifest) is None:
            changed = self._state.changed
            if self._state.manifest is None:
                await changed.wait()
        run = adopt(self._own_settings, manifest)
        data_path, self.refusal = (
            (None, None) if run is None else data_for_run(run, self._data_path, self._own_settings.data_sha256)
        )
        tokenizer_path: Path | None = None
        cache = self._tokenizer_file
        if run is not None and cache is None and tokenizer.bpe_vocab(run.tokenizer) is not None:
            self.refusal = "the run trains with a BPE tokenizer and this node has nowhere to keep one"
        if run is not None and self.refusal is None and cache is not None:
            try:
                tokenizer_path, self.refusal = await trio.to_thread.run_sync(tokenizer_for_run, run, data_path, cache)
            except (corpus.CorpusError, OSError) as exc:
                self.refusal = f"cannot make the run's tokenizer: {exc}"
        if self.refusal is not None:
            logger.error("not training in this run: %s; staying on the network", self.refusal)
            run = None
        self.adopted.set()
        if run is None:
            self.started.set()
            return
        config = self._config
        vocab = {} if tokenizer_path is None else {"vocab_size": tokenizer.Codec.load(tokenizer_path).vocab_size}
        worker_config = WorkerConfig(
            run=run,
            data_path=data_path,
            tokenizer_path=None if tokenizer_path is None else str(tokenizer_path),
            model_overrides=vocab,
            node_index=config.shard_index,
            num_nodes=config.num_shards,
            threads=config.threads,
            slowdown=config.slowdown,
            checkpoint_path=self._checkpoint_path,
            device=self._device,
            compile=config.compile,
            # Without a shard of its own every node reads the whole corpus: draw other batches.
            batch_seed=None if config.num_shards > 1 else int.from_bytes(self._host.peer_id.encode()[-4:], "big"),
        )
        ctx = Context(
            host=self._host,
            state=self._state,
            run=run,
            config=config,
            worker_config=worker_config,
            metrics=self.metrics,
            partners=self._partners,
            is_member=self._is_trainer_member,
            peers_changed=lambda: self._peers.changed,
            listen_ips=self._listen_ips,
            upload_limit=self._upload_limit,
            log_path=self._log_path,
            checkpoint_dir=Path(self._checkpoint_path).parent if self._checkpoint_path else None,
            identity_seed=self._identity_seed,
            run_service=self._run_service,
        )
        self.algorithm = algorithms.create(run.algorithm, ctx)
        self.started.set()
        await self.algorithm.train()

    def status(self) -> dict[str, Any] | None:
        """None while not training (no manifest yet, or the run trains nothing)."""
        if self.algorithm is None:
            return None
        m = self.metrics
        total = self.algorithm.ctx.run.rounds  # 0: until the nodes stop (no end, no time left)
        trained_here = len(m.loss_curve)  # rounds this node trained (from where it started)
        per_round_s = m.train_wall_s / trained_here if trained_here and m.train_wall_s > 0 else None
        return {
            "algorithm": self.algorithm.ctx.run.algorithm,
            "device": self.algorithm.supervisor.device,
            "data_sha256": self.algorithm.ctx.run.data_sha256 or None,
            "rounds": m.rounds,
            "rounds_total": total or None,
            "tokens": m.tokens,
            "tokens_per_s": round(m.tokens / m.train_wall_s, 1) if m.tokens and m.train_wall_s > 0 else None,
            "eta_s": None
            if m.finished or per_round_s is None or not total
            else round(max(0, total - m.rounds) * per_round_s, 1),
            "rounds_with_partner": m.rounds_with_partner,
            "final_loss": m.loss_curve[-1][1] if m.loss_curve else None,
            "loss_curve": thinned(m.loss_curve),  # the points of at most 512 rounds, evenly spread
            "rounds_trained_here": trained_here,
            **self._validation_blocks(),
            "full_val_loss": m.full_val_loss,
            "compute_s": round(m.compute_s, 3),
            "sync_wait_s": round(m.sync_wait_s, 3),
            "eval_s": round(m.eval_s, 3),
            "full_eval_s": round(m.full_eval_s, 3),
            "outer_s": round(m.outer_s, 3),
            "outer_s_rounds": thinned(m.outer_s_rounds),
            "save_wait_s": round(m.save_wait_s, 3),
            "overlapped_steps": m.overlapped_steps,
            "train_wall_s": round(m.train_wall_s, 3),
            "utilization": round(m.compute_s / m.train_wall_s, 4) if m.train_wall_s > 0 else None,
            "finished": m.finished,
            "worker_starts": self.algorithm.supervisor.num_starts,
            "session_errors": self.algorithm.supervisor.session_errors,
            "payloads_refused": m.payloads_refused,
            "checkpoint_error": m.checkpoint_error,
            # Every byte of the node on TCP so far, payloads and all the rest (protocol/net/traffic.py).
            "wire_bytes_sent": TRAFFIC.sent,
            "wire_bytes_received": TRAFFIC.received,
            **self.algorithm.status(),
        }

    def _validation_blocks(self) -> dict[str, int | None]:
        """How many validation blocks the curve's points (``val_rows``) and the final full
        validation (``full_val_rows``) measure: training/validation.py's counts, or the
        whole split where it is smaller (None until a worker said how large it is)."""
        assert self.algorithm is not None
        split = self.algorithm.supervisor.val_blocks
        curve = validation.curve_rows(self.algorithm.ctx.run)
        if split is None:
            return {"val_rows": curve, "full_val_rows": None}
        return {"val_rows": min(curve, split), "full_val_rows": min(validation.FULL_MAX_ROWS, split)}

    def _partners(self) -> list[str]:
        # The role its signed member record says: a peer is live from a state sync before its
        # first heartbeat (which says its role too) has come.
        return sorted(p for p in self._peers.live() if self._is_trainer_member(p))

    def _is_trainer_member(self, peer_id: str) -> bool:
        """A peer we train with: its member record (signed by it) says it trains in this run."""
        record = self._state.members.get(peer_id)
        return record is not None and record.role == "trainer" and not self._peers.is_banned(peer_id)
