"""What every algorithm's daemon side is given (``Context``) and must offer (``Algorithm``)."""

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar

if TYPE_CHECKING:  # the registry is imported by `simulate`, which needs none of these
    import trio

    from node.config import TrainingConfig
    from node.supervisor import Supervisor
    from protocol.net.hostlike import TensorHostLike
    from protocol.ratelimit import RateLimit
    from protocol.runstate.run import RunService
    from protocol.runstate.state import RunState
    from training.settings import RunSettings
    from training.worker_config import WorkerConfig


T = TypeVar("T")

STATUS_CURVE_POINTS = 512
"""At most this many points of each per-round curve go into a status (``thinned``): a run
until its nodes stop has no last round, and the control API's frames are bounded
(node/api.py ``MAX_FRAME_NBYTES``: a whole curve passed it after ~127k rounds)."""


def thinned(points: list[T], max_points: int = STATUS_CURVE_POINTS) -> list[T]:
    """At most ``max_points`` of ``points`` spread evenly over them, the first and the last
    kept (all of them when they are no more)."""
    if len(points) <= max_points:
        return points
    last = len(points) - 1
    return [points[i * last // (max_points - 1)] for i in range(max_points)]


@dataclass(slots=True)
class TrainingMetrics:
    loss_curve: list[list[float]] = field(default_factory=list)
    """[step, validation loss] at the end of each round's inner steps, every point on the
    same validation blocks (training/validation.py ``curve_rows``)."""
    full_val_loss: float | None = None
    """The final model's loss on the whole validation split (``FULL_MAX_ROWS`` at most),
    measured once the run's last round is done; None before."""
    rounds: int = 0
    rounds_with_partner: int = 0
    tokens: int = 0
    """Tokens the inner steps trained on (every worker of this node, restarts included)."""
    compute_s: float = 0.0
    """Inner steps and payload export, as the worker timed them."""
    sync_wait_s: float = 0.0
    """How long the worker waited for the daemon's word to apply its outer steps (its own
    measure, ``outer_done``'s ``wait_s``): the whole exchange with a barrier, what the
    overlapped inner steps did not hide without one (``outer.overlap``)."""
    eval_s: float = 0.0
    """Validation at the rounds' ends (the curve), as the worker timed it (``round_done``'s
    ``eval_s``)."""
    full_eval_s: float = 0.0
    """The final full validation, after the last outer step (the last ``outer_done``'s
    ``eval_s``): in neither ``eval_s`` nor ``train_wall_s``."""
    outer_s: float = 0.0
    """Outer steps, a partner payload's decoding and check and the checkpoint's staging
    included, as the worker timed them (``outer_done``'s ``outer_s``)."""
    outer_s_rounds: list[list[float]] = field(default_factory=list)
    """[round, its ``outer_s`` (ms resolution)] for each outer step, in the order they came
    (rounds a restarted worker does again are dropped first, as the loss curve's are)."""
    save_wait_s: float = 0.0
    """Of ``outer_s``: the wait for the run's last checkpoint write, which the worker makes
    before its last ``outer_done`` (``outer_done``'s ``save_wait_s``)."""
    overlapped_steps: int = 0
    """Inner steps the worker took before a round's outer step landed (``outer.overlap``)."""
    train_wall_s: float = 0.0
    """From the first worker's "ready" to the last outer step (the final full validation
    after it aside): compute_s / train_wall_s is
    the worker's utilization (the rest: waiting, evaluation, outer steps, restarts)."""
    finished: bool = False
    checkpoint_error: str | None = None
    """Why the last checkpoint could not be written (a full disk...), None once one was."""
    payloads_refused: int = 0
    """Partner payloads the worker refused (non-finite, out of bounds): each cost its sender."""
    first_ready: float | None = None
    """When the first worker said "ready" (trio time)."""
    expert_load: list[float] | None = None
    """A mixture of experts: each expert's share of the routed tokens at the last evaluation."""
    memory: dict[str, int] = field(default_factory=dict)
    """The worker's last ``Trainer.memory()``: trainable and total parameters, gradient and
    optimizer-state bytes."""


@dataclass(kw_only=True, slots=True)
class Context:
    """The node's parts an algorithm works with; built once the run's settings are adopted."""

    host: "TensorHostLike"
    state: "RunState"
    run: "RunSettings"
    """The run's settings (adopted from its manifest)."""
    config: "TrainingConfig"
    """This node's own training settings (shard, pairing bound...)."""
    worker_config: "WorkerConfig"
    metrics: TrainingMetrics
    partners: Callable[[], list[str]]
    """Live trainers of this run we may train with (sorted; banned peers left out)."""
    is_member: Callable[[str], bool]
    """A peer whose own signed member record says it trains in this run (and not banned)."""
    peers_changed: Callable[[], "trio.Event"]
    """Set at the next change of liveness (``partners`` may differ then): take, check, wait."""
    listen_ips: list[str]
    upload_limit: "RateLimit"
    log_path: str
    checkpoint_dir: Path | None = None
    identity_seed: bytes = b""
    run_service: "RunService | None" = None


class Algorithm(Protocol):
    """An algorithm's daemon side: what a round exchanges, with whom, and when it is done."""

    REPORT_KEYS: ClassVar[tuple[str, ...]]
    """Its own ``status`` keys a simulation report shows (beyond the common ones)."""

    ctx: Context
    supervisor: "Supervisor"
    """The worker it drives (restarted by the supervisor when it crashes)."""

    def __init__(self, ctx: Context) -> None: ...

    async def train(self) -> None:
        """Train until this node's part of the run is over (ZO: follows the log forever)."""

    def status(self) -> dict[str, Any]:
        """Its part of the node's training status (``bytes_sent``/``bytes_received`` at least)."""

    @staticmethod
    def summary(statuses: list[dict[str, Any]]) -> dict[str, Any]:
        """Given every node's training status: what the simulation report shows at its top
        level for this algorithm (SPES: the experts' owners and hand-overs); {} for most."""

    @staticmethod
    def settled(statuses: list[dict[str, Any]]) -> bool:
        """Given every node's training status, once all finished: has the run settled (a
        simulation ends then)? The φ/Δ algorithms always have; ZO waits for one log."""
