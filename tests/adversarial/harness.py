"""A run of real daemons for the adversarial tests: a bootstrap node, then trainers that
find each other through it, and waits on training progress (which raises no event)."""

from collections.abc import Callable
from typing import Any

import trio

from node.daemon import Daemon
from tests.conftest import Swarm, wait_until

# Training progress raises no event a test can wait on: besides every state and peer
# change, the condition is looked at again this often.
LOOK_AGAIN_S = 2.0


async def start_trainers(swarm: Swarm, num_nodes: int, training: dict[str, Any], *, run_name: str) -> list[Daemon]:
    boot = await swarm.start("boot", role="bootstrap")
    assert boot.host is not None
    addr = boot.host.addrs()[0]
    creator = await swarm.start("n0", network__bootstrap=[addr], run__new_run=run_name, **training)
    assert creator.run_service is not None
    run_id = creator.run_service.state.run_id
    nodes = [creator]
    for i in range(1, num_nodes):
        nodes.append(await swarm.start(f"n{i}", network__bootstrap=[addr], run__run_id=run_id, **training))
    return nodes


def micro_noloco(rounds: int, *, steps_per_round: int = 5) -> dict[str, Any]:
    """Node config overrides for a short NoLoCo run on the micro model (a 20 s pairing bound)."""
    return {
        "run__settings__algorithm": "noloco",
        "run__settings__model": "micro",
        "run__settings__rounds": rounds,
        "run__settings__inner__steps_per_round": steps_per_round,
        "training__pair_timeout_s": 20.0,
    }


def finished(daemon: Daemon) -> bool:
    return daemon.training is not None and daemon.training.metrics.finished


def events(nodes: list[Daemon]) -> list[trio.Event]:
    out = [n.peers.changed for n in nodes]
    out += [n.run_service.state.changed for n in nodes if n.run_service]
    return out


async def until(nodes: list[Daemon], predicate: Callable[[], bool], *, timeout_s: float) -> None:
    """Until ``predicate`` holds: re-checked at every change of ``nodes``, and every LOOK_AGAIN_S."""
    with trio.fail_after(timeout_s):
        while not predicate():
            with trio.move_on_after(LOOK_AGAIN_S):
                await wait_until(predicate, lambda: events(nodes), timeout_s=timeout_s)
