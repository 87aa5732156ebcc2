"""One ``swarmtrain simulate`` run for a bench: the command, its report, a clear failure."""

import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def simulate(
    flags: Sequence[str], report: Path, *, timeout_s: float, exit_codes: Sequence[int] = (0,)
) -> dict[str, Any]:
    """Run ``swarmtrain simulate FLAGS`` (its command line echoed on stderr) and return its
    report; ``RuntimeError`` with the output's tail if it exits otherwise than with one of
    ``exit_codes`` or writes no report."""
    command = [
        *[sys.executable, "-m", "node", "simulate", *flags],
        *["--timeout-s", str(timeout_s), "--report", str(report)],
    ]
    print(" ".join(command[2:]), file=sys.stderr, flush=True)
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s + 120, check=False)
    if result.returncode not in exit_codes or not report.exists():
        raise RuntimeError(f"simulate exited {result.returncode}: {result.stdout[-1500:]}{result.stderr[-1500:]}")
    data: dict[str, Any] = json.loads(report.read_text())
    return data
