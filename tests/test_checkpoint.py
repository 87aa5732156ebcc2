"""Checkpoints: exact round trips, damaged files refused, and a restored trainer that
continues bit for bit where it stopped."""

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.test_trainer import trainer
from training import checkpoint
from training.checkpoint import CheckpointError


def test_tensors_and_meta_round_trip_exactly(tmp_path: Path) -> None:
    tensors = {
        "a": torch.randn(3, 4),
        "b": torch.arange(5, dtype=torch.int64),
        "c": torch.randn(7).to(torch.bfloat16),
        "empty": torch.zeros(0, 3),
    }
    path = tmp_path / "x.ckpt"
    checkpoint.save(path, tensors, {"round": 3, "note": "hi"})
    loaded, meta = checkpoint.load(path)
    assert meta == {"round": 3, "note": "hi"}
    assert list(loaded) == list(tensors)
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor)
    assert not path.with_name("x.ckpt.tmp").exists()


def test_the_hash_made_beside_the_writes_gives_the_bytes_of_hashing_first(tmp_path: Path) -> None:
    """The digest is made by a thread while the tensors are written and the header written
    again: the file is byte for byte the one a writer that hashed first would write."""
    tensors = {f"t{i}": torch.randn(1000 + i) for i in range(5)} | {"n": torch.arange(3)}
    meta = {"round": 7}
    raw = checkpoint._checked(tensors)
    meta_text = json.dumps(meta, sort_keys=True)
    header = checkpoint._header(tensors, raw, meta_text, checkpoint._digest(raw))
    expected = len(header).to_bytes(8, "little") + header + b"".join(d.numpy().tobytes() for d in raw.values())
    assert checkpoint.encode(tensors, meta) == expected
    checkpoint.save(tmp_path / "c", tensors, meta)
    assert (tmp_path / "c").read_bytes() == expected


def test_a_write_that_fails_waits_for_its_hash() -> None:
    """A full disk mid-write: the error comes out (write_atomic then removes the temporary
    file), after the hashing thread has ended."""
    import threading

    class FullDisk(io.BytesIO):
        def write(self, data: object) -> int:
            if self.tell() > 100:
                raise OSError(28, "No space left on device")
            return super().write(data)  # type: ignore[arg-type]

    tensors = {f"t{i}": torch.randn(4 << 20) for i in range(4)}  # 64 MB: ~40 ms of hashing
    with pytest.raises(OSError, match="No space"):
        checkpoint._write(FullDisk(), tensors, {})
    assert not [t for t in threading.enumerate() if t.name == "checkpoint-hash"]  # joined, not left running


