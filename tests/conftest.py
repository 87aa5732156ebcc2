"""Shared fixtures: short data dirs (unix sockets), in-process daemons on loopback, waiting on events."""

import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
from hypothesis import settings

from node import config as config_module
from node.daemon import Daemon
from node.supervisor import STRICT_ENV
from node.waiting import until
from tests.forked_workers import forget_gate, use_forked_workers

# A bug in a training session fails the test (it would restart the session in a daemon).
os.environ[STRICT_ENV] = "1"
# In-process daemons fork their workers from a server that has imported torch (~2.5 s of
# CPU less a worker start; tests/forked_workers.py). CLI tests' daemons start theirs as usual.
use_forked_workers()

# Hypothesis' per-example deadline is a timing assertion, and these machines are noisy.
settings.register_profile("swarmtrain", deadline=None)
settings.load_profile("swarmtrain")


@pytest.fixture(autouse=True)
def _no_worker_gate_left() -> Iterator[None]:
    yield
    forget_gate()


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A temp dir short enough for unix socket paths (pytest's tmp_path can exceed 107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="st-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


# Fast liveness so expiry tests take seconds (the defaults are 5 s heartbeats, 30 s TTL).
FAST = {
    "state.heartbeat_interval_s": 1.0,
    "state.peer_ttl_s": 3.0,
    "state.anti_entropy_interval_s": 1.0,
    "discovery.interval_s": 1.0,
    "discovery.idle_interval_s": 4.0,
    "network.dial_timeout_s": 5.0,
    # A run started here forms the network only unless the test says what it trains.
    "run.settings.algorithm": "none",
}


def node_config(data_dir: Path, **overrides: Any) -> config_module.NodeConfig:
    values: dict[str, Any] = {
        "data_dir": str(data_dir),
        "network.listen": ["/ip4/127.0.0.1/tcp/0"],
        "log_level": "debug",
        **FAST,
    }
    values.update({k.replace("__", "."): v for k, v in overrides.items()})
    return config_module.load(None, values)


class Swarm:
    """Daemons started in one nursery, each stoppable on its own (cleanly or by 'kill')."""

    def __init__(self, nursery: trio.Nursery, base: Path) -> None:
        self._nursery = nursery
        self._base = base
        self._scopes: dict[int, trio.CancelScope] = {}
        self._done: dict[int, trio.Event] = {}
        self.daemons: list[Daemon] = []

    async def start(self, name: str, **overrides: Any) -> Daemon:
        daemon = Daemon(node_config(self._base / name, **overrides))
        scope = trio.CancelScope()
        done = trio.Event()

        async def run(task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
            try:
                with scope:
                    await daemon.run(task_status=task_status)
            finally:
                done.set()

        await self._nursery.start(run)
        self._scopes[id(daemon)] = scope
        self._done[id(daemon)] = done
        self.daemons.append(daemon)
        return daemon

    def kill(self, daemon: Daemon) -> None:
        """Stop without a goodbye, as a crash or a pulled cable would."""
        self._scopes[id(daemon)].cancel()
        self.daemons.remove(daemon)

    async def stop(self, daemon: Daemon) -> None:
        """A clean stop, as SIGTERM or ``swarmtrain stop`` would do; returns once it finished."""
        daemon.request_stop()
        self.daemons.remove(daemon)
        await self._done[id(daemon)].wait()

    def changes(self) -> list[trio.Event]:
        """Events set at the next change of any daemon's peers or state."""
        events = [daemon.peers.changed for daemon in self.daemons]
        events += [d.run_service.state.changed for d in self.daemons if d.run_service is not None]
        return events


@asynccontextmanager
async def open_swarm(base: Path) -> AsyncIterator[Swarm]:
    async with trio.open_nursery() as nursery:
        swarm = Swarm(nursery, base)
        yield swarm
        nursery.cancel_scope.cancel()


async def wait_until(
    predicate: Callable[[], bool], events: Callable[[], list[trio.Event]], *, timeout_s: float
) -> None:
    """Re-check ``predicate`` at every change until it holds; TooSlowError after ``timeout_s``."""
    with trio.fail_after(timeout_s):
        await until(predicate, events)
