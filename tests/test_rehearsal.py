"""`bert-plan rehearse`: the job's own launch, config, data and output directory for a few steps,
on three namespace hosts of 2, 2 and 1 ranks (tools/netns_cluster.py): the rehearsal passes, and
each fault a cluster meets makes its own line fail, with its fix:
an output directory one host cannot write, a disk too small for the kept checkpoints, a
micro-batch the memory plan says does not fit, an interface that does not reach the other hosts.
Ranks are forked onto the hosts (conftest.ForkedRanks): the launch is the Slurm test's subject
(test_slurm.py rehearses through srun and bert-launch)."""
import ctypes
import json
import os
import re
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
from conftest import COMMON, REPO, ForkedRanks, changed, free_port

CLONE_NEWNS = 0x00020000


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    sys.path.insert(0, str(REPO))
    from tools.netns_cluster import Cluster, unavailable_reason
    if reason := unavailable_reason():
        pytest.skip(f"multi-host tests: {reason}")
    cluster = Cluster.up(tmp_path_factory.mktemp("cluster"), hosts=3, slots=[2, 2, 1])
    try:
        yield cluster
    finally:
        cluster.down()


def job(data, run, *extra) -> list[str]:
    return [*map(str, COMMON), "--data", str(data), "--output-dir", str(run), "--max-steps", "300",
            "--dist-timeout-minutes", "1", *map(str, extra)]


def rehearse(argv: list[str]) -> None:
    """A forked rank's entry: `bert-plan --local_rank=N rehearse` with the job's flags, as the
    launcher starts `--module commodity_bert.plan`."""
    from commodity_bert.plan import cli
    sys.exit(cli.main([argv[0], "rehearse", *argv[1:]]))


def table(out: str) -> dict[str, str]:
    """The rehearsal's lines by check: 'pass', 'FAIL' or '----' and the rest of the line."""
    lines = {}
    for line in out.splitlines():
        words = re.sub(r"^\S+: (?=(pass|FAIL|----) )", "", line).split(None, 1)  # pdsh's "node1: "
        if words and words[0] in ("pass", "FAIL", "----") and len(words) > 1:
            name = next((n for n in NAMES if words[1].startswith(n)), None)
            if name:
                lines[name] = words[0]
    return lines


NAMES = ("allreduce", "memory plan", "output directory", "disk", "loss falling", "checkpoint", "relaunch",
         "export", "speed", "memory")


def forked(hosts, *args, node=None, env=None) -> subprocess.CompletedProcess:
    """The job on 5 ranks forked onto the hosts, 2, 2 and 1; `node`: what host 3's ranks do after
    entering it; `env`: every rank's environment beside the host's."""
    def on(h):
        hosts.enter(h)
        os.environ.update(env or {})
        if h == 2 and node:
            node()
    return ForkedRanks(5, *args, ranks_per_node=[2, 2, 1], nodes=[partial(on, h) for h in range(3)],
                       master_addr=hosts.addresses[0], entry=rehearse).wait()


def output(proc: subprocess.CompletedProcess) -> str:
    """What a failed check shows: the end of the table, and the first rank's traceback (the
    others' follow it: their peer closed)."""
    first = proc.stderr.find("Traceback")
    return proc.stdout[-3000:] + "\n--- first traceback:\n" + proc.stderr[max(first, 0):][:3000]


def test_the_rehearsal_of_the_job_passes_across_three_hosts(hosts, train_data, tmp_path):
    """The job's flags rehearsed on 5 ranks forked onto the hosts (the launch is not the
    subject here: the Slurm test rehearses through srun and bert-launch): every line passes, the
    records stay in RUN/rehearsal, and nothing is left that --resume auto would read."""
    run = tmp_path / "run"
    proc = forked(hosts, *job(train_data, run))
    assert proc.returncode == 0, output(proc)
    assert table(proc.stdout) == dict.fromkeys(NAMES, "pass"), proc.stdout[-4000:]
    report = json.loads((run / "rehearsal" / "report.json").read_text())
    assert report["passed"] and report["world_size"] == 5 and report["steps"] == 8
    assert "node1, node2, node3" in next(c for c in report["checks"] if c["name"] == "output directory")["detail"]
    relaunch = next(c for c in report["checks"] if c["name"] == "relaunch")["detail"]
    assert "read back by all 5 ranks" in relaunch
    assert not (run / "checkpoints").exists() and not (run / "rehearsal" / "checkpoints").exists()
    assert not (run / "rehearsal" / "hf_model").exists()


def read_only(directory: Path) -> None:
    """This process's view of `directory` made read-only, in a mount namespace of its own."""
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.unshare(CLONE_NEWNS) == 0
    subprocess.run(["mount", "--make-rprivate", "/"], check=True)
    subprocess.run(["mount", "--bind", str(directory), str(directory)], check=True)
    subprocess.run(["mount", "-o", "remount,bind,ro", str(directory)], check=True)


