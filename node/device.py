"""What this machine offers a run, found without importing torch (the daemon never does)."""

import os
from pathlib import Path

NVIDIA_PROC_DIR = Path("/proc/driver/nvidia/gpus")


def detect_device(setting: str) -> str:
    """``cpu`` or ``cuda``, what a member record announces and what the worker is expected to
    train on (it decides: training/worker.py ``resolve_device``); ``auto`` is cuda when the
    NVIDIA driver reports a GPU, ``cuda:N`` is cuda."""
    if setting != "auto":
        return setting.partition(":")[0]
    try:
        has_gpu = NVIDIA_PROC_DIR.is_dir() and any(NVIDIA_PROC_DIR.iterdir())
    except OSError:
        has_gpu = False
    return "cuda" if has_gpu else "cpu"


def total_memory_nbytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
