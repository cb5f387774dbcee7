"""Give the C heap's free pages back to the system every few steps, so a rank's host memory grows
far less through a long run (a `mini` rank: 3.8 GB instead of 5.7 after 600 steps; it still
grows, more slowly: benchmarks/RESULTS.md#heap-trim).

Why the project's own: glibc's malloc raises its mmap threshold to the size of each large block
freed (up to 32 MiB), so after the first steps the activation-sized blocks come from the brk heap.
Length-stratified batches change shape every step, the heap fragments, and the free pages inside
it are never returned: a `mini` rank's RSS grew to 4.7 GB over 1,563 steps where it needs ~1.6 GB
(benchmarks/RESULTS.md, 2026-11-25). Pinning the threshold (`MALLOC_MMAP_THRESHOLD_`) bounds it too,
but maps and faults in every large block afresh each step, a third of the speed. `malloc_trim(0)`
hands back every whole free page inside the heap (madvise), not only its top, and costs a walk of
the free lists: once every N steps the faults of re-touching those pages are paid once per N.

Neither PyTorch nor DeepSpeed offers this for host memory (torch's CPU allocator is plain malloc);
on a C library without `malloc_trim` (musl, macOS) the trimmer does nothing.
"""
from __future__ import annotations

import ctypes
import ctypes.util


class HeapTrimmer:
    """`trimmer.after_step(step)` calls glibc's `malloc_trim(0)` every `every` steps (0: never)."""

    def __init__(self, every: int):
        self.every = every
        self._trim = None
        if every > 0:
            try:
                self._trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
            except (OSError, AttributeError):  # not glibc: nothing to trim with
                self._trim = None
            else:
                self._trim.argtypes = [ctypes.c_size_t]
                self._trim.restype = ctypes.c_int

    @property
    def active(self) -> bool:
        return self._trim is not None

    def after_step(self, step: int) -> None:
        if self._trim is not None and step % self.every == 0:
            self._trim(0)