def test_a_hash_that_fails_says_why_and_no_thread_still_gives_the_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The hash thread's own error comes out of the write (not an IndexError); where no
    thread can start (Python 3.12 at interpreter shutdown) the hash is made in line."""
    import threading

    tensors = {"a": torch.randn(100), "b": torch.arange(4)}
    expected = checkpoint.encode(tensors, {})

    def no_thread(self: threading.Thread) -> None:
        raise RuntimeError("can't create new thread at interpreter shutdown")

    with monkeypatch.context() as patched:
        patched.setattr(threading.Thread, "start", no_thread)
        assert checkpoint.encode(tensors, {}) == expected

    def broken(raw: object) -> str:
        raise MemoryError("the hash's own failure")

    monkeypatch.setattr(checkpoint, "_digest", broken)
    with pytest.raises(MemoryError, match="own failure"):
        checkpoint.encode(tensors, {})


def test_our_writer_is_read_by_safetensors_as_safetensors_own_file_is() -> None:
    """The file is written here without copying the state (training/checkpoint.py): what
    safetensors reads back must be what its own writer's file holds, for every dtype we
    store, scalars, empty and non-contiguous tensors, the data 8-byte aligned."""
    from safetensors.torch import load as safetensors_load
    from safetensors.torch import save as safetensors_save

    torch.manual_seed(0)
    tensors = {
        "f32": torch.randn(5, 3).t(),  # not contiguous
        "f64": torch.randn(4, dtype=torch.float64),
        "bf16": torch.randn(6).to(torch.bfloat16),
        "f16": torch.randn(2, 2).to(torch.float16),
        "i64": torch.tensor(-(1 << 40)),  # a scalar
        "i32": torch.arange(-3, 4, dtype=torch.int32),
        "u8": torch.arange(250, 256, dtype=torch.uint8),
        "empty": torch.zeros(0, 2),
    }
    ours = checkpoint.encode(tensors, {"round": 1})
    header_nbytes = int.from_bytes(ours[:8], "little")
    assert header_nbytes % 8 == 0
    read = safetensors_load(ours)
    reference = safetensors_load(safetensors_save({k: t.contiguous() for k, t in tensors.items()}))
    assert sorted(read) == sorted(reference) == sorted(tensors)
    for name, tensor in reference.items():
        assert read[name].dtype == tensor.dtype and read[name].shape == tensor.shape
        assert torch.equal(read[name].view(-1).view(torch.uint8), tensor.view(-1).view(torch.uint8)), name
    assert checkpoint.decode(ours)[1] == {"round": 1}


def good_bytes() -> bytes:
    return checkpoint.encode({"w": torch.arange(64, dtype=torch.float32)}, {"round": 1})


def with_header(data: bytes, edit: object) -> bytes:
    """The same file with its JSON header changed by ``edit`` (a function of the dict)."""
    nbytes = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + nbytes])
    edit(header)  # type: ignore[operator]
    raw = json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw + data[8 + nbytes :]


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda b: b[:-1], "unreadable"),
        (lambda b: b[:-4] + b"\x00\x00\x80\x7f", "hash"),  # a flipped value, e.g. an Inf
        (lambda b: (1 << 30).to_bytes(8, "little") + b[8:], "does not fit"),
        (lambda b: b[:5], "truncated"),
        (lambda b: b[:8] + b"\xff" + b[9:], "undecodable"),
        (lambda b: with_header(b, lambda h: h["__metadata__"].update(format="other/1")), "not a swarmtrain"),
        (lambda b: with_header(b, lambda h: h["__metadata__"].update(meta="[1, 2]")), "not a map"),
        (lambda b: with_header(b, lambda h: h["w"].update(shape=[65])), "unreadable"),
    ],
)
def test_damaged_files_are_refused_with_the_reason(damage, message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(CheckpointError, match=message):
        checkpoint.decode(damage(good_bytes()))


def test_a_tensor_named_like_the_headers_own_key_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="__metadata__"):
        checkpoint.save(tmp_path / "x.ckpt", {"__metadata__": torch.zeros(2)}, {})
    assert list(tmp_path.iterdir()) == []


def test_non_finite_values_are_never_saved(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="non-finite"):
        checkpoint.save(tmp_path / "x.ckpt", {"w": torch.tensor([1.0, float("nan")])}, {})
    assert list(tmp_path.iterdir()) == []  # no half-written temporary file either


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300), st.integers(min_value=0, max_value=400))
def test_arbitrary_damage_never_escapes_as_another_error(junk: bytes, cut: int) -> None:
    data = good_bytes()
    for candidate in (junk, data[:8] + junk, data[:cut] + junk, data[:cut]):
        with contextlib.suppress(CheckpointError):
            checkpoint.decode(candidate)


def test_a_restored_trainer_continues_bit_for_bit(tmp_path: Path) -> None:
    original = trainer(0)
    for _ in range(2):
        original.inner_steps()
        original.apply_noloco(None)
    path = tmp_path / "t.ckpt"
    checkpoint.save(path, *original.state())
    restored = trainer(0)
    restored.restore(*checkpoint.load(path))
    assert (restored.round, restored.step) == (original.round, original.step)
    for t in (original, restored):
        t.inner_steps()
        t.apply_noloco(None)
    assert all(torch.equal(a, b) for a, b in zip(original.phi, restored.phi, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(original.theta(), restored.theta(), strict=True))


def test_a_checkpoint_of_another_model_is_refused_and_changes_nothing() -> None:
    saved = trainer(0)
    saved.inner_steps()
    saved.apply_noloco(None)
    tensors, meta = saved.state()
    tensors["phi.0"] = tensors["phi.0"][:-1]
    fresh = trainer(0)
    before = [p.clone() for p in fresh.theta()]
    with pytest.raises(CheckpointError, match="does not fit"):
        fresh.restore(tensors, meta)
    tensors, meta = saved.state()
    tensors["momentum.1"] = torch.full_like(tensors["momentum.1"], float("nan"))
    with pytest.raises(CheckpointError, match="NaN"):
        fresh.restore(tensors, meta)
    assert fresh.round == 0 and all(torch.equal(a, b) for a, b in zip(before, fresh.theta(), strict=True))
