"""One launch per RUN directory. A double submit (two Slurm jobs, a relaunch while the first
still runs) would otherwise resume from the same checkpoint and both write its metrics and
checkpoints. Rank 0 holds an exclusive `flock` on RUN/.launch.lock for the launch's life and
writes its host, process and start time there; a second launch is refused in one line naming
them. The kernel drops the lock with its holder, so a SIGKILLed or crashed launch leaves no lock
that blocks the relaunch (a leftover file is only read to name a live holder). On NFS, Linux
maps `flock` onto the server's byte-range locks, so launches from two hosts see each other."""
from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

LOCK = ".launch.lock"


class RunHeld(Exception):
    """The RUN is held by a live launch; the message is the one line to print."""


class RunLock:
    def __init__(self, handle):
        self.handle = handle

    def release(self) -> None:
        if self.handle is not None:
            self.handle.close()  # closing the file drops the flock
            self.handle = None


def hold(run_dir: Path) -> RunLock:
    """The lock of `run_dir` (made if need be), or RunHeld naming the launch that has it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK
    handle = open(path, "a+", encoding="utf-8")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        try:
            holder = json.loads(handle.read())
            who = (f"process {holder['pid']} on host {holder['host']} "
                   f"(started {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(holder['started']))})")
        except (ValueError, KeyError, TypeError):
            who = "another process"
        handle.close()
        raise RunHeld(f"{run_dir} is in use by a live launch: {who} holds {path}; wait for it to end or stop it, "
                      f"or give another --output-dir") from None
    handle.seek(0)
    handle.truncate()
    handle.write(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}))
    handle.flush()
    return RunLock(handle)
