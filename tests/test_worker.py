"""The worker as a real process, driven over its control pipe with shared-memory payloads."""

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import trio

from node import supervisor
from node.supervisor import WorkerConnection, attach_block
from tests.forked_workers import start_forked_worker
from training import checkpoint
from training.settings import InnerConfig, OuterConfig, RunSettings
from training.worker_config import WorkerConfig

SMALL_MODEL = {"context_len": 32, "embed_dim": 32, "num_layers": 2, "num_heads": 2}
TIMEOUT_S = 120.0


async def start_worker(
    *,
    algorithm: str,
    rounds: int,
    model: str = "tiny",
    overlap: float = 0.5,
    interpreter_log: Path | None = None,
    **config: Any,
) -> WorkerConnection:
    """A real worker process, spoken to through the daemon's own connection class (5 steps a
    round: with the default overlap, the outer step lands after 2 of the next round's)."""
    run = RunSettings(
        algorithm=algorithm,
        rounds=rounds,
        model=model,
        inner=InnerConfig(steps_per_round=5, lr=3e-3),
        outer=OuterConfig(overlap=overlap),
    )
    worker_config = WorkerConfig(run=run, **{"model_overrides": SMALL_MODEL, **config})
    # As the suite's daemons start theirs: forked from a server that has imported torch
    # (tests/forked_workers.py). With ``interpreter_log``: as a user's daemon starts it, a
    # new interpreter (`python -m training.worker`) logging there, whose exit (which a fork
    # skips: it ends in os._exit) the test can check.
    if interpreter_log is not None:
        return WorkerConnection(await supervisor.start_worker_process(worker_config.to_json(), interpreter_log))
    return WorkerConnection(await start_forked_worker(worker_config.to_json(), None))


async def receive(worker: WorkerConnection) -> dict[str, Any]:
    """The worker's next message, answering its ``inner_done`` as the daemon does."""
    with trio.fail_after(TIMEOUT_S):
        while True:
            message = await worker.receive()
            if message["t"] != "inner_done":
                return message
            await worker.send("outbox_free", round=message["round"])


async def test_the_outbox_keeps_last_rounds_payload_until_the_daemon_frees_it() -> None:
    """Peers behind us pull last round's payload from the outbox while our next round runs:
    the worker must not overwrite it before ``outbox_free``."""
    worker = await start_worker(algorithm="noloco", rounds=2)
    ready = await receive(worker)
    outbox = attach_block(ready["outbox"])
    nbytes = ready["payload_nbytes"]
    assert (await receive(worker))["round"] == 0
    first = bytes(outbox.buf[:nbytes])
    await worker.send("outer_go", round=0, peer=False)
    assert (await receive(worker))["t"] == "outer_done"
    with trio.fail_after(TIMEOUT_S):
        asking = await worker.receive()
    assert asking == {"t": "inner_done", "v": 1, "round": 1}
    assert bytes(outbox.buf[:nbytes]) == first  # round 1's inner steps are done; it waits for us
    await worker.send("outbox_free", round=1)
    assert (await receive(worker))["t"] == "round_done"
    assert bytes(outbox.buf[:nbytes]) != first
    await worker.send("stop")
    with trio.fail_after(TIMEOUT_S):
        assert await worker.process.wait() == 0
    outbox.close()


