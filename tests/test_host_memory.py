"""A CPU rank pins glibc's mmap threshold (commodity_bert.host_memory), so that freed
activation-sized blocks go back to the system instead of fragmenting the heap."""
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# where a 4 MB block comes from after a 16 MB mmapped block was freed: glibc's dynamic threshold
# then serves it from the heap; pinned, it is mmapped (mallinfo2's hblkhd: bytes in mmapped blocks)
PROBE = """
import ctypes, sys
libc = ctypes.CDLL("libc.so.6")
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
if sys.argv[1] == "pinned":
    from commodity_bert.host_memory import pin_mmap_threshold
    assert pin_mmap_threshold()
libc.free(libc.malloc(16 << 20))
before = libc.mallinfo2().hblkhd
block = libc.malloc(4 << 20)
print("mmapped" if libc.mallinfo2().hblkhd - before >= 4 << 20 else "heap")
"""


def where_a_block_goes(mode: str, env: dict | None = None) -> str:
    proc = subprocess.run([sys.executable, "-c", PROBE, mode], cwd=REPO, capture_output=True, text=True,
                          env=env, check=False)
    if "mallinfo2" in proc.stderr:
        pytest.skip("this libc has no mallinfo2 (glibc < 2.33)")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.strip()


def test_pinned_threshold_keeps_large_blocks_off_the_heap():
    assert where_a_block_goes("default") == "heap"  # what fragmented a mini rank's heap to 4.7 GB
    assert where_a_block_goes("pinned") == "mmapped"


def test_a_users_own_malloc_setting_is_left_alone():
    import os
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "33554432"}
    proc = subprocess.run([sys.executable, "-c", "from commodity_bert.host_memory import pin_mmap_threshold; "
                           "print(pin_mmap_threshold())"], cwd=REPO, capture_output=True, text=True, env=env,
                          check=True)
    assert proc.stdout.strip() == "False"
