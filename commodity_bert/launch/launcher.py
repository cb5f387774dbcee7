"""bert-launch: DeepSpeed's launcher, with a stop signal that reaches the ranks.

    bert-launch [--stop_grace SECONDS] [deepspeed's options] train.py [train.py's options]
    bert-launch [--stop_grace SECONDS] --torchrun [torchrun's options] train.py [train.py's options]

Preemption warnings (a cloud's SIGTERM, Slurm's `--signal=USR1@...`) reach the process you
started, and DeepSpeed's launcher does not pass the stop on to the ranks. For a local launch
its runner (the `deepspeed` command) has no handler: SIGTERM or SIGUSR1 kills it at once
(status 143 / 138) while launch.py and the ranks train on as orphans, nothing saved.
launch.py, signalled itself, SIGTERMs the ranks and SIGKILLs them 30 s later; SIGUSR1 kills it.

bert-launch takes exactly `deepspeed`'s arguments, runs DeepSpeed's runner as its child, and
on SIGTERM, SIGUSR1, SIGINT or SIGHUP asks the ranks to stop the way train.py understands:
SIGUSR1 to the rank processes. They finish the step, agree to stop (one signalled rank is
enough), save a checkpoint, export and exit 0. How the ranks are reached:

  one node, or --no_ssh per node     SIGUSR1 to each rank: the children of DeepSpeed's launch.py
                                     (not launch.py itself, whose command line also holds
                                     train.py), found among bert-launch's descendants
  pdsh (a hostfile of several hosts) `pdsh -w HOSTS pkill -USR1 -f '^PYTHON -u train.py ...'`,
                                     as DeepSpeed's runner does for its own kill command
  --launcher openmpi                 SIGUSR1 to mpirun, which passes it on to every rank (the
                                     other MPI launchers, srun included, alike; untested)
  --torchrun (one per node)          SIGUSR1 to each rank, the children of torchrun's agent. torchrun
                                     signalled itself passes SIGTERM to the ranks, which save and
                                     exit 0, and then exits 1 with a SignalException; left alone,
                                     it sees its ranks succeed and exits 0

A second signal, or ranks still running `--stop_grace` seconds (default 300) after the first,
ends the run DeepSpeed's way: SIGTERM to the runner and everything it started (launch.py then
SIGKILLs the ranks after 30 s); whatever is left KILL_AFTER_S later gets SIGKILL. The exit
status is 0 only when the runner and every rank whose status bert-launch learns exited 0.

Why the details:
- The runner gets its own session: a terminal's Ctrl-C (SIGINT to the foreground process
  group) reaches bert-launch alone, not launch.py, which would SIGTERM the ranks and kill them
  30 s later, nor the ranks, which would die of KeyboardInterrupt.
- The runner starts with SIGUSR1 ignored, and launch.py and the ranks inherit that (an ignored
  signal stays ignored across exec). Under Slurm, which signals every process of a job step,
  launch.py then survives USR1, and a rank that has not yet installed train.py's handler is not
  killed by it. bert-launch itself sends a local rank SIGUSR1 once /proc/PID/status shows the
  rank catches it.
  Ranks that pdsh or mpirun start on other hosts do not inherit it: a stop that comes while
  they are still starting kills them (nothing to save yet; the exit status says so).
- bert-launch is a child subreaper (Linux): if the runner or launch.py dies, the ranks become
  its children, so it still waits for them and learns their exit status.
- A stop signal before the runner has started launches nothing (exit 0). SIGINT and SIGHUP that
  were ignored when bert-launch started (a background job, nohup) stay ignored.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import io
import logging
import math
import os
import re
import runpy
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil

from commodity_bert.host import speaker
from commodity_bert.launcher_env import WORLD_INFO_ENV
from commodity_bert.train.failures import DIST_TIMEOUT_MINUTES

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP)
DEFAULT_STOP_GRACE_S = 300.0  # a step, a checkpoint and the export of BERT-large, with room to spare
KILL_AFTER_S = 60.0           # after the SIGTERM escalation, SIGKILL what is left
PDSH_RETRY_S = 10.0           # ask again while some host had no rank to signal (still starting)
POLL_S = 0.25
SSH_CHECK_S = 10              # ssh's ConnectTimeout for the hosts' check before the launch
PR_SET_CHILD_SUBREAPER = 36

# deepspeed's options that take no value (DeepSpeed 0.19's runner.parse_args): every other
# option before the script takes one, which is how the script is told from an option's value
DEEPSPEED_FLAGS = {"--module", "--no_python", "--no_local_rank", "--no_ssh", "--no_ssh_check", "--force_multi",
                   "--save_pid", "--bind_cores_to_rank", "-q", "--quiet", "-h", "--help"}

# The runner's process: SIGUSR1 ignored from its first line (inherited by launch.py, mpirun, pdsh
# and the ranks), then DeepSpeed's runner as `python -m deepspeed.launcher.runner` would run it.
# any exception of the runner's own (a host --include names that the hostfile lacks, an --exclude
# that leaves no host, its ssh check) ends it in one line with RUNNER_FAILED, not a traceback
RUNNER_FAILED = 70  # EX_SOFTWARE: the runner said why in its line; no second line for its status
RUNNER_STOPPED = "bert-launch: error: DeepSpeed's runner stopped: {kind}: {said}"
RUNNER = ("import runpy, signal, sys\n"
          "signal.signal(signal.SIGUSR1, signal.SIG_IGN)\n"
          "try:\n"
          "    runpy.run_module('deepspeed.launcher.runner', run_name='__main__', alter_sys=True)\n"
          "except Exception as exc:\n"
          "    said = (str(exc).strip().splitlines() or [''])[0]\n"
          f"    print({RUNNER_STOPPED!r}.format(kind=type(exc).__name__, said=said), file=sys.stderr)\n"
          f"    sys.exit({RUNNER_FAILED})\n")


class ForkedRunner:
    """DeepSpeed's runner in a fork of bert-launch, which has imported DeepSpeed already to parse
    its arguments: RUNNER in a new interpreter imports it again, 2.0 CPU-s and 1.7 s a launch
    before the runner starts launch.py (benchmarks/launch_cost.py). The child is what RUNNER makes: its own
    session, SIGUSR1 ignored, the other signals as a new interpreter has them, unbuffered output,
    the runner as `python -m deepspeed.launcher.runner` runs it, and one line for its failure;
    this host's launch.py, which the runner starts, is a fork of it too (LaunchPyInAFork).
    `pid` and `returncode` as a Popen's (Job.reap collects the status)."""

    def __init__(self, ds_argv: list[str], env: dict):
        self.returncode: int | None = None
        self.pid = fork_flushed()
        if self.pid == 0:
            self._run(ds_argv, env)

    @staticmethod
    def _run(ds_argv: list[str], env: dict) -> None:
        status = RUNNER_FAILED
        try:
            os.setsid()
            for sig in STOP_SIGNALS:  # bert-launch's handlers; one ignored on arrival stays so
                if signal.getsignal(sig) != signal.SIG_IGN:
                    signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
            signal.signal(signal.SIGUSR1, signal.SIG_IGN)
            os.environ.clear()
            os.environ.update(env)
            for stream in (sys.stdout, sys.stderr):
                stream.reconfigure(line_buffering=True, write_through=True)  # as `python -u` writes
            # DeepSpeed's logger was made while its import was kept quiet (deepspeed_runner): it
            # writes to this process's stdout again, as in a runner of its own
            for handler in logging.getLogger("DeepSpeed").handlers:
                if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
                    handler.stream = sys.stdout
            subprocess.Popen = LaunchPyInAFork  # this process runs the runner and nothing else
            status = run_as_main("deepspeed.launcher.runner", ds_argv)
        except BaseException as exc:  # noqa: BLE001 - the child ends here whatever happens
            said = (str(exc).strip().splitlines() or [""])[0]
            print(RUNNER_STOPPED.format(kind=type(exc).__name__, said=said), file=sys.stderr)
        finally:
            end_child(status)


