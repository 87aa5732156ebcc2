"""What this machine offers a run, found without importing torch (the daemon never does)."""

import os
from pathlib import Path

NVIDIA_PROC_DIR = Path("/proc/driver/nvidia/gpus")


def detect_device(setting: str) -> str:
    """``cpu`` or ``cuda``; ``auto`` picks cuda when the NVIDIA driver reports a GPU."""
    if setting != "auto":
        return setting
    try:
        has_gpu = NVIDIA_PROC_DIR.is_dir() and any(NVIDIA_PROC_DIR.iterdir())
    except OSError:
        has_gpu = False
    return "cuda" if has_gpu else "cpu"


def total_memory_nbytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
