"""The persistent identity and the data dir's lock and saves."""

import stat
from pathlib import Path

import pytest

from node import identity
from node.datadir import DataDir
from node.errors import DataDirError
from protocol.net.host import peer_id_from_seed


def test_identity_is_created_private_and_reloaded(tmp_path: Path) -> None:
    path = tmp_path / "identity.key"
    seed = identity.load_or_create(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert identity.load_or_create(path) == seed
    assert peer_id_from_seed(seed) == peer_id_from_seed(identity.load_or_create(path))
    assert peer_id_from_seed(seed).startswith("12D3KooW")  # ed25519, identity multihash


def test_truncated_identity_file_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "identity.key"
    path.write_bytes(b"short")
    with pytest.raises(DataDirError, match="holds 5 bytes"):
        identity.load_or_create(path)


def test_world_readable_identity_is_made_private(tmp_path: Path) -> None:
    path = tmp_path / "identity.key"
    seed = identity.load_or_create(path)
    path.chmod(0o644)
    assert identity.load_or_create(path) == seed
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_one_daemon_per_data_dir(tmp_path: Path) -> None:
    first = DataDir(tmp_path / "d")
    first.open()
    try:
        with pytest.raises(DataDirError, match="another daemon"):
            DataDir(tmp_path / "d").open()
    finally:
        first.close()
    second = DataDir(tmp_path / "d")
    second.open()
    second.close()


def test_run_state_saves_atomically(tmp_path: Path) -> None:
    data_dir = DataDir(tmp_path / "d")
    data_dir.open()
    assert data_dir.load_run("r-abcdef") is None
    data_dir.save_run("r-abcdef", b"one")
    data_dir.save_run("r-abcdef", b"two")
    assert data_dir.load_run("r-abcdef") == b"two"
    assert [p.name for p in (tmp_path / "d" / "runs").iterdir()] == ["r-abcdef.crdt"]
    data_dir.close()


def test_a_replaced_key_file_is_reported_not_silent(tmp_path: Path) -> None:
    record = tmp_path / identity.RECORD_FILE
    first = peer_id_from_seed(identity.load_or_create(tmp_path / "identity.key"))
    assert identity.remember(record, first) is None  # first start
    assert identity.remember(record, first) is None  # the same again
    (tmp_path / "identity.key").unlink()
    second = peer_id_from_seed(identity.load_or_create(tmp_path / "identity.key"))
    warning = identity.remember(record, second)
    assert warning is not None and first in warning and second in warning
    assert identity.remember(record, second) is None  # said once; now this is who we are
