"""The heap trimmer hands the C heap's free pages back on its steps, and only on them."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from commodity_bert.train.host_memory import HeapTrimmer

# 300 blocks of 1 MiB, each followed by a small block that stays alive, so that no freed block is at
# the heap's top (where free() itself would give it back): the fragmented heap of a long run.
CHILD = textwrap.dedent("""
    import sys, torch
    from commodity_bert.train.host_memory import HeapTrimmer
    def rss_mb():
        return int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) / 1024
    big, keep = [], []
    for _ in range(300):
        big.append(torch.ones(256 * 1024))
        keep.append(torch.ones(1024))
    del big
    freed = rss_mb()
    HeapTrimmer(int(sys.argv[1])).after_step(int(sys.argv[2]))
    print(freed, rss_mb())
""")


def rss_before_and_after(every: int, step: int) -> tuple[float, float]:
    # glibc starts with a 128 KiB mmap threshold and raises it as large blocks are freed; a long
    # run's threshold is up already, so blocks of 1 MiB come from the heap: pinned here for that
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(32 << 20)}
    out = subprocess.run([sys.executable, "-c", CHILD, str(every), str(step)], capture_output=True, text=True,
                         env=env, check=True)
    freed, after = map(float, out.stdout.split())
    return freed, after


@pytest.mark.skipif(not HeapTrimmer(1).active, reason="the C library has no malloc_trim (not glibc)")
def test_trimmer_returns_freed_heap_pages_on_its_steps_only():
    freed, after = rss_before_and_after(every=50, step=100)
    assert freed - after > 200, (freed, after)  # ~300 MB were free inside the heap
    freed, after = rss_before_and_after(every=50, step=99)
    assert abs(freed - after) < 20, (freed, after)
    freed, after = rss_before_and_after(every=0, step=100)  # 0: never
    assert abs(freed - after) < 20, (freed, after)