async def test_rounds_report_falling_loss_and_fill_the_outbox() -> None:
    worker = await start_worker(algorithm="noloco", rounds=3)
    ready = await receive(worker)
    assert ready["t"] == "ready" and ready["payload_nbytes"] > 0
    outbox, inbox = attach_block(ready["outbox"]), attach_block(ready["inbox"])
    losses = []
    for round_index in range(3):
        done = await receive(worker)
        assert done["t"] == "round_done" and done["round"] == round_index and done["compute_s"] > 0
        assert isinstance(done["eval_s"], float) and done["eval_s"] > 0
        payload = torch.frombuffer(bytearray(outbox.buf[: ready["payload_nbytes"]]), dtype=torch.float32)
        assert torch.isfinite(payload).all() and payload.abs().sum() > 0
        losses.append(done["val_loss"])
        # Give it a partner payload: our own φ and Δ, as a partner in lockstep would send.
        inbox.buf[: ready["payload_nbytes"]] = outbox.buf[: ready["payload_nbytes"]]
        await worker.send("outer_go", round=round_index, peer=True)
        outer = await receive(worker)
        # How long it waited for our word, and took for the outer step: its own clock.
        wait_s, outer_s = outer.pop("wait_s"), outer.pop("outer_s")
        assert isinstance(wait_s, float) and wait_s >= 0 and isinstance(outer_s, float) and outer_s > 0
        assert outer.pop("save_wait_s") == 0.0  # no checkpoint here
        # Steps of the next round taken before it: as many as our word took (at most 2 of 5).
        assert outer.pop("overlapped") in (range(3) if round_index < 2 else [0])
        if round_index == 2:  # the run's last: its result on the whole validation split, once
            full, eval_s = outer.pop("full_val_loss"), outer.pop("eval_s")
            assert isinstance(full, float) and math.isfinite(full) and isinstance(eval_s, float) and eval_s > 0
        expected = {"t": "outer_done", "v": 1, "round": round_index, "used_peer": True}
        assert outer == {**expected, "rejected": None, "drifted": False, "skipped": 0}
    assert losses[-1] < losses[0]
    await worker.send("stop")
    with trio.fail_after(TIMEOUT_S):
        assert await worker.process.wait() == 0
    outbox.close()
    inbox.close()


async def test_a_poisoned_inbox_is_refused_and_the_worker_carries_on() -> None:
    worker = await start_worker(algorithm="noloco", rounds=2)
    ready = await receive(worker)
    inbox = attach_block(ready["inbox"])
    await receive(worker)
    inbox.buf[: ready["payload_nbytes"]] = b"\xff" * ready["payload_nbytes"]  # every float a NaN
    await worker.send("outer_go", round=0, peer=True)
    assert (await receive(worker))["used_peer"] is False
    done = await receive(worker)
    assert done["t"] == "round_done" and done["round"] == 1 and done["val_loss"] < 10
    await worker.send("stop")
    with trio.fail_after(TIMEOUT_S):
        assert await worker.process.wait() == 0
    inbox.close()


@pytest.mark.parametrize("overlap", [0.0, 0.5])
async def test_a_round_takes_the_steps_the_daemon_says_when_catching_up(overlap: float) -> None:
    """``outer_go``'s ``steps``: the next round's inner steps (fewer while the node catches
    up with peers ahead of it); out of [1, H] it is H. The overlapped steps count in it."""
    worker = await start_worker(algorithm="noloco", rounds=3, overlap=overlap)
    await receive(worker)
    first = await receive(worker)
    assert (first["step"], first["tokens"] % 5) == (5, 0)
    await worker.send("outer_go", round=0, peer=False, steps=2)
    assert (await receive(worker))["t"] == "outer_done"
    second = await receive(worker)
    # 2 steps, or the overlapped ones if the word came later than 2 steps (at most 2 of 5).
    assert second["round"] == 1 and second["step"] == 7
    assert second["tokens"] == first["tokens"] * 2 // 5
    await worker.send("outer_go", round=1, peer=False, steps=10**6)  # not a round's: H
    assert (await receive(worker))["t"] == "outer_done"
    third = await receive(worker)
    assert third["step"] == 12 and third["tokens"] == first["tokens"]
    await worker.send("stop")
    with trio.fail_after(TIMEOUT_S):
        assert await worker.process.wait() == 0


