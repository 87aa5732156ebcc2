"""The algorithm registries: one seam, named in two places, each side importable alone."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from node import algorithms as daemon_side
from training import algorithms as worker_side
from training import settings, worker

ROOT = Path(__file__).resolve().parent.parent


def test_both_sides_name_the_same_algorithms_and_the_settings_take_them() -> None:
    assert set(daemon_side.MODULES) == set(worker_side.MODULES)
    assert ("none", *worker_side.NAMES) == settings.ALGORITHMS


@pytest.mark.parametrize("name", worker_side.NAMES)
def test_each_algorithm_has_both_sides(name: str) -> None:
    cls = daemon_side.algorithm_class(name)
    assert callable(cls.settled) and callable(cls.train) and callable(cls.status)
    assert all(isinstance(key, str) for key in cls.REPORT_KEYS)
    assert callable(worker.worker_main(name))


def _imports(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", f"{code}\nimport sys; print(' '.join(sorted(m.split('.')[0] for m in sys.modules)))"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return set(out.stdout.split())


def test_the_daemon_side_never_imports_torch() -> None:
    loaded = _imports("; ".join(f"import {module}" for module in daemon_side.MODULES.values()))
    # It did import the daemon's world (typed against protocol/net/hostlike.py: no libp2p).
    assert {"node", "protocol", "trio", "msgpack"} <= loaded
    assert "torch" not in loaded


def test_the_worker_side_never_imports_the_network() -> None:
    loaded = _imports("; ".join(f"import {module}" for module in worker_side.MODULES.values()))
    assert "torch" in loaded
    assert not {"protocol", "node", "libp2p", "trio"} & loaded


def test_no_code_outside_the_registries_branches_on_the_algorithm_name() -> None:
    branch = re.compile(r"algorithm\s*(==|!=|in\s*[(\[{])|==\s*algorithm")
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for folder in ("node", "training", "protocol", "kernels")
        for path in sorted((ROOT / folder).rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if branch.search(line)
    ]
    assert found == []
