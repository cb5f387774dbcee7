"""A collective that failed because another rank is gone, said in one line.

When a node dies (or a rank on it is killed), every surviving rank's next collective raises:
gloo at once ("Connection closed by peer [10.0.0.2]:54411"), NCCL when its watchdog or the
collective timeout (--dist-timeout-minutes) fires. The traceback that Python prints runs
through DeepSpeed's and torch's wrappers down to gloo's source file, once on every surviving
rank, and says nothing a user can act on; this line says what happened and what to do."""
from __future__ import annotations

import re

# what torch's backends say when the other end of a collective went away
LOST_PEER = re.compile(r"Connection closed by peer|Connection reset by peer|Broken pipe|"
                       r"remote process exited|Socket Timeout|Timed out|timed out|"
                       r"NCCL communicator was aborted|ProcessGroupNCCL.*Watchdog", re.IGNORECASE)


def lost_peer_line(exc: BaseException, rank: str, host: str) -> str | None:
    """One line for a collective that failed for want of a peer; None for any other error."""
    try:
        import torch.distributed as dist
        distributed = isinstance(exc, getattr(dist, "DistError", ()))
    except ImportError:
        distributed = False
    message = str(exc)
    if not (distributed or isinstance(exc, RuntimeError)) or not LOST_PEER.search(message):
        return None
    # "[/__w/pytorch/.../pair.cc:553] Connection closed by peer [10.0.0.2]:54411. This is typically..."
    what = re.sub(r"^\[[^\]]*\]\s*", "", message.strip().splitlines()[0]).split(". ")[0].rstrip(".")
    if re.search(r"timed out|timeout", what, re.IGNORECASE):  # alive but silent: behind, hung or stopped
        return (f"train.py: error: rank {rank} on {host} waited for a peer longer than the collective timeout "
                f"({what}): another rank fell behind, hung or stopped; find it in its own log (raise "
                f"--dist-timeout-minutes if it is only slow), then relaunch the same command, or requeue the "
                f"job, to go on from the last checkpoint (--resume auto)")
    return (f"train.py: error: rank {rank} on {host} lost a peer ({what}): another rank's process or its node "
            f"stopped (that rank's own log says why, if it could write one); relaunch the same command, or "
            f"requeue the job, to go on from the last checkpoint (--resume auto)")