@pytest.mark.parametrize("overlap", [0.0, 0.5])
async def test_rounds_the_daemon_says_to_skip_are_left_out_but_never_the_last(tmp_path: Path, overlap: float) -> None:
    """``outer_go``'s ``skip`` (peers further ahead than a pull reaches): the next round (or
    the one under way with overlapped steps) is that many later, in the checkpoint too;
    never past the run's last round; anything but a positive int skips nothing."""
    path = tmp_path / "run.ckpt"
    worker = await start_worker(algorithm="noloco", rounds=8, checkpoint_path=str(path), overlap=overlap)

    async def outer_go(round_index: int, skip: object, *, saved: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
        # ``saved``: wait for the checkpoint too (a round's save is skipped while the last
        # write is still going: only the first one is sure to be written).
        await worker.send("outer_go", round=round_index, peer=False, skip=skip)
        seen: dict[str, dict[str, Any]] = {}
        while not {"outer_done", "round_done", *(["saved"] if saved else [])} <= seen.keys():
            message = await receive(worker)
            seen.setdefault(message["t"], message)
        return seen["outer_done"], seen["round_done"]

    await receive(worker)  # ready
    assert (await receive(worker))["round"] == 0
    done, after = await outer_go(0, 3, saved=True)
    assert done["skipped"] == 3 and after["round"] == 4
    _, meta = checkpoint.load(path)
    assert meta["round"] == 4  # a restart (or a joiner given this state) goes on at round 4
    done, after = await outer_go(4, True)
    assert done["skipped"] == 0 and after["round"] == 5
    done, after = await outer_go(5, 100)
    assert done["skipped"] == 1 and after["round"] == 7  # the last round is trained
    await worker.send("outer_go", round=7, peer=False, skip=5)
    while (message := await receive(worker))["t"] != "outer_done":
        pass
    assert message["skipped"] == 0
    await worker.send("stop")
    with trio.fail_after(TIMEOUT_S):
        assert await worker.process.wait() == 0


@pytest.mark.parametrize("started", ["as a new interpreter", "forked"])
async def test_the_worker_exits_quietly_when_its_daemon_goes_away(tmp_path: Path, started: str) -> None:
    """Also as a user's daemon starts it: a thread blocked reading a buffered stdin at the
    interpreter's exit aborts it (exit code 134, "Fatal Python error"), which a forked
    worker's os._exit would not show."""
    log = tmp_path / "worker.log" if started == "as a new interpreter" else None
    worker = await start_worker(algorithm="local", rounds=5, interpreter_log=log)
    await receive(worker)
    assert worker.process.stdin is not None
    await worker.process.stdin.aclose()
    with trio.fail_after(TIMEOUT_S):
        assert await worker.process.wait() == 0
    if log is not None:
        assert "Traceback" not in log.read_text() and "Fatal" not in log.read_text()


def test_worker_config_is_validated() -> None:
    with pytest.raises(ValueError, match="algorithm"):
        WorkerConfig(run=RunSettings(algorithm="allreduce"))
    with pytest.raises(ValueError, match="trains nothing"):
        WorkerConfig(run=RunSettings(algorithm="none"))
    with pytest.raises(ValueError, match="node_index"):
        WorkerConfig(node_index=3, num_nodes=2)


async def test_diloco_accumulates_checked_payloads_before_its_outer_step() -> None:
    worker = await start_worker(algorithm="diloco", rounds=1)
    ready = await receive(worker)
    outbox, inbox = attach_block(ready["outbox"]), attach_block(ready["inbox"])
    nbytes = ready["payload_nbytes"]
    assert (await receive(worker))["t"] == "round_done"
    inbox.buf[:nbytes] = outbox.buf[:nbytes]  # a peer in lockstep: the same payload
    await worker.send("accumulate", round=0, key="peer-b")
    assert (await receive(worker)) == {
        "t": "accumulated",
        "v": 1,
        "round": 0,
        "ok": True,
        "reason": None,
        "drifted": False,
    }
    inbox.buf[:nbytes] = b"\xff" * nbytes  # NaN everywhere: refused, not averaged in
    await worker.send("accumulate", round=0, key="peer-c")
    refused = await receive(worker)
    assert refused["ok"] is False and "NaN" in refused["reason"]
    await worker.send("outer_go", round=0, key="peer-a")
    expected = {
        "t": "outer_done",
        "v": 1,
        "round": 0,
        "used_peer": True,
        "rejected": None,
        "drifted": False,
        "skipped": 0,
    }
    done = await receive(worker)
    assert isinstance(done.pop("wait_s"), float)
    assert done.pop("outer_s") > 0  # the two accumulated payloads' checks and the outer step
    assert done.pop("save_wait_s") == 0.0  # no checkpoint here
    assert done.pop("overlapped") == 0  # the run's last round: nothing follows it
    assert math.isfinite(done.pop("full_val_loss")) and done.pop("eval_s") > 0  # and its full validation
    assert done == expected
    await worker.send("stop")
    with trio.fail_after(TIMEOUT_S):
        assert await worker.process.wait() == 0
    outbox.close()
    inbox.close()


@pytest.mark.parametrize("overlap", [0.0, 0.5])
async def test_a_killed_worker_resumes_from_its_checkpoint(tmp_path: Path, overlap: float) -> None:
    """Killed mid-round 1, it does round 1 again the same, bit for bit: with an overlap, the
    checkpoint of round 0 is written when its outer step lands, 2 steps into round 1, and
    holds the round's end (θ, AdamW's moments) besides the outer step's result."""
    path = tmp_path / "run.ckpt"
    worker = await start_worker(algorithm="local", rounds=3, checkpoint_path=str(path), overlap=overlap)
    assert (await receive(worker))["round"] == 0
    await receive(worker)
    await worker.send("outer_go", round=0, peer=False)
    seen: dict[str, dict[str, Any]] = {}
    while not {"saved", "round_done"} <= seen.keys():  # round 0 on disk, round 1 trained
        message = await receive(worker)
        seen[message["t"]] = message
    assert seen["saved"]["round"] == 0 and seen["saved"]["save_error"] is None
    _, meta = checkpoint.load(path)
    # Written when round 0's step landed: its end's step count, and the steps taken before
    # it (as many as the daemon's word took to come, at most half the round's 5).
    assert meta["step"] == 5 and meta.get("overlapped", 0) in (range(3) if overlap else [0])
    lost = seen["round_done"]
    assert lost["round"] == 1
    worker.process.kill()  # mid-round 1: that round is done again
    await worker.process.wait()

    again = await start_worker(algorithm="local", rounds=3, checkpoint_path=str(path), overlap=overlap)
    assert (await receive(again))["round"] == 1
    redone = await receive(again)
    # The same state and the same batches: round 1 comes out the same, bit for bit.
    assert (redone["round"], redone["step"], redone["val_loss"]) == (1, lost["step"], lost["val_loss"])
    await again.send("stop")
    with trio.fail_after(TIMEOUT_S):
        assert await again.process.wait() == 0


async def test_the_last_rounds_checkpoint_is_on_disk_before_its_outer_done_which_says_the_wait(
    tmp_path: Path,
) -> None:
    """The run's last state is written before the last ``outer_done`` (the daemon offers it
    as the run's result), and that message says how long the worker waited for the write
    (``save_wait_s``, part of ``outer_s``); a round before it waits for no write."""
    path = tmp_path / "run.ckpt"
    worker = await start_worker(algorithm="local", rounds=2, checkpoint_path=str(path), overlap=0.0)
    assert (await receive(worker))["t"] == "ready"

    async def next_but_saved() -> dict[str, Any]:  # "saved" reports come when each write ends
        while (message := await receive(worker))["t"] == "saved":
            pass
        return message

    for round_index in range(2):
        assert (await next_but_saved())["t"] == "round_done"
        await worker.send("outer_go", round=round_index, peer=False)
        message = await next_but_saved()
        assert message["t"] == "outer_done" and message["round"] == round_index
        waited = message["save_wait_s"]
        if round_index == 0:
            assert waited == 0.0
        else:
            assert 0.0 < waited <= message["outer_s"]
            assert checkpoint.load(path)[1]["round"] == 2  # already on disk
    await worker.send("stop")
    with trio.fail_after(TIMEOUT_S):
        assert await worker.process.wait() == 0


def kept_aside(folder: Path) -> list[bytes]:
    return [p.read_bytes() for p in folder.glob("run.ckpt.unusable-*")]


async def test_a_damaged_checkpoint_is_kept_aside_and_training_starts_over(tmp_path: Path) -> None:
    path = tmp_path / "run.ckpt"
    path.write_bytes(b"SWTCKPT1 but then garbage")
    worker = await start_worker(algorithm="local", rounds=1, checkpoint_path=str(path))
    assert (await receive(worker))["round"] == 0
    assert kept_aside(tmp_path) == [b"SWTCKPT1 but then garbage"]
    await worker.send("stop")
    with trio.fail_after(TIMEOUT_S):
        assert await worker.process.wait() == 0


async def test_a_worker_told_cuda_without_one_trains_on_the_cpu_instead_of_crash_looping() -> None:
    worker = await start_worker(algorithm="local", rounds=1, device="cuda")
    assert (await receive(worker))["t"] == "ready"
    assert (await receive(worker))["t"] == "round_done"
    await worker.send("stop")
    with trio.fail_after(TIMEOUT_S):
        assert await worker.process.wait() == 0


def test_a_device_setting_is_auto_cpu_cuda_or_cuda_n() -> None:
    from training.worker_config import check_device

    for good in ("auto", "cpu", "cuda", "cuda:0", "cuda:63"):
        assert check_device(good) == good
    for bad in ("gpu", "cuda:", "cuda:-1", "cuda:00", "cuda:64", "cuda:\u00b2", "CUDA", "cuda:0 "):
        with pytest.raises(ValueError, match="auto, cpu, cuda or cuda:N"):
            check_device(bad)


def test_the_device_setting_resolves_to_where_this_torch_can_train(caplog: pytest.LogCaptureFixture) -> None:
    from training.worker import resolve_device

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert resolve_device("cpu") == "cpu"
    assert resolve_device("auto") == ("cuda" if gpus else "cpu")  # by torch, not by a probe of driver files
    assert resolve_device(f"cuda:{gpus}") == "cpu"  # past the last GPU (or none): the CPU, said in the log
    assert f"device cuda:{gpus} asked for" in caplog.text
    if gpus:
        assert resolve_device(f"cuda:{gpus - 1}") == f"cuda:{gpus - 1}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")
