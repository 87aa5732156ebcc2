"""``--algorithm zo``, daemon side: ``ZoRounds`` (node/algorithms/zo/rounds.py) wired to the node.

The worker side is training/algorithms/zo.py; docs/zo.md has the algorithm and its rules.
"""

from typing import Any

import trio

from node.algorithms.base import Context
from node.algorithms.zo.journal import Journal
from node.algorithms.zo.rounds import ZoRounds
from node.supervisor import Supervisor, WorkerConnection


class Zo:
    """The daemon side of ``--algorithm zo``: ``ZoRounds`` wired to the node."""

    REPORT_KEYS = (
        *("param_hash", "bytes_per_update", "log_entries", "rebuilds", "rewinds", "start_round", "checkpoint_round"),
        *("entries_by_gossip", "entries_by_pull", "pulls_ok", "pulls_failed"),
        *("g_clipped", "g_silenced", "authors_excluded", "recoveries"),
    )

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        run_service = ctx.run_service
        self.rounds = ZoRounds(
            ctx.host,
            run_id=ctx.state.run_id,
            identity_seed=ctx.identity_seed,
            rounds=ctx.run.round_limit,
            updates_per_round=ctx.run.inner.steps_per_round,
            partners=ctx.partners,
            pull_from=lambda: sorted(
                set(ctx.partners())
                | {p for p in ctx.host.connected_peers() if p != ctx.host.peer_id and ctx.is_member(p)}
            ),
            # Our own batches always count (a stranger deleting our record must not stop us).
            is_member=lambda peer_id: peer_id == ctx.host.peer_id or peer_id in ctx.state.members,
            wait_s=ctx.config.pair_timeout_s,
            checkpoint_dir=ctx.checkpoint_dir,
            gossip=run_service.push_zo if run_service else None,
            journal=Journal(ctx.checkpoint_dir / f"{ctx.state.run_id}.zo-journal", ctx.state.run_id)
            if ctx.checkpoint_dir
            else None,
        )
        self.rounds.register()
        if run_service is not None:
            run_service.zo_hint = self.rounds.sync.receive_hint
            run_service.zo_evidence = self.rounds.sync.receive_evidence
            self.rounds.sync.publish_evidence = run_service.push_zo_evidence
        self.supervisor = Supervisor(ctx.worker_config, self._session, log_path=ctx.log_path)

    async def train(self) -> None:
        """Runs until the node stops: after the last round the log is still followed."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.rounds.pull_forever)
            nursery.start_soon(self.rounds.agree_forever)
            await self.supervisor.run()
            nursery.cancel_scope.cancel()

    def status(self) -> dict[str, Any]:
        return {"bytes_sent": 0, "bytes_received": 0, **self.rounds.status()}

    @staticmethod
    def summary(statuses: list[dict[str, Any]]) -> dict[str, Any]:
        return {}

    @staticmethod
    def settled(statuses: list[dict[str, Any]]) -> bool:
        """Every node holds the same log and has applied all of it (late updates keep
        arriving after the last round; the final weights follow them)."""
        views = {(s.get("log_entries"), s.get("log_entries_applied")) for s in statuses}
        return len(views) == 1 and len({*next(iter(views))}) == 1

    async def _session(self, worker: WorkerConnection) -> None:
        metrics = self.ctx.metrics
        if metrics.first_ready is None:
            metrics.first_ready = trio.current_time()

        def on_step(step: dict[str, Any]) -> None:
            point = [float(step["round"]), float(step["val_loss"])]
            if step.get("final"):  # the final weights changed: late updates arrived
                metrics.loss_curve[-1:] = [point]
                metrics.full_val_loss = self.rounds.full_val_loss
                return
            metrics.rounds += 1
            metrics.loss_curve.append(point)
            metrics.compute_s += float(step.get("compute_s", 0.0))
            metrics.train_wall_s = trio.current_time() - (metrics.first_ready or 0.0)

        def on_finished() -> None:
            assert self.rounds.final_val_loss is not None
            metrics.loss_curve.append([float(self.ctx.run.round_limit), self.rounds.final_val_loss])
            metrics.full_val_loss = self.rounds.full_val_loss
            metrics.finished = True

        metrics.rounds = 0
        metrics.loss_curve.clear()
        metrics.full_val_loss = None
        await self.rounds.session(worker, on_step, on_finished)


ALGORITHM = Zo
