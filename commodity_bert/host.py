"""What every package needs of the host it runs on: a tool's lines for the user, a file written
whole or not at all, a free port, and the name of the device a rank runs on (for the records)."""
from __future__ import annotations

import contextlib
import os
import socket
import sys
from collections.abc import Callable
from pathlib import Path


def speaker(tool: str = "", stream: str = "stdout", rank_zero: bool = False) -> Callable[..., None]:
    """A tool's `say(*lines)`: each line flushed at once (launchers and Slurm interleave the
    processes' logs) and named by the tool, so a reader tells its lines from DeepSpeed's and the
    ranks'. `stream` is looked up at each call (pytest swaps sys.stdout); with `rank_zero` only
    rank 0 of an initialized process group speaks."""
    def say(*lines: str) -> None:
        if rank_zero:
            import torch.distributed as dist
            if dist.is_initialized() and dist.get_rank() != 0:
                return
        for line in lines:
            print(f"{tool}: {line}" if tool else line, file=getattr(sys, stream), flush=True)
    return say


def atomic_write_text(path: Path, text: str) -> None:
    """`path` whole or as it was: written to a temporary name of this process, then renamed (a
    reader, or an interrupted run, never sees half a file)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_model() -> str | None:
    """/proc/cpuinfo's model name, None where there is none."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return None


def device_name(device) -> str:
    """What a rank runs on, for the record: the GPU's name, or the CPU's model."""
    if device.type == "cuda":
        import torch
        return torch.cuda.get_device_name(device)
    return f"CPU: {cpu_model() or 'unknown'}"