def fork_flushed() -> int:
    """os.fork() with nothing buffered: what bert-launch had written is not written twice."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    return os.fork()


def end_child(status: int) -> None:
    """A forked child's end: its output flushed, then os._exit, not bert-launch's exit handlers."""
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(status)


def run_as_main(module: str, argv: list[str]) -> int:
    """`module` run as `python -m module ARGV` runs it, in this process: its exit status (a
    SystemExit's message printed, as the interpreter prints it). Its other exceptions go up."""
    sys.argv = [module, *argv]
    sys.modules.pop(module, None)  # run as __main__, not found imported
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exit_:
        if isinstance(exit_.code, str):
            print(exit_.code, file=sys.stderr)
        return exit_.code if isinstance(exit_.code, int) else int(exit_.code is not None)
    return 0


LAUNCH_PY = [sys.executable, "-u", "-m", "deepspeed.launcher.launch"]


class LaunchPyInAFork(subprocess.Popen):
    """subprocess.Popen in the forked runner's process. The command DeepSpeed's runner builds to
    start this host's launch.py (`python -u -m deepspeed.launcher.launch ...`, env=) runs in a
    fork of the runner, which has DeepSpeed imported, where a new interpreter would import it
    again: 2.0 CPU-s and 1.7 s a launch (benchmarks/launch_cost.py). Every other command
    (pdsh, mpirun) is Popen's. The runner offers no other way to say how it starts launch.py."""

    def __new__(cls, args, *rest, **kwargs):
        if isinstance(args, list) and args[:len(LAUNCH_PY)] == LAUNCH_PY and not rest and set(kwargs) <= {"env"}:
            return ForkedLaunchPy(args[len(LAUNCH_PY):], kwargs.get("env"))
        return super().__new__(cls)


class ForkedLaunchPy:
    """launch.py in a fork, with what Popen(cmd, env=env) gives it in a new interpreter: that
    environment (and its --world_info in WORLD_INFO_ENV), the runner's session and signals (SIGUSR1
    ignored), unbuffered output, a traceback and status 1 for an exception. Of a Popen, what
    DeepSpeed's runner uses: `pid`, `returncode`, `poll`, `wait` and `send_signal`. bert-launch
    tells it by its command line, which is bert-launch's own (Job.discover)."""

    def __init__(self, argv: list[str], env: dict | None):
        self.returncode: int | None = None
        self.pid = fork_flushed()
        if self.pid == 0:
            status = 1
            try:
                if env is not None:
                    os.environ.clear()
                    os.environ.update(env)
                for arg in argv:  # what a rank reads from launch.py's command line, which here is ours
                    if arg.startswith("--world_info="):
                        os.environ[WORLD_INFO_ENV] = arg.split("=", 1)[1]
                status = run_as_main("deepspeed.launcher.launch", argv)
            except BaseException:  # noqa: BLE001 - as the interpreter ends on an uncaught exception
                traceback.print_exc()
            finally:
                end_child(status)

    def _collect(self, options: int) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, options)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def poll(self) -> int | None:
        return self._collect(os.WNOHANG)

    def wait(self, timeout: float | None = None) -> int:
        if timeout is not None:
            raise ValueError("ForkedLaunchPy.wait takes no timeout (DeepSpeed's runner gives none)")
        return self._collect(0)

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)


