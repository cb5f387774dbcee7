"""Workarounds for DeepSpeed's CPU shared-memory allreduce op (`deepspeed_shm_comm`).

DeepSpeed JIT-compiles this op inside `deepspeed.init_distributed` on every CPU rank, the
first time on a machine. Two things about that hurt users, and are handled here:
- its buffers are never freed (`release_deepspeed_shm_buffer`);
- the compile is guarded by torch's lock file, which a killed compile (Ctrl-C in the first
  minute of a first launch, a preempted job) leaves behind: every later launch then waits on
  it for ever, silently (`clear_stale_build_lock`). `python -m commodity_bert.deepspeed_shm`,
  run by recipes/setup_env.sh, builds it once, in one process, before any launch.
"""
from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path


def release_deepspeed_shm_buffer(rank: int) -> None:
    """Unlink this rank's DeepSpeed CPU shared-memory allreduce buffer (/dev/shm, ~69 MB).

    DeepSpeed's shm comm op creates one per rank and never removes it, so every CPU run
    leaks RAM in /dev/shm until the machine slows down (seen here: 20 GB after a day of runs).
    Call after a barrier that follows init: every rank has mapped its peers' buffers by then,
    and an unlinked mapping stays valid until the process exits.
    """
    name = (f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
            f"{os.environ.get('MASTER_PORT', '')}_{rank}")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join("/dev/shm", name))


def _shm_op_builder():
    """DeepSpeed's builder for the op, or None where DeepSpeed would not use it (GPUs, non-Linux)."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu":
        return None
    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        return None
    return builder


def _held_open(path: Path) -> bool:
    """Whether any process on this machine has `path` open (torch's lock holder keeps its fd)."""
    target = str(path)
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        try:
            for fd in fd_dir.iterdir():
                with contextlib.suppress(OSError):
                    if os.readlink(fd) == target:
                        return True
        except OSError:  # a process that ended, or one we may not look into
            continue
    return False


def clear_stale_build_lock() -> Path | None:
    """Remove the op's build lock if no process holds it; returns the path removed, if any."""
    if not sys.platform.startswith("linux"):
        return None
    builder = _shm_op_builder()
    if builder is None:
        return None
    from torch.utils.cpp_extension import _get_build_directory

    lock = Path(_get_build_directory(builder.NAME, verbose=False)) / "lock"
    if lock.exists() and not _held_open(lock):
        with contextlib.suppress(FileNotFoundError):
            lock.unlink()
            return lock
    return None


def build_shm_op() -> str:
    """Compile (or find compiled) the op now, in this one process; says what it did."""
    builder = _shm_op_builder()
    if builder is None:
        return "DeepSpeed's CPU shm allreduce op: not used here (no CPU accelerator or not compatible)"
    removed = clear_stale_build_lock()
    try:
        builder.load(verbose=False)
    except Exception as exc:  # noqa: BLE001 - a compiler problem; the first launch will meet it again
        return f"warning: DeepSpeed's CPU shm allreduce op did not build ({type(exc).__name__}: {exc})"
    note = f" (removed a stale build lock, {removed})" if removed else ""
    return f"DeepSpeed's CPU shm allreduce op: built{note}"


if __name__ == "__main__":
    print(build_shm_op())
