"""The "local" baseline, daemon side: no exchange at all (each node trains alone)."""

import logging
from typing import Any

from node.algorithms.rounds import PayloadRounds
from node.supervisor import WorkerConnection

logger = logging.getLogger("node.training")


class Local(PayloadRounds):
    async def exchange(
        self, worker: WorkerConnection, done: dict[str, Any], outbox: memoryview, inbox: memoryview
    ) -> None:
        logger.info("round %d: val loss %.3f, alone", done["round"], done["val_loss"])
        await worker.send("outer_go", round=int(done["round"]), peer=False)


ALGORITHM = Local