# torchrun's agent alike (`bert-launch --torchrun`), as the `torchrun` command runs it
TORCHRUN = ("import runpy, signal; signal.signal(signal.SIGUSR1, signal.SIG_IGN); "
            "runpy.run_module('torch.distributed.run', run_name='__main__', alter_sys=True)")


class UsageError(Exception):
    pass


say = speaker("bert-launch", "stderr")


# ---- arguments


def split_argv(argv: list[str]) -> tuple[float, list[str]]:
    """bert-launch's own --stop_grace out of the options before the script; the rest is deepspeed's."""
    grace, rest, i = DEFAULT_STOP_GRACE_S, [], 0
    while i < len(argv):
        arg = argv[i]
        name = arg.split("=", 1)[0]
        if name == "--stop_grace":
            if "=" in arg:
                value, i = arg.split("=", 1)[1], i + 1
            elif i + 1 < len(argv):
                value, i = argv[i + 1], i + 2
            else:
                raise UsageError("--stop_grace needs a number of seconds")
            try:
                grace = float(value)
            except ValueError:
                grace = -1.0
            if not grace > 0:
                raise UsageError(f"--stop_grace {value!r}: give a positive number of seconds")
            continue
        if not arg.startswith("-") or arg == "-":
            return grace, rest + argv[i:]  # the script and its arguments
        rest.append(arg)
        i += 1
        attached = "=" in arg or (not arg.startswith("--") and len(arg) > 2)  # --opt=v, -Hfile
        if name not in DEEPSPEED_FLAGS and not attached and i < len(argv):
            rest.append(argv[i])
            i += 1
    return grace, rest  # no script: deepspeed's parser says what is wrong


