"""bert-launch: a stop signal sent to the launcher alone ends in a checkpoint and exit status 0.

Plain `deepspeed` fails every test here: SIGTERM or SIGUSR1 kill it at once (143 / 138) while the
ranks train on, Ctrl-C kills the ranks with KeyboardInterrupt, and a killed launch.py leaves it
exiting 0 with the ranks orphaned. Two training launches (train.py on 2 CPU ranks); the rest runs
stand-in ranks (STUB, below) that answer signals as train.py does, in seconds.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import REPO, free_port, launch_cmd

sys.path.insert(0, str(REPO))
from commodity_bert.launch.launcher import parse_deepspeed_args, rank_pattern, remote_hosts, ssh_keepalive_env

BERT_LAUNCH = str(Path(sys.executable).parent / "bert-launch")
COMMON = ["--deepspeed_config", REPO / "ds_configs" / "cpu_tiny_lamb.json", "--model", "tiny", "--log-every", 5,
          "--num-workers", 1]

# A rank that answers as train.py does: SIGUSR1 or SIGTERM ask it to stop (handlers installed
# after --start-s, as train.py installs them after building the engine), then it exits 0, or 3
# for --fail-rank. With --ignore-stop it takes SIGUSR1 and carries on, and SIGTERM kills it.
# DIR/rankN says what happened.
STUB = r'''
import os, signal, sys, time
from pathlib import Path
args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
rank = os.environ.get("RANK") or os.environ.get("OMPI_COMM_WORLD_RANK")
out = Path(args[0]) / f"rank{rank}"
opts = dict(zip(args[1::2], args[2::2]))
out.write_text("starting\n")
time.sleep(float(opts.get("--start-s", 0)))
got = []
for sig in (signal.SIGUSR1,) if opts.get("--ignore-stop") else (signal.SIGTERM, signal.SIGUSR1):
    signal.signal(sig, lambda signum, frame: got.append(signum))
out.write_text(f"ready on {os.uname().nodename}\n")
deadline = time.time() + 60
while time.time() < deadline and (not got or opts.get("--ignore-stop")):
    time.sleep(0.05)
out.write_text(f"stopped by {signal.Signals(got[0]).name} on {os.uname().nodename}\n" if got else "timed out\n")
for sig in (signal.SIGTERM, signal.SIGUSR1):  # done, as train.py is: a late duplicate changes nothing
    signal.signal(sig, signal.SIG_IGN)
sys.exit(3 if not got or opts.get("--fail-rank") == rank else 0)
'''


@pytest.fixture(scope="module")
def stub(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("stub") / "stub_rank.py"
    path.write_text(STUB)
    return path


def start(*args, env=None, **kwargs) -> subprocess.Popen:
    # its own process group, as a shell gives a job: the Ctrl-C test signals that group
    return subprocess.Popen([BERT_LAUNCH, *map(str, args)], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True, **kwargs)


def wait_for(condition, launcher: subprocess.Popen, timeout=300) -> None:
    deadline = time.time() + timeout
    while not condition():
        assert launcher.poll() is None, launcher.communicate()[0][-4000:]
        assert time.time() < deadline, "timed out"
        time.sleep(0.2)


def states(directory: Path) -> dict[str, str]:
    return {p.name: p.read_text().strip() for p in sorted(directory.glob("rank*"))}


def finish(launcher: subprocess.Popen, timeout=240) -> str:
    try:
        return launcher.communicate(timeout=timeout)[0]
    finally:
        if launcher.poll() is None:  # a failed test leaves nothing behind
            for proc in psutil.Process(launcher.pid).children(recursive=True):
                proc.kill()
            launcher.kill()


# ---- train.py


def last_step(run: Path) -> int:
    with_rows = (run / "metrics.jsonl").exists() and (run / "metrics.jsonl").read_text().strip()
    return json.loads(with_rows.splitlines()[-1])["step"] if with_rows else 0


def rank_processes(launcher: subprocess.Popen) -> list[psutil.Process]:
    """The train.py ranks under `launcher`, not their data-loader workers (children of the ranks,
    with the same command line)."""
    ranks = []
    for child in psutil.Process(launcher.pid).children(recursive=True):
        try:
            cmdline = child.cmdline()
        except psutil.NoSuchProcess:
            continue
        if any(c.endswith("train.py") for c in cmdline) and "--local_rank" in " ".join(cmdline):
            ranks.append(child)
    return [r for r in ranks if not any(p.pid in {q.pid for q in ranks} for p in r.parents())]


def stopped_and_saved(launcher: subprocess.Popen, run: Path, before: int) -> tuple[str, int]:
    output = finish(launcher)
    assert launcher.returncode == 0, output[-4000:]
    assert "stopping at step" in output
    step = int((run / "checkpoints" / "latest").read_text().removeprefix("step_"))
    assert step > before and step >= 5
    assert (run / "hf_model" / "config.json").is_file()
    return output, step


def stop_training(launcher_args: list, run: Path, data: Path, sig: signal.Signals,
                  port_flag: str = "--master_port") -> tuple[str, int]:
    """Launch train.py with bert-launch, send `sig` to bert-launch alone once a new step is logged."""
    before = last_step(run)
    launcher = start(*launcher_args, port_flag, free_port(), "train.py", *COMMON, "--data", data,
                     "--output-dir", run, "--max-steps", 100000)
    wait_for(lambda: last_step(run) > before, launcher)
    os.kill(launcher.pid, sig)
    return stopped_and_saved(launcher, run, before)


def test_a_stop_signal_saves_exits_zero_and_the_relaunch_continues(tmp_path, train_data):
    """One run through four launches, each stopped by a signal once it has logged a step: to
    bert-launch alone (SIGTERM); to bert-launch in the per-node form of the Slurm srun recipe
    (Slurm's USR1); to the ranks themselves under DeepSpeed's own per-node launcher (SIGTERM, as a
    scheduler sends it to every process); to `bert-launch --torchrun` alone (SIGTERM)."""
    run = tmp_path / "run"
    output, first = stop_training(["--num_gpus", 2], run, train_data, signal.SIGTERM)
    # DeepSpeed's runner, in a fork of bert-launch, still says what it starts
    assert "[runner.py" in output and "cmd = " in output and "deepspeed.launcher.launch" in output, output[-3000:]
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    per_node = ["--hostfile", hostfile, "--no_ssh", "--node_rank", 0, "--master_addr", "127.0.0.1"]
    output, second = stop_training(per_node, run, train_data, signal.SIGUSR1)
    assert second > first and f"stopping at step {second}" in output

    command = launch_cmd(2, *COMMON, "--data", train_data, "--output-dir", run, "--max-steps", 100000)
    launcher = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_for(lambda: last_step(run) > second and len(rank_processes(launcher)) == 2, launcher)
    for rank in rank_processes(launcher):
        os.kill(rank.pid, signal.SIGTERM)
    output, third = stopped_and_saved(launcher, run, second)
    # torchrun under bert-launch (SIGTERM to bert-launch alone): the ranks are asked, torchrun
    # sees them succeed, and the exit status is 0 (torchrun signalled itself exits 1)
    output, fourth = stop_training(["--torchrun", "--nproc-per-node", 2], run, train_data, signal.SIGTERM,
                                   port_flag="--master-port")
    assert "SignalException" not in output
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps)) and {first, second, third} <= set(steps), steps  # each went on from its checkpoint
    assert steps[-1] == fourth and f"stopping at step {fourth}" in output


# ---- stand-in ranks: how bert-launch reaches the ranks and when it gives up


def test_ctrl_c_reaches_ranks_still_starting_as_a_stop(tmp_path, stub):
    """Ctrl-C (SIGINT to the job's process group) while the ranks have no handler yet: they are
    neither interrupted nor killed by it, and stop when they can."""
    # as a terminal's foreground job has it: a suite run in the background (nohup, `&` in a
    # script) starts with SIGINT ignored, which bert-launch rightly keeps ignored
    launcher = start("--num_gpus", 2, "--master_port", free_port(), stub, tmp_path, "--start-s", 3,
                     preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    wait_for(lambda: len(states(tmp_path)) == 2, launcher)
    os.killpg(launcher.pid, signal.SIGINT)
    output = finish(launcher)
    assert launcher.returncode == 0, output[-4000:]
    assert all(s.startswith("stopped by SIGUSR1") for s in states(tmp_path).values()), states(tmp_path)


@pytest.mark.parametrize("escalation", ["grace", "second_signal"])
def test_ranks_that_do_not_stop_are_terminated(tmp_path, stub, escalation):
    grace = ["--stop_grace", 2] if escalation == "grace" else []
    launcher = start(*grace, "--num_gpus", 2, "--master_port", free_port(), stub, tmp_path, "--ignore-stop", 1)
    wait_for(lambda: all(s.startswith("ready") for s in states(tmp_path).values()) and len(states(tmp_path)) == 2,
             launcher)
    started = time.time()
    os.kill(launcher.pid, signal.SIGTERM)
    if escalation == "second_signal":
        time.sleep(1)
        os.kill(launcher.pid, signal.SIGTERM)
    output = finish(launcher)
    assert launcher.returncode != 0
    assert "SIGTERM to DeepSpeed's runner" in output
    assert time.time() - started < 30  # the ranks die of SIGTERM at once; nothing waits for KILL_AFTER_S


def test_ranks_orphaned_by_launch_py_are_still_stopped_and_their_status_counts(tmp_path, stub):
    """launch.py dies (DeepSpeed's runner then exits 0): bert-launch, their subreaper, still
    stops the ranks (seen or not before launch.py died) and reports the one that failed."""
    launcher = start("--num_gpus", 2, "--master_port", free_port(), stub, tmp_path, "--fail-rank", 1)
    wait_for(lambda: all(s.startswith("ready") for s in states(tmp_path).values()) and len(states(tmp_path)) == 2,
             launcher)
    # forked from the runner, itself a fork of bert-launch: the one below the runner with bert-launch's command line
    bert_launch = psutil.Process(launcher.pid)
    [launch_py] = [p for p in bert_launch.children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE
                   and p.cmdline() == bert_launch.cmdline() and p.ppid() != launcher.pid]
    launch_py.kill()
    time.sleep(3)
    assert launcher.poll() is None  # `deepspeed` itself would have exited 0 by now
    os.kill(launcher.pid, signal.SIGTERM)
    output = finish(launcher)
    assert states(tmp_path) == {"rank0": f"stopped by SIGUSR1 on {os.uname().nodename}",
                                "rank1": f"stopped by SIGUSR1 on {os.uname().nodename}"}
    assert launcher.returncode == 3, output[-3000:]
    assert "exit status 3" in output


def test_bad_arguments_get_one_line_and_status_2(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=1\nnode2 slots=1\n")
    per_node = ["--hostfile", str(hostfile), "--no_ssh", "--node_rank", "0", "--master_addr", "node0.invalid"]
    cases = [[], ["--num_gpus", "2"], ["--stop_grace", "soon", "train.py"], ["--num_gpus", "x", "train.py"],
             [*per_node, "train.py"]]
    procs = [subprocess.Popen([BERT_LAUNCH, *args], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for args in cases]
    errors = []
    for args, proc in zip(cases, procs):
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 2 and out == "", (args, out, err)
        assert err.startswith("bert-launch: error: ") and err.count("\n") == 1, err
        errors.append(err)
    assert "--master_addr node0.invalid does not resolve" in errors[-1]


def test_an_error_of_deepspeeds_runner_is_one_line_not_its_traceback(tmp_path):
    """The runner's own exceptions (a host --include names that the hostfile lacks) end it in one
    line and status 70, with no second line for that status."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=1\n")
    proc = subprocess.run([BERT_LAUNCH, "--hostfile", str(hostfile), "--include", "node9", "--no_python", "true"],
                          cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    said = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("bert-launch:")]
    assert proc.returncode == 70, proc.stderr[-2000:]
    assert said == ["bert-launch: error: DeepSpeed's runner stopped: ValueError: Hostname 'node9' not found in "
                    "hostfile"], proc.stderr[-2000:]
    assert "Traceback" not in proc.stdout + proc.stderr


def test_pdsh_stop_command_matches_only_this_jobs_ranks(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node1 slots=2\nnode2 slots=2\nnode3 slots=2\n")
    args = parse_deepspeed_args(["--hostfile", str(hostfile), "--exclude", "node3", "train.py", "--data", "d",
                                 "--output-dir", "runs/a.b"])
    assert remote_hosts(args) == ["node1", "node2"]
    pattern = rank_pattern(args)
    rank = f"{sys.executable} -u train.py --local_rank=1 --data d --output-dir runs/a.b"
    not_ranks = [(f"{sys.executable} -u -m deepspeed.launcher.launch --world_info=e30= --node_rank=0 "
                  "--master_addr=10.0.0.1 --master_port=29500 train.py --data d --output-dir runs/a.b"),
                 f"{sys.executable} -u train.py --local_rank=1 --data d --output-dir runs/a_b",  # another job
                 f"bash -c pkill -USR1 -f '{pattern}'"]
    def matches(line: str) -> bool:  # grep -E: the same POSIX ERE dialect as pkill -f
        return subprocess.run(["grep", "-E", pattern], input=line, capture_output=True, text=True,
                              check=False).returncode == 0

    assert matches(rank)
    for line in not_ranks:
        assert not matches(line), line
    no_ssh = parse_deepspeed_args(["--hostfile", str(hostfile), "--no_ssh", "--node_rank", "0", "train.py"])
    assert remote_hosts(no_ssh) == []  # per node: its own ranks, found locally


def test_pdsh_sessions_give_up_on_a_dead_link_just_after_the_ranks_do(tmp_path, monkeypatch):
    """ssh waits on a silent link for ever: the launch, and the job's allocation, would outlive
    ranks that stopped at their collective timeout. Its keepalive outlasts that timeout by one
    interval, so a flap the ranks ride out does not cut their sessions; the user's own wins."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node1 slots=1\nnode2 slots=1\n")

    def alive(*train_args) -> tuple[int, int]:
        env = ssh_keepalive_env(parse_deepspeed_args(["--hostfile", str(hostfile), "train.py", *train_args]))
        interval, count = (int(env["PDSH_SSH_ARGS_APPEND"].split(f"ServerAlive{key}=")[1].split()[0])
                           for key in ("Interval", "CountMax"))
        return interval, interval * count
    for train_args, minutes in (((), 10), (("--dist-timeout-minutes", "1"), 1), (("--dist-timeout-minutes=0.5",), 0.5)):
        interval, gives_up_after = alive("--data", "d", *train_args)
        assert minutes * 60 < gives_up_after <= minutes * 60 + 2 * interval, (train_args, gives_up_after)
    monkeypatch.setenv("PDSH_SSH_ARGS_APPEND", "-p 2222")
    assert ssh_keepalive_env(parse_deepspeed_args(["--hostfile", str(hostfile), "train.py"]))["PDSH_SSH_ARGS_APPEND"] \
        .startswith("-p 2222 -o ServerAliveInterval=")
    monkeypatch.setenv("PDSH_SSH_ARGS_APPEND", "-o ServerAliveInterval=5")
    assert ssh_keepalive_env(parse_deepspeed_args(["--hostfile", str(hostfile), "train.py"])) == {}


# ---- several hosts (network namespaces, tools/netns_cluster.py): pdsh and Open MPI


def test_a_host_that_does_not_resolve_or_answer_ssh_is_named_before_the_runner(cluster, stub, tmp_path):
    """A typo in the hostfile's second host (DeepSpeed's runner checks the first alone), and ssh
    refused on every host (a wrong --ssh_port): one line naming the host and the fix, status 2,
    no traceback, no rank started."""
    typo = tmp_path / "hostfile"
    typo.write_text(cluster.hostfile.read_text() + "node3x slots=1\n")
    cases = {"host node3x does not resolve": ["--hostfile", str(typo)],
             "cannot ssh into node1 (": ["--hostfile", str(cluster.hostfile), "--ssh_port", "1"]}
    for phrase, flags in cases.items():
        proc = cluster.popen(0, [BERT_LAUNCH, *flags, "--master_port", str(free_port()), str(stub), str(tmp_path)],
                             cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 2 and out == "", (phrase, out, err)
        assert err.startswith("bert-launch: error: --hostfile ") and err.count("\n") == 1 and phrase in err, err
        assert "Traceback" not in err and states(tmp_path) == {}


@pytest.mark.parametrize("launcher", ["pdsh", "openmpi"])
def test_stop_reaches_ranks_on_other_hosts(cluster, stub, tmp_path, launcher):
    if shutil.which(launcher if launcher == "pdsh" else "mpirun") is None:
        pytest.skip(f"needs {launcher} (recipes/install_cluster_tools.sh)")
    extra = ["--launcher", "openmpi", "--launcher_args=--oversubscribe"] if launcher == "openmpi" else []
    proc = cluster.popen(0, [BERT_LAUNCH, "--hostfile", str(cluster.hostfile), *extra, "--master_port",
                             str(free_port()), str(stub), str(tmp_path)],
                         cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_for(lambda: all(s.startswith("ready") for s in states(tmp_path).values()) and len(states(tmp_path)) == 2,
             proc)
    os.kill(proc.pid, signal.SIGTERM)  # the netns/unshare/sh prefix execs: this is bert-launch
    output = finish(proc)
    assert proc.returncode == 0, output[-4000:]
    assert states(tmp_path) == {"rank0": "stopped by SIGUSR1 on node1", "rank1": "stopped by SIGUSR1 on node2"}
