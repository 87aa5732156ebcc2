"""The worker as a real process, driven over its control pipe with shared-memory payloads."""

import json
import subprocess
import sys
from multiprocessing import resource_tracker, shared_memory
from typing import Any

import pytest
import torch
import trio

from training import ipc
from training.worker_config import WorkerConfig

SMALL_MODEL = {"context_len": 32, "embed_dim": 32, "num_layers": 2, "num_heads": 2}
TIMEOUT_S = 120.0


class WorkerProcess:
    def __init__(self, process: trio.Process) -> None:
        self.process = process
        self._buffer = b""

    @classmethod
    async def start(cls, **config: Any) -> "WorkerProcess":
        settings = {"model_overrides": SMALL_MODEL, "inner": {"steps_per_round": 5, "lr": 3e-3}, **config}
        process = await trio.lowlevel.open_process(
            [sys.executable, "-m", "training.worker", json.dumps(settings)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        return cls(process)

    async def receive(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        with trio.fail_after(TIMEOUT_S):
            while True:
                if len(self._buffer) >= ipc.LENGTH_NBYTES:
                    nbytes = int.from_bytes(self._buffer[: ipc.LENGTH_NBYTES], "big")
                    if len(self._buffer) >= ipc.LENGTH_NBYTES + nbytes:
                        body = self._buffer[ipc.LENGTH_NBYTES : ipc.LENGTH_NBYTES + nbytes]
                        self._buffer = self._buffer[ipc.LENGTH_NBYTES + nbytes :]
                        return ipc.decode(body, ipc.WORKER_TYPES)
                chunk = await self.process.stdout.receive_some(65536)
                if not chunk:
                    raise AssertionError("worker exited")
                self._buffer += chunk

    async def send(self, msg_type: str, **fields: Any) -> None:
        assert self.process.stdin is not None
        await self.process.stdin.send_all(ipc.encode(msg_type, fields))


def attach(name: str) -> shared_memory.SharedMemory:
    block = shared_memory.SharedMemory(name=name)
    # Python < 3.13 registers attached blocks with this process's tracker, which would
    # unlink the worker's blocks when we exit: the worker owns them.
    resource_tracker.unregister(block._name, "shared_memory")  # type: ignore[attr-defined]
    return block


async def test_rounds_report_falling_loss_and_fill_the_outbox() -> None:
    worker = await WorkerProcess.start(algorithm="noloco", rounds=3)
    ready = await worker.receive()
    assert ready["t"] == "ready" and ready["payload_nbytes"] > 0
    outbox, inbox = attach(ready["outbox"]), attach(ready["inbox"])
    losses = []
    for round_index in range(3):
        done = await worker.receive()
        assert done["t"] == "round_done" and done["round"] == round_index and done["compute_s"] > 0
        payload = torch.frombuffer(bytearray(outbox.buf[: ready["payload_nbytes"]]), dtype=torch.float32)
        assert torch.isfinite(payload).all() and payload.abs().sum() > 0
        losses.append(done["val_loss"])
        # Give it a partner payload: our own φ and Δ, as a partner in lockstep would send.
        inbox.buf[: ready["payload_nbytes"]] = outbox.buf[: ready["payload_nbytes"]]
        await worker.send("outer_go", round=round_index, peer=True)
        outer = await worker.receive()
        assert outer == {"t": "outer_done", "v": 1, "round": round_index, "used_peer": True}
    assert losses[-1] < losses[0]
    await worker.send("stop")
    with trio.fail_after(TIMEOUT_S):
        assert await worker.process.wait() == 0
    outbox.close()
    inbox.close()


async def test_a_poisoned_inbox_is_refused_and_the_worker_carries_on() -> None:
    worker = await WorkerProcess.start(algorithm="noloco", rounds=2)
    ready = await worker.receive()
    inbox = attach(ready["inbox"])
    await worker.receive()
    inbox.buf[: ready["payload_nbytes"]] = b"\xff" * ready["payload_nbytes"]  # every float a NaN
    await worker.send("outer_go", round=0, peer=True)
    assert (await worker.receive())["used_peer"] is False
    done = await worker.receive()
    assert done["t"] == "round_done" and done["round"] == 1 and done["val_loss"] < 10
    await worker.send("stop")
    with trio.fail_after(TIMEOUT_S):
        assert await worker.process.wait() == 0
    inbox.close()


async def test_the_worker_exits_quietly_when_its_daemon_goes_away() -> None:
    worker = await WorkerProcess.start(algorithm="local", rounds=5)
    await worker.receive()
    assert worker.process.stdin is not None
    await worker.process.stdin.aclose()
    with trio.fail_after(TIMEOUT_S):
        assert await worker.process.wait() == 0


def test_worker_config_is_validated() -> None:
    with pytest.raises(ValueError, match="algorithm"):
        WorkerConfig(algorithm="allreduce")
    with pytest.raises(ValueError, match="node_index"):
        WorkerConfig(node_index=3, num_nodes=2)


async def test_diloco_accumulates_checked_payloads_before_its_outer_step() -> None:
    worker = await WorkerProcess.start(algorithm="diloco", rounds=1)
    ready = await worker.receive()
    outbox, inbox = attach(ready["outbox"]), attach(ready["inbox"])
    nbytes = ready["payload_nbytes"]
    assert (await worker.receive())["t"] == "round_done"
    inbox.buf[:nbytes] = outbox.buf[:nbytes]  # a peer in lockstep: the same payload
    await worker.send("accumulate", round=0, key="peer-b")
    assert (await worker.receive()) == {"t": "accumulated", "v": 1, "round": 0, "ok": True}
    inbox.buf[:nbytes] = b"\xff" * nbytes  # NaN everywhere: refused, not averaged in
    await worker.send("accumulate", round=0, key="peer-c")
    assert (await worker.receive())["ok"] is False
    await worker.send("outer_go", round=0, key="peer-a")
    assert (await worker.receive()) == {"t": "outer_done", "v": 1, "round": 0, "used_peer": True}
    await worker.send("stop")
    with trio.fail_after(TIMEOUT_S):
        assert await worker.process.wait() == 0
    outbox.close()
    inbox.close()