@pytest.mark.parametrize("algorithm", ["local", "noloco", "diloco", "zo"])
async def test_every_algorithms_worker_trains_a_round_on_cuda(tmp_path: Path, algorithm: str) -> None:
    """The worker on the GPU: ready names the device, a round's steps run (ZO once handed a
    host batch to the GPU model and crashed). Started as a user's daemon starts it (a new
    interpreter): CUDA is initialized by the worker itself either way."""
    worker = await start_worker(
        algorithm=algorithm,
        rounds=1,
        model="micro",
        model_overrides={},
        device="cuda:0",
        interpreter_log=tmp_path / "worker.log",
    )
    ready = await receive(worker)
    assert ready["t"] == "ready" and ready["device"] == "cuda:0"
    if algorithm == "zo":
        await worker.send("zo_finish")
        assert (await receive(worker))["t"] == "zo_done"
        await worker.send("zo_go", round=0, seeds=[1, 2, 3])
        step = await receive(worker)
        assert len(step["g_codes"]) == 3
    else:
        done = await receive(worker)
        assert done["t"] == "round_done" and done["val_loss"] == done["val_loss"]  # not NaN
    await worker.send("stop")
    with trio.fail_after(TIMEOUT_S):
        assert await worker.process.wait() == 0


async def test_zo_worker_rewinds_to_a_kept_copy_bit_identical_to_a_replay_from_genesis() -> None:
    worker = await start_worker(algorithm="zo", rounds=1, model="micro", model_overrides={})
    ready = await receive(worker)
    assert ready["zo_snapshots"] == 4  # micro's weights are far below the copies' byte budget
    groups = [[[1, 10], [2, 200]], [[3, 40]], [[4, 90], [5, 7]]]

    async def weights() -> str:
        await worker.send("zo_finish")
        return str((await receive(worker))["param_hash"])

    for key, group in enumerate(groups, start=1):
        await worker.send("zo_apply", rebuild=False, updates=group, more=False, snapshot=key)
    # Round 3 changes (a late entry): back to the copy after round 2, then the new round 3.
    late = [[4, 90], [5, 7], [6, 255]]
    await worker.send("zo_apply", rebuild=False, rewind=2, updates=late, more=False, snapshot=3)
    rewound = await weights()
    await worker.send("zo_apply", rebuild=True, updates=groups[0])
    for group in (groups[1], late):
        await worker.send("zo_apply", rebuild=False, updates=group)
    assert await weights() == rewound
    # The rebuild dropped every copy; asking for a copy never kept is a daemon's bug: the
    # worker refuses it as a bad command (it ends cleanly, as when the daemon misbehaves),
    # rather than guess weights or crash.
    await worker.send("zo_apply", rebuild=False, rewind=3, updates=[])
    with trio.fail_after(TIMEOUT_S):
        assert await worker.process.wait() == 0