def deepspeed_runner():
    """DeepSpeed's runner module, imported quietly: importing deepspeed names the accelerator,
    and the runner we start says it again."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        from deepspeed.launcher import runner
    return runner


def parse_deepspeed_args(argv: list[str]):
    """deepspeed's own parser, its complaint turned into one line."""
    ds_runner = deepspeed_runner()
    if "-h" in argv or "--help" in argv:
        print(__doc__.split("\n\n")[1].strip() + "\n\n  --stop_grace SECONDS  how long the ranks get to save and "
              f"exit after a stop signal (default {DEFAULT_STOP_GRACE_S:.0f})\n\ndeepspeed's options:")
        ds_runner.parse_args(["--help"])  # prints and exits 0
    return parsed_or_one_line(ds_runner.parse_args, argv, "user_script",
                              "bert-launch [deepspeed's options] train.py [train.py's options]")


def parse_torchrun_args(argv: list[str]):
    """torchrun's own parser, its complaint turned into one line; the script as `user_script`."""
    from torch.distributed.run import get_args_parser
    args = parsed_or_one_line(get_args_parser().parse_args, argv, "training_script",
                              "bert-launch --torchrun [torchrun's options] train.py [train.py's options]")
    args.user_script = args.training_script
    return args


def parsed_or_one_line(parse, argv: list[str], script: str, usage: str):
    """`parse(argv)`, or its argparse complaint as a UsageError of one line (`usage` where the
    missing argument is the script, named `script` by that parser)."""
    complaint = io.StringIO()
    try:
        with contextlib.redirect_stderr(complaint):
            return parse(argv)
    except SystemExit:
        lines = complaint.getvalue().strip().splitlines() or ["error: bad arguments"]
        message = lines[-1].split("error: ", 1)[-1]
        if script in message:
            message = f"no training script given: {usage}"
        raise UsageError(message) from None


def split_torchrun(argv: list[str]) -> tuple[float, list[str]] | None:
    """(--stop_grace, torchrun's arguments) where bert-launch's `--torchrun` comes before the
    script (only --stop_grace may precede it); None for a DeepSpeed launch."""
    if "--torchrun" not in argv:
        return None
    at = argv.index("--torchrun")
    grace, rest = split_argv(argv[:at])
    if rest:
        raise UsageError(f"{' '.join(rest)} before --torchrun: give --torchrun first, then torchrun's options")
    return grace, argv[at + 1:]


