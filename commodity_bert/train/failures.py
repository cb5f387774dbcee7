"""A collective that failed because another rank is gone, said in one line.

When a node dies (or a rank on it is killed), every surviving rank's next collective raises:
gloo at once ("Connection closed by peer [10.0.0.2]:54411"), NCCL when its watchdog or the
collective timeout (--dist-timeout-minutes) fires. The traceback that Python prints runs
through DeepSpeed's and torch's wrappers down to gloo's source file, once on every surviving
rank, and says nothing a user can act on; this line says what happened and what to do."""
from __future__ import annotations

import contextlib
import os
import re

# --dist-timeout-minutes' default: how long a collective waits on a silent peer (docs/checkpoints.md)
DIST_TIMEOUT_MINUTES = 10.0

# what torch's backends say when the other end of a collective went away
LOST_PEER = re.compile(r"Connection closed by peer|Connection reset by peer|Broken pipe|"
                       r"remote process exited|Socket Timeout|Timed out|timed out|"
                       r"NCCL communicator was aborted|ProcessGroupNCCL.*Watchdog", re.IGNORECASE)


def lost_peer_line(exc: BaseException, rank: str, host: str) -> str | None:
    """One line for a collective that failed for want of a peer; None for any other error. For
    one that timed out, the heartbeats (start_heartbeat) name who stopped answering, if any did."""
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
    timed_out = re.search(r"timed out|timeout", what, re.IGNORECASE)
    silent = silent_peers(int(rank)) if timed_out and rank.isdigit() else None
    if silent:
        return (f"train.py: error: rank {rank} on {host}: {silent}, and the collective waiting on it timed out "
                f"({what}); once the link or host is back, relaunch the same command, or requeue the job, to go "
                f"on from the last checkpoint (--resume auto)")
    if timed_out:  # every rank still beats: one behind, or hung in its main thread
        return (f"train.py: error: rank {rank} on {host} waited for a peer longer than the collective timeout "
                f"({what}): another rank fell behind, hung or stopped; find it in its own log (raise "
                f"--dist-timeout-minutes if it is only slow), then relaunch the same command, or requeue the "
                f"job, to go on from the last checkpoint (--resume auto)")
    return (f"train.py: error: rank {rank} on {host} lost a peer ({what}): another rank's process or its node "
            f"stopped (that rank's own log says why, if it could write one); relaunch the same command, or "
            f"requeue the job, to go on from the last checkpoint (--resume auto)")


# ------------------------------------------------------- any other error: one line, named by the others
#
# An error the loop knows (a shard changed on disk, the metrics file) is held and travels with the
# next decision's allreduce (bookkeeping.hold_error). Any other exception (a bug, an out-of-memory,
# a library's error) leaves its rank mid-step, where no collective can carry it: the rank writes
# its traceback to a file of its own, says its line, and leaves the line in the process group's
# key-value store (the TCPStore of torch.distributed's rendezvous, served by rank 0's process and
# reached over the network, so nodes need share no directory); the others, whose next collective
# then fails for want of that rank, read it there and the first of them names the rank.

ERROR_KEY = "commodity_bert/error/{rank}"
SEEN_KEY = "commodity_bert/error_seen"
NAMED_KEY = "commodity_bert/error_named"
STORE_WAIT_S = 5.0     # for a store call: a dead store must not hold a rank that is ending
LINGER_S = 20.0        # rank 0 serves the store: it stays this long for the others to read it
_errors_dir: list = [None]
_store_gone = False  # it did not answer (silent_peers): the calls after it would wait in vain


def keep_tracebacks_in(directory) -> None:
    """Where a rank's traceback goes (RUN/errors); until main() says, the system's temp dir."""
    _errors_dir[0] = directory


def _within(seconds: float, call):
    """call() in a thread given `seconds`; None if it raised or did not return in time."""
    import threading
    result: list = [None]

    def run():
        with contextlib.suppress(Exception):
            result[0] = call()
    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(seconds)
    return result[0]


def _store():
    import torch.distributed as dist
    if _store_gone or not dist.is_available() or not dist.is_initialized():
        return None
    with contextlib.suppress(Exception):
        return dist.distributed_c10d._get_default_store()
    return None


def crash_line(exc: BaseException, rank: str, host: str) -> str:
    """The failing rank's own line; its traceback goes to a file named in it."""
    import tempfile
    import traceback
    from pathlib import Path
    directory = Path(_errors_dir[0]) if _errors_dir[0] else Path(tempfile.gettempdir())
    path = directory / f"rank{rank}_{host}_{os.getpid()}.traceback.txt"
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    where = ""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        where = f"; traceback in {path}"
    except OSError as write_error:
        where = f"; its traceback could not be written to {path} ({write_error.strerror})"
    message = (str(exc).strip().splitlines() or [""])[0][:300]
    return (f"train.py: error: rank {rank} on {host} stopped: {type(exc).__name__}"
            f"{': ' + message if message else ''}{where}; nothing was saved after it: fix the cause, then "
            f"relaunch the same command, or requeue the job, to go on from the last checkpoint (--resume auto)")


def tell_the_others(line: str, rank: int, world: int) -> None:
    """Leave this rank's line where the others will look for it. Rank 0 serves the store, so it
    closes its connections (the others' collectives fail at once) and stays until they have read
    it, or LINGER_S; any other rank's exit closes its own."""
    store = _store()
    if store is None or world < 2:
        return
    if _within(STORE_WAIT_S, lambda: store.set(ERROR_KEY.format(rank=rank), line) or True) is None:
        return
    if rank != 0:
        return
    import time
    _close_connections_but_the_store()
    deadline = time.monotonic() + LINGER_S
    while time.monotonic() < deadline:
        seen = _within(STORE_WAIT_S, lambda: store.add(SEEN_KEY, 0))
        if seen is None or seen >= world - 1:
            return
        time.sleep(0.1)