async def test_zo_worker_applies_updates_saves_and_refuses_a_checkpoint_that_hashes_wrong(tmp_path: Path) -> None:
    worker = await start_worker(algorithm="zo", rounds=1, model="micro", model_overrides={})
    ready = await receive(worker)
    assert ready["payload_nbytes"] == 0 and ready["val_blocks"] == 358  # micro's validation split
    await worker.send("zo_finish")
    done = await receive(worker)
    genesis = done["param_hash"]
    # The curve's 2 blocks (0.03 · 2 · H · B = 2.4 at H = 5) and the full validation's 256 of
    # micro's 358: two measures of the same weights, on other blocks.
    assert math.isfinite(done["val_loss"]) and math.isfinite(done["full_val_loss"])
    assert done["val_loss"] != done["full_val_loss"]
    await worker.send("zo_go", round=0, seeds=[1, 2, 3])
    step = await receive(worker)
    assert step["t"] == "zo_step" and len(step["g_codes"]) == 3
    assert step["val_loss"] == done["val_loss"]  # the same weights, the same blocks: the same loss
    await worker.send("zo_apply", rebuild=False, updates=[[1, step["g_codes"][0]], [2, 200]])
    await worker.send("zo_save", path=str(tmp_path / "a.ckpt"), round=1)
    saved = (await receive(worker))["param_hash"]
    assert saved != genesis
    await worker.send("zo_apply", rebuild=True, updates=[])  # back to the genesis weights
    await worker.send("zo_load", path=str(tmp_path / "a.ckpt"), param_hash="0" * 64)
    refused = await receive(worker)
    assert refused["ok"] is False and "hash" in refused["reason"]
    await worker.send("zo_finish")
    assert (await receive(worker))["param_hash"] == genesis  # nothing was taken from it
    await worker.send("zo_load", path=str(tmp_path / "a.ckpt"), param_hash=saved)
    assert (await receive(worker))["ok"] is True
    await worker.send("zo_finish")
    assert (await receive(worker))["param_hash"] == saved
    await worker.send("stop")
    with trio.fail_after(TIMEOUT_S):
        assert await worker.process.wait() == 0