def check_hostfile(args) -> None:
    """The hostfile as DeepSpeed's runner will read it (`HOST slots=N` a line, # comments), each
    problem in one line before anything starts: its runner logs the whole file and a traceback,
    and takes `slots=0` for a host with nothing to run."""
    if not os.path.isfile(args.hostfile):
        return
    hosts: dict[str, int] = {}
    try:
        lines = Path(args.hostfile).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"--hostfile {args.hostfile}: cannot read it ({exc})") from None
    for number, raw in enumerate(lines, 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = re.fullmatch(r"(\S+)\s+slots=(\d+)", line)
        where = f"--hostfile {args.hostfile} line {number} ({line!r})"
        if match is None:
            raise UsageError(f"{where}: give HOST slots=N, N the ranks (GPUs) to start on that host")
        if int(match.group(2)) < 1:
            raise UsageError(f"{where}: slots must be 1 or more; leave a host with nothing to run out")
        if match.group(1) in hosts:
            raise UsageError(f"{where}: {match.group(1)} is listed twice; list each host once")
        hosts[match.group(1)] = int(match.group(2))
    if not hosts:
        raise UsageError(f"--hostfile {args.hostfile} names no host; write one line a host: HOST slots=N")
    if args.no_ssh and not 0 <= args.node_rank < len(hosts):
        raise UsageError(f"--node_rank {args.node_rank}: give 0 to {len(hosts) - 1}, this host's line in "
                         f"--hostfile {args.hostfile} ({len(hosts)} host(s))")


def remote_hosts(args) -> list[str]:
    """The hosts DeepSpeed's pdsh launcher will ssh into, chosen as its runner chooses them;
    empty when the ranks are local (no hostfile, one host, --no_ssh) or MPI starts them."""
    ds_runner = deepspeed_runner()
    if args.no_ssh or not os.path.isfile(args.hostfile):
        return []
    try:
        pool = ds_runner.fetch_hostfile(args.hostfile)
        active = ds_runner.parse_inclusion_exclusion(pool, args.include, args.exclude)
        active = ds_runner.apply_num_nodes_and_gpus(active, args.num_nodes, args.num_gpus)
    except Exception:  # noqa: BLE001 - the runner reports a bad hostfile or filter itself
        return []
    return list(active) if args.force_multi or len(active) > 1 else []


def ssh_problem(args, host: str) -> str | None:
    """Why the launch cannot ssh into `host` (non-interactively, as pdsh and mpirun do, at the
    launch's --ssh_port; the name as ssh resolves it, ~/.ssh/config included), or None."""
    port = ["-p", str(args.ssh_port)] if args.ssh_port is not None else []
    try:
        proc = subprocess.run(["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={SSH_CHECK_S}", *port, host, "true"],
                              stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=SSH_CHECK_S + 5)
    except subprocess.TimeoutExpired:
        said = f"no answer in {SSH_CHECK_S + 5} s"
    except FileNotFoundError:
        return "no ssh client on this host; install openssh-client, or start each node itself with --no_ssh"
    else:
        if proc.returncode == 0:
            return None
        lines = [line.strip() for line in proc.stderr.splitlines() if line.strip() and not line.startswith("Warning:")]
        said = lines[-1] if lines else f"exit status {proc.returncode}"
    if "Could not resolve hostname" in said:
        return (f"host {host} does not resolve ({said}); correct its name in the hostfile, or add it to /etc/hosts, "
                f"DNS or ~/.ssh/config")
    return (f"cannot ssh into {host} ({said}); the launch starts the ranks over ssh: `ssh {host} true` must work "
            f"without a password from here, or start each node itself with --no_ssh")


SSH_ALIVE_S = 15  # ssh's ServerAliveInterval on the pdsh launch's sessions
SSH_LOST = 255    # ssh's status when the connection fails, pdsh's and so the runner's after it


def ssh_keepalive_env(args) -> dict[str, str]:
    """ssh options for pdsh's sessions to the hosts: without them, ssh waits on a dead link for
    ever (no TCP keepalive on an idle session), so the launch, and the job's allocation, outlive
    ranks that ended when their collective timed out. ssh gives up one interval after the ranks'
    --dist-timeout-minutes, so a flap the ranks ride out does not end the session under them.
    Options the user set in PDSH_SSH_ARGS_APPEND or ~/.ssh/config's are not overridden."""
    extra = os.environ.get("PDSH_SSH_ARGS_APPEND", "")
    if "ServerAlive" in extra:
        return {}
    timeout = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    timeout.add_argument("--dist-timeout-minutes", type=float, default=DIST_TIMEOUT_MINUTES)
    try:  # train.py's flag, read as its parser reads it; train.py refuses a bad value itself
        minutes = timeout.parse_known_args(args.user_args)[0].dist_timeout_minutes
    except SystemExit:
        minutes = DIST_TIMEOUT_MINUTES
    count = math.ceil(minutes * 60 / SSH_ALIVE_S) + 1
    return {"PDSH_SSH_ARGS_APPEND": f"{extra} -o ServerAliveInterval={SSH_ALIVE_S} -o ServerAliveCountMax={count}".strip()}


def check_hosts_reachable(args) -> None:
    """Before the runner starts: every host the launch ssh-es into answers ssh (checked side by
    side; the first in the hostfile's order that does not is named in one line), and a per-node
    launch's --master_addr resolves. DeepSpeed's runner checks the first host alone, in two
    tracebacks, and a later host fails inside pdsh after the others started."""
    if args.no_ssh and args.master_addr:
        try:
            socket.getaddrinfo(args.master_addr, None)
        except (socket.gaierror, UnicodeError) as exc:
            raise UsageError(f"--master_addr {args.master_addr} does not resolve ({getattr(exc, 'strerror', exc)}); "
                             f"give node rank 0's address or a name in /etc/hosts or DNS") from None
    hosts = [] if args.no_ssh_check else remote_hosts(args)
    if not hosts:
        return
    with ThreadPoolExecutor(min(16, len(hosts))) as pool:
        problems = list(pool.map(lambda host: ssh_problem(args, host), hosts))
    if problem := next((p for p in problems if p), None):
        raise UsageError(f"--hostfile {args.hostfile}: {problem}")


def ere_escape(text: str) -> str:
    """`text` as a POSIX extended regular expression matching itself (for pkill -f)."""
    out = []
    for c in text:
        if c.isalnum() or c in " _/=:,@%~-":
            out.append(c)
        elif c in "\\^":
            out.append("\\" + c)
        else:
            out.append(f"[{c}]")  # [.] [*] [(] [$] ... and [[] []]
    return "".join(out)


def rank_pattern(args, max_chars: int = 2000) -> str:
    """pkill -f pattern for the rank command lines launch.py builds, `PYTHON -u train.py
    --local_rank=N ARGS`, and for nothing else: not launch.py (`PYTHON -u -m
    deepspeed.launcher.launch ... train.py ARGS`), not the shells pdsh runs around it, and not
    this job's pkill itself. The arguments make it this job's ranks, not another job's."""
    head = [args.user_script] if args.no_python else [sys.executable, "-u", *(["-m"] if args.module else []),
                                                      args.user_script]
    pattern = "^" + ere_escape(" ".join(head)) + ("" if args.no_local_rank else " --local_rank=[0-9]+")
    length = 0
    for arg in args.user_args:
        # stop at what a remote shell would rewrite (pdsh sends the command line through one)
        if length + len(arg) > max_chars or any(not (c.isalnum() or c in "_@%+=:,./-") for c in arg):
            break
        pattern += " " + ere_escape(arg)
        length += len(arg) + 1
    return pattern


# ---- processes


def become_subreaper() -> bool:
    """Orphaned descendants (ranks whose launch.py died) become our children, not init's."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def catches(pid: int, sig: int) -> bool:
    """Whether process `pid` has a handler for `sig` (its SigCgt mask); True where there is no /proc."""
    if not os.path.isdir("/proc/self"):
        return True
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except (OSError, ValueError):
        pass
    return False


def alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def describe(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"exit status {code}"


class Job:
    """DeepSpeed's runner as a child, watched until it and every rank have exited."""

    def __init__(self, args, ds_argv: list[str], grace_s: float, received: list[int], torchrun: bool = False):
        self.grace_s = grace_s
        self.received = received                # stop signals, in order (main's handlers append)
        self.torchrun = torchrun
        self.runner_name = "torchrun" if torchrun else "DeepSpeed's runner"
        hosts = [] if torchrun else remote_hosts(args)
        if hosts and args.launcher.lower() == "pdsh":
            self.route = "pdsh"
            self.pkill = self._pdsh_pkill_command(args, hosts)
        else:
            self.route = "mpi" if hosts else "local"
        self.stop_at: float | None = None       # when the first one came
        self.escalated_at: float | None = None
        self.killed = False
        self.ranks: dict[int, psutil.Process] = {}      # local ranks seen (they may outlive launch.py)
        self.launchers: dict[int, psutil.Process] = {}  # DeepSpeed's launch.py processes seen
        self.exit_codes: dict[int, int] = {}            # of the ranks and launchers reaped here
        self.asked: set[int] = set()                    # pids sent SIGUSR1
        self.pkill_proc: subprocess.Popen | None = None
        self.pkill_at = 0.0
        self.pkill_log = None
        self.pkill_reported = False
        self.children: dict[int, subprocess.Popen] = {}
        self.script = args.user_script
        self.local_rank_flag = not torchrun and not args.no_local_rank  # torchrun tells the rank by its environment
        become_subreaper()
        runner_env = dict(os.environ, **(ssh_keepalive_env(args) if self.route == "pdsh" else {}))
        if torchrun or threading.active_count() > 1:  # a fork with threads could inherit a held lock
            self.runner = self._spawn([sys.executable, "-u", "-c", TORCHRUN if torchrun else RUNNER, *ds_argv],
                                      env=runner_env)
        else:
            self.runner = ForkedRunner(ds_argv, runner_env)
            self.children[self.runner.pid] = self.runner
        self.me = psutil.Process()
        self.my_cmdline = self.me.cmdline()

    def _spawn(self, cmd: list[str], **kwargs) -> subprocess.Popen:
        proc = subprocess.Popen(cmd, start_new_session=True, **kwargs)  # out of reach of the terminal's Ctrl-C
        self.children[proc.pid] = proc
        return proc

    @staticmethod
    def _pdsh_pkill_command(args, hosts: list[str]) -> tuple[list[str], dict]:
        """What DeepSpeed's runner runs to kill a pdsh launch (PDSHRunner.get_cmd's kill_command),
        with SIGUSR1 and a pattern that matches the ranks only."""
        env = dict(os.environ, PDSH_RCMD_TYPE="ssh")
        if args.ssh_port is not None:
            env["PDSH_SSH_ARGS_APPEND"] = f"{env.get('PDSH_SSH_ARGS_APPEND', '')} -p {args.ssh_port}"
        pdsh = ["pdsh", "-S", "-f", "1024", "-w", ",".join(hosts), *shlex.split(args.launcher_args)]
        return pdsh + ["pkill", "-USR1", "-f", shlex.quote(rank_pattern(args))], env

    # -- bookkeeping

    def reap(self) -> None:
        """Collect every exited child: the runner, our pdsh, and ranks or launchers orphaned to us."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            code = os.waitstatus_to_exitcode(status)
            if pid in self.children:
                self.children[pid].returncode = code
            if pid in self.ranks or pid in self.launchers:
                self.exit_codes[pid] = code

    def discover(self) -> None:
        """Remember DeepSpeed's launch.py processes and the ranks they started: their children
        (the ranks' own children, data-loader workers, share the rank's command line), and ranks
        orphaned to us before we saw them, told by the command line launch.py gave them. A
        launch.py in a new interpreter has its own command line; one forked from the runner
        (ForkedLaunchPy) has ours, and is the only descendant besides the runner that has it."""
        try:
            descendants = self.me.children(recursive=True)
        except psutil.Error:
            return
        for proc in descendants:
            with contextlib.suppress(psutil.Error):
                if proc.pid in self.launchers or proc.pid in self.ranks or proc.pid in self.children:
                    continue
                cmdline = proc.cmdline()
                if "deepspeed.launcher.launch" in cmdline or cmdline == self.my_cmdline:
                    self.launchers[proc.pid] = proc
                elif proc.ppid() == self.me.pid and self.script in cmdline and \
                        (not self.local_rank_flag or any(a.startswith("--local_rank=") for a in cmdline)):
                    self.ranks[proc.pid] = proc
        for launcher in list(self.launchers.values()):
            with contextlib.suppress(psutil.Error):
                for rank in launcher.children():
                    self.ranks.setdefault(rank.pid, rank)
        if self.torchrun:  # the agent's children that run the script are the ranks
            with contextlib.suppress(psutil.Error):
                for rank in psutil.Process(self.runner.pid).children():
                    if self.script in rank.cmdline():
                        self.ranks.setdefault(rank.pid, rank)

    def running(self) -> list[psutil.Process]:
        return [p for pid, p in {**self.launchers, **self.ranks}.items()
                if pid not in self.exit_codes and alive(p)]

    # -- stopping

    def on_signals(self) -> None:
        while self.received:
            name = signal.Signals(self.received.pop(0)).name
            if self.stop_at is None:
                self.stop_at = time.time()
                say(f"{name}: asking the ranks to stop (SIGUSR1 {self._route_words()}); they have "
                    f"{self.grace_s:.0f} s (--stop_grace) to save; a second signal ends them now")
            elif self.escalated_at is None:
                self.escalate(f"{name} again")
            else:
                self.kill(f"{name} again")

    def _route_words(self) -> str:
        return {"local": "to each rank", "pdsh": "through pdsh and pkill on every host",
                "mpi": "to the MPI launcher, which passes it to every rank"}[self.route]

    def ask_ranks_to_stop(self) -> None:
        if self.route == "local":
            for pid, rank in self.ranks.items():
                # a rank still starting ignores SIGUSR1 (inherited); ask once train.py catches it
                if pid not in self.asked and pid not in self.exit_codes and alive(rank) \
                        and catches(pid, signal.SIGUSR1):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGUSR1)
                        self.asked.add(pid)
        elif self.route == "mpi":
            with contextlib.suppress(psutil.Error):
                for launcher in psutil.Process(self.runner.pid).children():  # mpirun and the like
                    if launcher.pid not in self.asked:
                        launcher.send_signal(signal.SIGUSR1)
                        self.asked.add(launcher.pid)
        else:
            self._ask_through_pdsh()

    def _ask_through_pdsh(self) -> None:
        """pdsh runs pkill on every host; again every PDSH_RETRY_S while some host had no rank to
        signal (pkill's status 1: not started yet, or already gone)."""
        proc = self.pkill_proc
        if proc is not None and proc.returncode not in (None, 0, 1) and not self.pkill_reported:
            self.pkill_reported = True  # ssh failed, say, on some host: show pdsh's words once
            self.pkill_log.seek(0)
            say(f"pdsh pkill: {describe(proc.returncode)}: {' / '.join(self.pkill_log.read().splitlines())}")
        if self.runner.returncode is not None:
            return
        if proc is None or (proc.returncode not in (None, 0) and time.time() - self.pkill_at >= PDSH_RETRY_S):
            cmd, env = self.pkill
            # kept, not printed: pdsh's "ssh exited with exit code 1" for a host without ranks is no news
            self.pkill_log = tempfile.TemporaryFile("w+")  # noqa: SIM115 - read when pdsh has finished
            self.pkill_proc = self._spawn(cmd, env=env, stdout=self.pkill_log, stderr=subprocess.STDOUT)
            self.pkill_at, self.pkill_reported = time.time(), False

    def escalate(self, why: str) -> None:
        """DeepSpeed's own stop: SIGTERM to the runner and everything in its process group."""
        self.escalated_at = time.time()
        say(f"{why}: SIGTERM to {self.runner_name} and the ranks")
        self._signal_all(signal.SIGTERM)

    def kill(self, why: str) -> None:
        self.killed = True
        say(f"{why}: SIGKILL to {self.runner_name} and the ranks")
        self._signal_all(signal.SIGKILL)

    def _signal_all(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.runner.pid, sig)  # the runner's session: launch.py, pdsh, ranks, workers
        for proc in self.running():
            with contextlib.suppress(psutil.Error):
                proc.send_signal(sig)

    # -- the loop

    def wait(self) -> int:
        while True:
            self.reap()
            self.discover()
            self.on_signals()
            now = time.time()
            if self.stop_at is not None and self.escalated_at is None:
                if now - self.stop_at > self.grace_s:
                    self.escalate(f"ranks still running {self.grace_s:.0f} s after the stop signal")
                else:
                    self.ask_ranks_to_stop()
            if self.escalated_at is not None and not self.killed and now - self.escalated_at > KILL_AFTER_S:
                self.kill(f"still running {KILL_AFTER_S:.0f} s after SIGTERM")
            if self.runner.returncode is not None and not self.running():
                break
            time.sleep(POLL_S)
        self.reap()
        return self.verdict()

    def verdict(self) -> int:
        said = self.runner.returncode in (0, None) or (not self.torchrun and self.runner.returncode == RUNNER_FAILED)
        failures = [] if said else [f"{self.runner_name}: {describe(self.runner.returncode)}"]
        if failures and self.route == "pdsh" and self.runner.returncode == SSH_LOST:
            failures[0] += " (ssh's own: a host, or the link to it, stopped answering; pdsh's line above names it)"
        failures += [f"{'rank' if pid in self.ranks else 'launch.py'} {pid}: {describe(code)}"
                     for pid, code in sorted(self.exit_codes.items()) if code != 0]
        if self.stop_at is not None:
            say(f"ranks stopped {'cleanly' if not failures else 'with errors'} "
                f"{time.time() - self.stop_at:.0f} s after the stop signal")
        if not failures:
            return self.runner.returncode or 0  # 0, or RUNNER_FAILED, said in the runner's line
        say("; ".join(failures))
        code = self.runner.returncode or next((c for c in self.exit_codes.values() if c != 0), 1)
        return 128 - code if code < 0 else code


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    received: list[int] = []  # first thing: a stop signal while deepspeed imports must not kill us
    for sig in STOP_SIGNALS:
        # SIGINT / SIGHUP ignored on arrival (a background job, nohup) stay ignored
        if sig in (signal.SIGINT, signal.SIGHUP) and signal.getsignal(sig) == signal.SIG_IGN:
            continue
        signal.signal(sig, lambda signum, frame: received.append(signum))
    try:
        torchrun = split_torchrun(argv)
        if torchrun is not None:
            grace_s, ds_argv = torchrun
            args = parse_torchrun_args(ds_argv)
        else:
            grace_s, ds_argv = split_argv(argv)
            args = parse_deepspeed_args(ds_argv)
            check_hostfile(args)
            check_hosts_reachable(args)
    except UsageError as error:
        print(f"bert-launch: error: {error}", file=sys.stderr)
        return 2
    if received:
        say(f"{signal.Signals(received[0]).name} before anything started: not launching")
        return 0
    return Job(args, ds_argv, grace_s, received, torchrun=torchrun is not None).wait()


if __name__ == "__main__":
    sys.exit(main())
