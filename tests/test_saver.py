"""Checkpoints written in the background (training/saver.py): what is written is the state
when ``save`` was called, whatever training does to it afterwards; one write at a time, a
round that finds one going skipped (training never waits for the disk) except the run's
last; each reported once it is on disk; a failed write reported, not raised."""

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from training import checkpoint, saver
from training.saver import BackgroundSaver


class HeldWrites:
    """``checkpoint.save`` that waits until the test lets each write go."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.go = threading.Event()
        self.started = threading.Event()
        real = checkpoint.save

        def held(path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
            self.started.set()
            assert self.go.wait(60)
            real(path, tensors, meta)

        monkeypatch.setattr(checkpoint, "save", held)


def recording(tmp_path: Path) -> tuple[BackgroundSaver, list[tuple[int, str | None]], Path]:
    """A writer to ``tmp_path/run.ckpt`` whose reports are kept in order."""
    reports: list[tuple[int, str | None]] = []
    path = tmp_path / "run.ckpt"
    return BackgroundSaver(path, lambda r, e: reports.append((r, e))), reports, path


def test_the_file_holds_the_state_at_save_time_though_training_changes_it_during_the_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    held = HeldWrites(monkeypatch)
    writer, reports, path = recording(tmp_path)
    weights = torch.arange(1000, dtype=torch.float32)
    writer.save(3, {"w": weights}, {"round": 4})
    assert held.started.wait(60)
    weights.mul_(-1)  # the next round's inner steps, while the write is under way
    assert reports == [] and not path.exists()  # not reported before it is on disk
    held.go.set()
    writer.wait()
    assert reports == [(3, None)]
    tensors, meta = checkpoint.load(path)
    assert torch.equal(tensors["w"], torch.arange(1000, dtype=torch.float32)) and meta == {"round": 4}


def test_one_write_at_a_time_a_must_save_waits_for_it_reports_in_order_and_buffers_follow_the_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    held = HeldWrites(monkeypatch)
    writer, reports, path = recording(tmp_path)
    assert writer.save(0, {"a": torch.zeros(4), "lost": torch.ones(2)}, {"round": 1})
    assert held.started.wait(60)
    second = threading.Thread(target=writer.save, args=(1, {"a": torch.ones(4)}, {"round": 2}), kwargs={"must": True})
    second.start()
    second.join(0.2)  # a bounded look, not a wait for each other: it must still be waiting
    assert second.is_alive() and reports == []
    held.go.set()
    second.join(60)
    writer.close()
    assert reports == [(0, None), (1, None)] and writer.skipped == 0
    tensors, meta = checkpoint.load(path)
    assert sorted(tensors) == ["a"] and bool(tensors["a"].eq(1).all()) and meta == {"round": 2}


def test_a_round_that_finds_the_last_write_going_is_skipped_not_waited_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU a write of gpt-125m's state took 4.5 rounds at H = 50: waiting for each one
    stalled training 70% of the time (docs/performance.md)."""
    held = HeldWrites(monkeypatch)
    writer, reports, path = recording(tmp_path)
    assert writer.save(0, {"w": torch.zeros(4)}, {"round": 1})
    assert held.started.wait(60)
    # Returns at once (the write is held: a wait here would never end), nothing copied.
    assert not writer.save(1, {"w": torch.ones(4)}, {"round": 2})
    writer.stage({"adam": torch.full((4,), 7.0)})  # a round's end under overlap: skipped too
    held.go.set()
    writer.wait()
    # That staged round's save is skipped though the write has ended: its end was not kept.
    assert not writer.save(2, {"w": torch.full((4,), 2.0)}, {"round": 3})
    assert writer.skipped == 2 and reports == [(0, None)]
    assert torch.equal(checkpoint.load(path)[0]["w"], torch.zeros(4))
    # The writer free again: the next round is written, with what its end staged.
    writer.stage({"adam": torch.full((4,), 5.0)})
    assert writer.save(3, {"w": torch.full((4,), 3.0)}, {"round": 4})
    writer.close()
    tensors, meta = checkpoint.load(path)
    assert reports == [(0, None), (3, None)] and meta == {"round": 4}
    assert torch.equal(tensors["w"], torch.full((4,), 3.0)) and torch.equal(tensors["adam"], torch.full((4,), 5.0))