def test_a_control_message_of_a_strange_type_is_an_ipc_error() -> None:
    """A list as the message type once raised TypeError (unhashable) past the IpcError contract."""
    from training import ipc

    for body in (bytes.fromhex("82a17601a17490"), bytes.fromhex("82a17601a17480"), b"\x91\x01"):
        with pytest.raises(ipc.IpcError):
            ipc.decode(body, ipc.DAEMON_TYPES)


def test_commands_are_read_as_they_come_and_the_pipes_end_is_raised_to_every_caller() -> None:
    """The worker's command reader (a thread on an unbuffered pipe, frames split across
    reads): whole messages in order, nothing waiting once they are taken, and the pipe's
    end an IpcError each time it is asked after."""
    import os

    from training import ipc

    read_fd, write_fd = os.pipe()
    with open(read_fd, "rb", buffering=0) as stream:
        reader = ipc.CommandReader(stream)
        assert not reader.waiting()
        frames = ipc.encode("outer_go", {"round": 3, "peer": True}) + ipc.encode("stop", {})
        for k in range(0, len(frames), 5):  # in pieces, as a pipe may deliver them
            os.write(write_fd, frames[k : k + 5])
        assert reader.get() == {"t": "outer_go", "v": 1, "round": 3, "peer": True}
        assert reader.get() == {"t": "stop", "v": 1}
        assert not reader.waiting()
        os.close(write_fd)
        for _ in range(2):
            with pytest.raises(ipc.IpcError, match="closed"):
                reader.get()