def _close_connections_but_the_store() -> None:
    """Shut down this process's TCP connections (the collectives' pairs) but the store's (those to
    or from MASTER_PORT): the others' collectives fail at once, and the store still serves them.
    Destroying the process group does not do it: it closes the pairs only once nothing refers to
    them, and DeepSpeed and the communication mode keep groups of their own."""
    import socket
    store_port = int(os.environ.get("MASTER_PORT", "0"))
    for fd in map(int, os.listdir("/proc/self/fd")):
        with contextlib.suppress(OSError):
            # the socket object wraps the descriptor itself (no dup: a rank out of descriptors is
            # one this must work for) and lets go of it unclosed
            connection = socket.socket(fileno=fd)
            try:
                if connection.family in (socket.AF_INET, socket.AF_INET6) and connection.type == socket.SOCK_STREAM \
                        and store_port not in (connection.getsockname()[1], connection.getpeername()[1]):
                    connection.shutdown(socket.SHUT_RDWR)
            finally:
                connection.detach()


def peer_error_line(rank: int, host: str, world: int) -> str | None:
    """For a rank whose collective failed: the line of the rank that stopped with an error, for
    the first of the others to say ("" for the rest); None when no rank left one (a peer that was
    killed or whose node died: the lost-peer line then)."""
    store = _store()
    if store is None:
        return None

    def look():
        for other in range(world):
            key = ERROR_KEY.format(rank=other)
            if other != rank and store.check([key]):
                return other, store.get(key).decode(errors="replace")
        return None
    found = _within(STORE_WAIT_S, look)
    if found is None:
        return None
    other, line = found
    first = _within(STORE_WAIT_S, lambda: store.add(NAMED_KEY, 1)) == 1
    _within(STORE_WAIT_S, lambda: store.add(SEEN_KEY, 1))
    if not first:
        return ""
    quoted = line.removeprefix("train.py: error: ")
    return (f"train.py: error: rank {rank} on {host} stopped because rank {other} did (its line: {quoted})")


# ------------------------------------------------------- a peer that stopped answering: which
#
# A collective whose peer stalls (a link down, a host frozen) times out after --dist-timeout-minutes
# with gloo's "Timed out waiting 60000ms for recv operation", which names no one. Every rank beats
# a counter in the same store, from a thread of its own (a rank busy in a collective still beats);
# a rank whose collective timed out reads the counters twice a few beats apart: the ranks whose
# counter stood still are the ones out of reach, and a store that does not answer is out of reach
# with its host (rank 0's, MASTER_ADDR). Counters, not clock times: the hosts' clocks may differ.

def groups_time_out_after(timeout) -> None:
    """Every process group made from now on times out after `timeout`, as the world group does.
    torch gives a group made without a timeout its backend's default (gloo 30 minutes, NCCL 10),
    not init_process_group's, and DeepSpeed makes its own without one: its copy of the world group
    carries the gradient allreduce, so a peer stalled behind a dead link held every rank for half
    an hour whatever --dist-timeout-minutes said. torch reads the default when a group is made."""
    from torch.distributed import distributed_c10d
    distributed_c10d.default_pg_timeout = timeout
    distributed_c10d.default_pg_nccl_timeout = timeout


BEAT_KEY = "commodity_bert/beat/{rank}"
BEAT_S = 2.0
_hosts: list = []  # every rank's host name, by rank
_beating: list = []  # the running heartbeat's stop event


def start_heartbeat(hosts: list[str]) -> None:
    """This rank's counter in the store, advanced every BEAT_S from a daemon thread; `hosts`:
    every rank's host name, gathered at the start, for the line that names the silent ones."""
    import threading
    import torch.distributed as dist
    stop_heartbeat()
    store = _store()
    if store is None or len(hosts) < 2:
        return
    _hosts[:] = hosts
    key, stopped = BEAT_KEY.format(rank=dist.get_rank()), threading.Event()
    _beating.append(stopped)

    def beat():
        while not stopped.is_set():
            with contextlib.suppress(Exception):
                store.add(key, 1)
            stopped.wait(BEAT_S)
    threading.Thread(target=beat, name="commodity_bert-heartbeat", daemon=True).start()


def stop_heartbeat() -> None:
    """Before the process group goes (a finished run; main() run again in one process)."""
    while _beating:
        _beating.pop().set()
    _hosts.clear()


def silent_peers(rank: int) -> str | None:
    """Who stopped answering, said as part of a line: the ranks whose beat stood still over
    3 beats, by host, or rank 0's host when the store it serves does not answer; None when every
    rank still beats (a peer behind or hung in its main thread) or there was no heartbeat."""
    import time
    global _store_gone
    store, world = _store(), len(_hosts)
    if store is None or world < 2:
        return None
    beats = lambda: [store.add(BEAT_KEY.format(rank=r), 0) for r in range(world)]  # noqa: E731
    before = _within(STORE_WAIT_S, beats)
    if before is None:
        _store_gone = True
        address = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        return (f"no word from {_hosts[0]} (rank 0's host; the run's store at {address} does not answer): a link "
                f"to it, or the host, is down")
    time.sleep(3 * BEAT_S)
    after = _within(STORE_WAIT_S, beats)
    still = [] if after is None else [r for r in range(world) if r != rank and after[r] == before[r]]
    if not still:
        return None
    by_host: dict[str, list[int]] = {}
    for other in still:
        by_host.setdefault(_hosts[other], []).append(other)
    named = "; ".join(f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} on {host}"
                      for host, ranks in by_host.items())
    return f"no word from {named}: a link to {'it' if len(by_host) == 1 else 'them'}, or the host, is down"
