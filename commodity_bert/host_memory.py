"""Bounding a CPU rank's host memory: glibc's malloc with a fixed mmap threshold.

Training on the CPU allocates and frees activation-sized blocks (0.1-80 MB for `mini`) every
step. glibc serves blocks above its mmap threshold (128 KiB at start) with mmap, but it raises
the threshold to the size of each mmapped block freed (up to 32 MiB), so after the first steps
most activations come from the brk heap, where they fragment and are rarely given back. A `mini`
rank's RSS rose from 1.8 to 2.6 GB over 120 steps and peaked at 4.7 GB in a 1,563-step run; with
the threshold pinned (`MALLOC_MMAP_THRESHOLD_=131072`, which also turns the raise off) it held at
1.3 GB over the same 120 steps, peak 1.6 GB (benchmarks/rank_memory.py; benchmarks/RESULTS.md). The environment variable must be set before
the process starts, which a user launching `deepspeed train.py` would have to know; mallopt sets
the same thing from inside, before the model and the first batch are built.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os

M_MMAP_THRESHOLD = -3  # glibc's malloc.h
THRESHOLD = 128 * 1024  # glibc's own starting value; setting it turns the dynamic raise off


def pin_mmap_threshold(threshold: int = THRESHOLD) -> bool:
    """Fix glibc's mmap threshold (unless MALLOC_MMAP_THRESHOLD_ already says one). Returns
    whether it was set: False off glibc (musl, macOS), where there is nothing to fix."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False  # the user's own setting, read by glibc at start-up
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, threshold))