def test_inner_steps_stop_when_told_before_a_step() -> None:
    """Overlapped rounds take steps until the daemon's word is there: ``until`` is asked
    before each step, and the loss is the mean of the steps taken."""
    from tests.test_trainer import trainer

    t = trainer(0)
    assert t.inner_steps(5, until=lambda: True) == 0.0 and t.step == 0
    loss = t.inner_steps(5, until=lambda: t.step >= 2)
    assert t.step == 2 and loss > 0


async def test_a_full_disk_is_a_clear_error_and_a_retry_not_a_crash(short_tmp: Path) -> None:
    """The first checkpoint write lands on /dev/full (ENOSPC); the worker says so, trains on,
    and the next round's save works: no crash loop. Writes are in the background: each
    round's ``saved`` comes before the next round's ``outer_done``, the last round's before
    its own."""
    path = short_tmp / "w.ckpt"
    (short_tmp / "w.ckpt.tmp").symlink_to("/dev/full")
    worker = await start_worker(algorithm="local", rounds=2, checkpoint_path=str(path))
    assert (await receive(worker))["t"] == "ready"
    saves: dict[int, str | None] = {}

    async def next_message() -> dict[str, Any]:
        while (message := await receive(worker))["t"] == "saved":
            saves[message["round"]] = message["save_error"]
        return message

    for round_index in range(2):
        assert (await next_message())["t"] == "round_done"
        await worker.send("outer_go", round=round_index, peer=False)
        done = await next_message()
        assert done["t"] == "outer_done" and "save_error" not in done
    assert sorted(saves) == [0, 1]  # round 1's (the last) came before its outer_done
    assert saves[0] is not None and "space" in saves[0].lower() and saves[1] is None
    assert path.exists()
    await worker.send("stop")
    with trio.fail_after(TIMEOUT_S):
        assert await worker.process.wait() == 0


