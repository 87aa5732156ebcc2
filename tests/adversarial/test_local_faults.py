"""Local faults a node must survive: saved state that would crash the CRDT library, a full
disk under the run state, a replaced identity (tests/test_identity.py, tests/test_worker.py
have the key file and the worker's checkpoint)."""

import json
from pathlib import Path

import pytest

from tests.conftest import open_swarm, wait_until

pytestmark = pytest.mark.integration
RUN_ID = "fault-abc123"
VECTORS = Path(__file__).parent.parent / "vectors" / "crdt_hostile_v1.json"


async def test_saved_state_that_crashed_pycrdt_is_moved_aside_and_the_node_starts(short_tmp: Path) -> None:
    # The 36 bytes that made pycrdt segfault on its first read (two blocks of one client).
    poison = bytes.fromhex("020107002801076d656d626572730161017e0107002801076d656d626572730162017e00")
    assert any(poison.hex() in case["updates"] for case in json.loads(VECTORS.read_text())["cases"])
    runs = short_tmp / "n0" / "runs"
    runs.mkdir(parents=True)
    (runs / f"{RUN_ID}.crdt").write_bytes(poison)
    async with open_swarm(short_tmp) as swarm:
        node = await swarm.start("n0", run__run_id=RUN_ID)
        assert node.run_service is not None
        assert (runs / f"{RUN_ID}.corrupt").read_bytes() == poison  # kept for the user, not deleted
        await wait_until(lambda: node.peer_id in node.run_service.state.members, swarm.changes, timeout_s=30)  # type: ignore[union-attr]


async def test_a_full_disk_under_the_run_state_is_an_error_not_a_crash(short_tmp: Path) -> None:
    runs = short_tmp / "n0" / "runs"
    runs.mkdir(parents=True)
    (runs / f"{RUN_ID}.crdt.tmp").symlink_to("/dev/full")  # the next save's temp file is a full disk
    async with open_swarm(short_tmp) as swarm:
        node = await swarm.start("n0", run__run_id=RUN_ID)
        assert node.run_service is not None
        node._save(node.run_service.state)  # ENOSPC: logged, the daemon goes on
        assert not (runs / f"{RUN_ID}.crdt.tmp").exists()  # no debris (the link went with the failed write)
        node._save(node.run_service.state)  # the retry works
        assert (runs / f"{RUN_ID}.crdt").read_bytes() == node.run_service.state.encode()