def test_an_output_directory_one_host_cannot_write_fails_its_line(hosts, train_data, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    proc = forked(hosts, *job(train_data, out / "run"), node=partial(read_only, out))
    lines = table(proc.stdout)
    assert proc.returncode == 1 and lines.get("output directory") == "FAIL", output(proc)
    assert lines["allreduce"] == lines["memory plan"] == "pass" and lines["relaunch"] == "----"
    assert "node3: cannot write" in proc.stdout and "fix: make" in proc.stdout and "node1" not in \
        proc.stdout.split("node3: cannot write")[1].splitlines()[0].split("fix")[0]


def test_a_disk_too_small_for_the_kept_checkpoints_fails_its_line(hosts, train_data, tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(disk)], check=True)
    try:
        proc = forked(hosts, *job(train_data, disk / "run"))
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)
    lines = table(proc.stdout)
    assert proc.returncode == 1 and lines.get("disk") == "FAIL", output(proc)
    assert lines["output directory"] == lines["memory plan"] == "pass" and lines["checkpoint"] == "----"
    assert "3 checkpoint(s) of" in proc.stdout and "--keep-checkpoints" in proc.stdout


def test_a_micro_batch_the_plan_says_does_not_fit_fails_its_line(hosts, train_data, tmp_path):
    config = tmp_path / "large.json"
    config.write_text(json.dumps(changed(json.loads((REPO / "ds_configs" / "cpu_tiny_lamb.json").read_text()),
                                         {"train_micro_batch_size_per_gpu": 512})))
    proc = forked(hosts, *job(train_data, tmp_path / "run"), "--deepspeed_config", config,
                  "--model", "large")
    lines = table(proc.stdout)
    assert proc.returncode == 1 and lines.get("memory plan") == "FAIL", output(proc)
    assert lines["allreduce"] == lines["output directory"] == lines["disk"] == "pass"
    assert "micro-batch 512: rank" in proc.stdout and "bert-plan fit" in proc.stdout


def test_an_interface_that_does_not_reach_the_others_is_said_before_the_first_collective(hosts, train_data,
                                                                                         tmp_path):
    """Each host also has docker0 at 172.17.0.1, and the ranks are told GLOO_SOCKET_IFNAME=docker0."""
    hosts.add_decoy_interface()
    try:
        proc = forked(hosts, *job(train_data, tmp_path / "run"), env={"GLOO_SOCKET_IFNAME": "docker0"})
    finally:
        hosts.add_decoy_interface(remove=True)
    assert proc.returncode != 0
    assert ("problem: node2: GLOO_SOCKET_IFNAME=docker0 does not reach the other hosts (node2 reaches them "
            "through eth0); set GLOO_SOCKET_IFNAME=eth0") in proc.stdout, output(proc)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("name, late", [
    ("bert_base_phase1_lamb_bf16", {}),
    ("bert_base_phase1_onebit_lamb_bf16", {"optimizer.params.freeze_step": 2}),
    ("bert_base_phase1_zero_one_adam_bf16", {"optimizer.params.var_freeze_step": 2}),
    ("bert_base_phase1_diloco_lamb_bf16", {"commodity_bert.diloco.inner_steps": 2}),
])
def test_the_rehearsal_config_runs_every_kind_of_step_within_its_steps(name, late):
    """8 steps of the micro-batch, accumulation 1, the schedule's warm-up in the job's proportion,
    and the stages the job starts late (a freeze, DiLoCo's rounds) started within them; the
    config still passes train.py's checks on any world size."""
    import math

    import train  # noqa: F401  (every section's owner registers it)
    from commodity_bert.run_config import RunConfig
    from commodity_bert.train.launch_checks import check_deepspeed_config
    given = json.loads((REPO / "ds_configs" / f"{name}.json").read_text())
    config = RunConfig.parse(given).rehearsed(8)
    assert "train_batch_size" not in config and config["gradient_accumulation_steps"] == 1
    assert config["train_micro_batch_size_per_gpu"] == given["train_micro_batch_size_per_gpu"]
    params = config["scheduler"]["params"]
    job = given["scheduler"]["params"]
    assert params["total_num_steps"] == 8
    assert params["warmup_num_steps"] == max(1, math.ceil(8 * job["warmup_num_steps"] / job["total_num_steps"]))
    for dotted, value in late.items():
        node = config
        for key in dotted.split("."):
            node = node[key]
        assert node == value
    assert "freeze_max_step" not in config["optimizer"]["params"]
    batch = check_deepspeed_config(config, 5)
    assert (batch.micro, batch.accumulation, batch.total) == (given["train_micro_batch_size_per_gpu"], 1,
                                                              5 * given["train_micro_batch_size_per_gpu"])


def test_the_rehearsals_runs_take_the_jobs_command_less_what_would_outlast_them():
    from commodity_bert.plan import cli
    from commodity_bert.plan.rehearsal import without_flags
    args = cli.parse_args(["--local_rank=0", "rehearse", "--steps", "6", "--deepspeed_config", "c.json", "--data", "d",
                           "--time-budget", "2h", "--watch-downstream", "--task embedded:polarity", "--output-dir", "r"])
    assert args.steps == 6 and args.local_rank == 0
    assert without_flags(args.train_args, {"--watch-downstream": 1, "--time-budget": 1}) == \
        ["--deepspeed_config", "c.json", "--data", "d", "--output-dir", "r"]