async def test_a_session_failing_with_a_bug_restarts_the_worker_and_one_failing_every_time_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bug on the daemon's side of a session (seen: a negative pause in pairing killed 3
    daemons of a soak) restarts the session from the worker's checkpoint instead of ending
    the daemon; one that fails every time still ends it; the test suite's strict mode
    raises at once."""
    from node import supervisor

    monkeypatch.delenv(supervisor.STRICT_ENV)
    monkeypatch.setattr(supervisor, "RESTART_DELAY_S", 0.0)
    monkeypatch.setattr(supervisor, "MAX_SESSION_ERRORS_IN_A_ROW", 2)
    run = RunSettings(algorithm="noloco", rounds=1, model="tiny", inner=InnerConfig(steps_per_round=5))
    config = WorkerConfig(run=run, model_overrides=SMALL_MODEL)
    sessions = []

    async def fails_once(worker: WorkerConnection) -> None:
        sessions.append(worker.start_round)
        if len(sessions) == 1:
            raise ValueError("a bug")

    once = supervisor.Supervisor(config, fails_once)
    with trio.fail_after(TIMEOUT_S):
        await once.run()
    assert once.num_starts == 2 and once.session_errors == 1 and once.finished.is_set()

    async def always_fails(worker: WorkerConnection) -> None:
        raise ValueError("the same bug")

    always = supervisor.Supervisor(config, always_fails)
    with trio.fail_after(TIMEOUT_S), pytest.raises(ValueError, match="the same bug"):
        await always.run()
    assert always.num_starts == 2 and always.session_errors == 2
    monkeypatch.setenv(supervisor.STRICT_ENV, "1")
    strict = supervisor.Supervisor(config, always_fails)
    with trio.fail_after(TIMEOUT_S), pytest.raises(ValueError, match="the same bug"):
        await strict.run()
    assert strict.num_starts == 1


def test_the_console_says_when_the_worker_trains_elsewhere_than_expected(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """auto expects a GPU where the driver lists one: a worker on the CPU there (a CPU build
    of torch) is said on the console, once; a GPU the probe missed (a sandbox without the
    driver's files) is no surprise; cuda:N expects cuda."""
    from node import device
    from node.supervisor import Supervisor

    async def session(worker: WorkerConnection) -> None:
        raise AssertionError("not started")

    run = RunSettings(algorithm="local")
    gpus = tmp_path / "gpus"
    monkeypatch.setattr(device, "NVIDIA_PROC_DIR", gpus)
    Supervisor(WorkerConfig(run=run, device="auto"), session)._note_device("cuda:0")
    (gpus / "0000:01:00.0").mkdir(parents=True)
    supervisor = Supervisor(WorkerConfig(run=run, device="auto"), session)
    supervisor._note_device("cuda")
    assert "asked to train on" not in caplog.text
    supervisor._note_device("cpu")
    supervisor._note_device("cpu")
    assert caplog.text.count("asked to train on auto, but the worker trains on cpu") == 1
    Supervisor(WorkerConfig(run=run, device="cuda:1"), session)._note_device("cuda:1")
    assert caplog.text.count("asked to train on") == 1


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_shared_memory_is_page_locked_for_a_gpu_and_copies_land_whole(device: str) -> None:
    from multiprocessing import shared_memory

    from training.pinned import page_locked

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (none on this machine)")
    block = shared_memory.SharedMemory(create=True, size=1 << 20)
    try:
        with page_locked(block, torch.device(device)) as locked:
            assert locked == (device == "cuda")
            view = torch.frombuffer(block.buf, dtype=torch.uint8)
            data = torch.arange(1 << 20, dtype=torch.int64).remainder(251).to(torch.uint8).to(device)
            view.copy_(data)
            assert torch.equal(view, data.cpu())
            assert torch.equal(view.to(device), data)
            del view
    finally:
        block.close()
        block.unlink()


def test_a_block_still_viewed_by_a_transfer_is_closed_once_the_view_is_gone() -> None:
    """Closing a block a transfer still reads raised BufferError, and its ``__del__`` later
    raised it again where nobody catches it (a test's end, cancelled mid-exchange)."""
    import gc
    from multiprocessing import shared_memory

    from node import supervisor
    from node.supervisor import attach_block, close_block

    created = [shared_memory.SharedMemory(create=True, size=4096) for _ in range(2)]
    try:
        held, other = (attach_block(b.name) for b in created)
        view = memoryview(held.buf)  # a send of this round still reads it
        close_block(held)
        assert held in supervisor._lingering
        del held
        gc.collect()  # it stays referenced: its __del__ does not run while the view lives
        view.release()
        close_block(other)
        assert supervisor._lingering == []
    finally:
        for block in created:
            block.close()
            block.unlink()