def test_a_failed_write_is_reported_and_the_old_file_stays(tmp_path: Path) -> None:
    path = tmp_path / "run.ckpt"
    checkpoint.save(path, {"w": torch.zeros(3)}, {"round": 1})
    (tmp_path / "run.ckpt.tmp").symlink_to("/dev/full")
    reports: list[tuple[int, str | None]] = []
    writer = BackgroundSaver(path, lambda r, e: reports.append((r, e)))
    writer.save(1, {"w": torch.ones(3)}, {"round": 2})
    writer.close()
    assert len(reports) == 1 and reports[0][0] == 1 and "space" in str(reports[0][1]).lower()
    assert checkpoint.load(path)[1] == {"round": 1}
    assert saver.write(path, {"w": torch.tensor([float("nan")])}, {"round": 3}) is not None  # refused, not raised


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("room", [True, False], ids=["snapshot-on-device", "no-room-copy-on-training-stream"])
def test_a_gpu_state_is_copied_before_training_changes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, room: bool
) -> None:
    """Staged and saved tensors, changed by the training stream at once after each call and
    again while the write waits, with a long kernel queued first so that a copy out that
    did not wait for the snapshot (or a snapshot overwritten early) would read changed values."""
    if not room:
        monkeypatch.setattr(saver, "_room_for", lambda tensor: None)
    held = HeldWrites(monkeypatch)
    path = tmp_path / "run.ckpt"
    writer = BackgroundSaver(path, lambda r, e: None)
    n = 1 << 24
    adam = torch.arange(n, dtype=torch.float32, device="cuda")
    weights = torch.arange(n, dtype=torch.float32, device="cuda") * 2
    slow = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):  # ~tens of ms of work queued ahead of the copies (tanh: bounded, no overflow)
        slow = torch.tanh(slow @ slow)
    writer.stage({"adam": adam})
    adam.mul_(-1)
    writer.save(0, {"w": weights}, {"round": 1})
    weights.mul_(-1)  # queued after the copy on the same stream
    for _ in range(3):  # the next rounds' steps while the write is held; saves skipped meanwhile
        adam.add_(1)
        weights.add_(1)
        writer.stage({"adam": adam})
        assert not writer.save(1, {"w": weights}, {"round": 2})
    held.go.set()
    writer.close()
    tensors = checkpoint.load(path)[0]
    assert torch.equal(tensors["adam"], torch.arange(n, dtype=torch.float32))
    assert torch.equal(tensors["w"], torch.arange(n, dtype=torch.float32) * 2)


def test_a_save_the_last_writes_report_brings_about_is_written_not_skipped(tmp_path: Path) -> None:
    """The daemon's next ``outer_go`` can follow a ``saved`` before the writer's thread has
    ended: that round is written (the file it waited for is on disk), reported after it."""
    reports: list[int] = []
    path = tmp_path / "run.ckpt"
    reported = threading.Event()
    leave = threading.Event()

    def report(round_index: int, _error: str | None) -> None:
        reports.append(round_index)
        reported.set()
        assert leave.wait(60)  # the thread stays alive until the next save has been asked for

    writer = BackgroundSaver(path, report)
    assert writer.save(0, {"w": torch.zeros(4)}, {"round": 1})
    assert reported.wait(60)
    threading.Timer(0.2, leave.set).start()  # the report returns a moment later
    assert writer.save(1, {"w": torch.ones(4)}, {"round": 2})  # waits for it, then writes
    writer.close()
    assert reports == [0, 1] and writer.skipped == 0
    assert checkpoint.load(path)[1] == {"round": 2}
