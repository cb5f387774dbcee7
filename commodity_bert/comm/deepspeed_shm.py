"""Workarounds for DeepSpeed's JIT-compiled CPU ops: its shared-memory allreduce
(`deepspeed_shm_comm`) and its CPU Adam (`fused_adam`).

DeepSpeed compiles the first inside `deepspeed.init_distributed` on every CPU rank, and the
second inside `deepspeed.initialize` when a config names Adam or AdamW, the first time on a
machine: ~50 s each on 2 cores, in every rank at once, with no message. Things about that
hurt users, and are handled here:
- the shm op's buffers are never freed (`release_deepspeed_shm_buffer`);
- the compile is guarded by torch's lock file, which a killed compile (Ctrl-C in the first
  minute of a first launch, a preempted job) leaves behind: every later launch then waits on
  it for ever, silently (`clear_stale_build_locks`). `python -m commodity_bert.comm.deepspeed_shm`,
  run by recipes/setup_env.sh, builds both once, in one process, before any launch.
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


# what each builds, for messages
CPU_OPS = {"ShareMemCommBuilder": "CPU shm allreduce op", "FusedAdamBuilder": "CPU Adam op"}


def _cpu_op_builders() -> dict:
    """DeepSpeed's builders of the CPU ops a training may compile, by message name; empty where
    DeepSpeed would compile none of them (GPUs: their ops are CUDA builds of another kind)."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu":
        return {}
    builders = {}
    for builder_name, what in CPU_OPS.items():
        builder = get_accelerator().create_op_builder(builder_name)
        if builder is not None and deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
            builders[what] = builder
    return builders


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


def clear_stale_build_locks() -> list[Path]:
    """Remove the ops' build locks that no process holds; returns the paths removed."""
    if not sys.platform.startswith("linux"):
        return []
    from torch.utils.cpp_extension import _get_build_directory

    removed = []
    for builder in _cpu_op_builders().values():
        lock = Path(_get_build_directory(builder.NAME, verbose=False)) / "lock"
        if _stale(lock):
            with contextlib.suppress(FileNotFoundError):
                lock.unlink()
                removed.append(lock)
    return removed


def _stale(lock: Path) -> bool:
    """A lock no process holds, the same file before and after looking: a compile holds its lock
    open from making it to removing it, so a lock that was there all through a scan that saw no
    holder is a dead compile's. One made during the scan (a compile that released it and another
    that took it, in a rank beside this one) is a new file, and kept: removing it made that
    compile's own removal fail and stopped its rank."""
    def identity(path: Path) -> tuple[int, int] | None:
        try:
            status = path.stat()
        except FileNotFoundError:
            return None
        return status.st_ino, status.st_ctime_ns

    before = identity(lock)
    return before is not None and not _held_open(lock) and identity(lock) == before


def build_cpu_ops() -> list[str]:
    """Compile (or find compiled) the ops now, in this one process; a line on what it did for each."""
    builders = _cpu_op_builders()
    if not builders:
        return ["DeepSpeed's CPU ops: not used here (no CPU accelerator, or not compatible)"]
    removed = clear_stale_build_locks()
    lines = [f"removed a stale build lock, {lock}" for lock in removed]
    for what, builder in builders.items():
        try:
            builder.load(verbose=False)
        except Exception as exc:  # noqa: BLE001 - a compiler problem; the first launch will meet it again
            lines.append(f"warning: DeepSpeed's {what} did not build ({type(exc).__name__}: {exc})")
        else:
            lines.append(f"DeepSpeed's {what}: built")
    return lines


if __name__ == "__main__":
    print("\n".join(build_cpu_ops()))
