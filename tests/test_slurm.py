"""Pretraining under a real Slurm, as a user submits it: recipes/slurm/pretrain.sbatch and
pretrain_phases.sh on slurmctld plus one slurmd per network-namespace host (tools/slurm_cluster.py;
Debian's slurm-wlm, proctrack/linuxproc, no cgroup constraints). Every job is 2 nodes of one
CPU rank each. Skips, saying why, where Slurm cannot start (not root, slurm-wlm not installed).

The runs of the two jobs (preempted; out of time, then a node lost) are trained once each and
compared with each other: both are the same 2-rank run, stopped at different steps."""
import json
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import CPU_CONFIG, REPO

from commodity_bert.train.balance import SLOW_RANKS_ENV

sys.path.insert(0, str(REPO))

SBATCH = REPO / "recipes" / "slurm" / "pretrain.sbatch"
PHASES = REPO / "recipes" / "slurm" / "pretrain_phases.sh"
BERT_LAUNCH = Path(sys.executable).parent / "bert-launch"
STEPS = 40


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    from tools.slurm_cluster import SlurmCluster, unavailable_reason
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"Slurm tests: {reason}")
    directory = tmp_path_factory.mktemp("slurm")
    try:
        cluster = SlurmCluster.up(directory, hosts=2)
    except (RuntimeError, subprocess.CalledProcessError) as exc:  # e.g. a kernel whose cgroups slurmd refuses
        errors = [line for log in sorted((directory / "log").glob("*.log")) for line in log.read_text().splitlines()
                  if "error" in line]
        pytest.skip(f"Slurm tests: Slurm could not start here ({exc}; {errors[-1] if errors else 'no log'})")
    try:
        yield cluster
    finally:
        cluster.down()


def train_flags(steps: int, *extra) -> str:
    return " ".join(map(str, ["--max-steps", steps, "--log-every", 1, "--eval-every", 1000, "--save-every", 1000,
                              "--num-workers", 1, "--dist-timeout-minutes", 1, *extra]))


def job_env(slurm, data: Path, run: Path, steps: int, *extra) -> dict:
    return slurm.env(DATA=str(data), RUN=str(run), MODEL="tiny", CONFIG=str(CPU_CONFIG), BERT_LAUNCH=str(BERT_LAUNCH),
                     EXTRA=train_flags(steps, *extra))


def log_of(out: Path, job: str) -> str:
    path = out / f"job-{job}.out"
    return path.read_text(errors="replace") if path.exists() else ""


def rows(run: Path) -> list[dict]:
    if not (run / "metrics.jsonl").exists():
        return []
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]


def wait_for(predicate, timeout: float, what: str, on_timeout=lambda: ""):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not after {timeout:.0f} s\n{on_timeout()[-4000:]}")
        time.sleep(0.5)
    return value


def stopped_at(log: str) -> list[int]:
    return [int(s) for s in re.findall(r"stopping at step (\d+): signal; checkpoint saved", log)]


def resumed_at(log: str, run: Path) -> list[int]:
    return [int(s) for s in re.findall(rf"resuming from {re.escape(str(run))}/checkpoints/step_\d+ at step (\d+)", log)]


@pytest.fixture(scope="module")
def preempted(slurm, train_data, tmp_path_factory):
    """Phase 1 and phase 2 through pretrain_phases.sh; phase 1 gets `scancel --signal=USR1` at step 6 or later."""
    out = tmp_path_factory.mktemp("phases")
    run1, run2 = out / "phase1", out / "phase2"
    env = job_env(slurm, train_data, run1, STEPS)
    env.update(DATA1=str(train_data), DATA2=str(train_data), RUN1=str(run1), RUN2=str(run2), CONFIG1=str(CPU_CONFIG),
               CONFIG2=str(CPU_CONFIG), EXTRA1=train_flags(STEPS), EXTRA2=train_flags(6))
    proc = slurm.run("bash", str(PHASES), "-N", "2", "--output", str(out / "job-%j.out"), env=env, cwd=REPO)
    phase1, phase2 = re.findall(r"job (\d+)", proc.stdout)[:2]
    waiting = slurm.job(phase2)
    wait_for(lambda: len(rows(run1)) >= 6, 240, "phase 1 training", lambda: log_of(out, phase1))
    slurm.run("scancel", "--signal=USR1", phase1)
    first = slurm.wait(phase1, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"}, timeout=300)
    second = slurm.wait(phase2, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"}, timeout=300)
    return {"out": out, "run1": run1, "run2": run2, "jobs": (phase1, phase2), "waiting": waiting,
            "fields": (first, second), "logs": (log_of(out, phase1), log_of(out, phase2))}


def test_a_2_node_job_trains_and_a_preempted_one_checkpoints_requeues_itself_and_resumes(preempted):
    first, _ = preempted["fields"]
    log, run = preempted["logs"][0], preempted["run1"]
    assert first["JobState"] == "COMPLETED" and first["ExitCode"] == "0:0", log[-4000:]
    assert first["Restarts"] == "1"                                    # requeued once, by the job itself
    summary = json.loads((run / "summary.json").read_text())
    assert summary["hosts"] == ["node1", "node2"] and summary["step"] == STEPS
    assert summary["stopped_by"] == "max steps" and summary["params_identical_across_ranks"]
    [step] = stopped_at(log)                                           # USR1 → the ranks stop at a step boundary
    assert step >= 6
    assert f"stopped at step {step} (signal), before the end: requeueing job {preempted['jobs'][0]}" in log
    assert resumed_at(log, run) == [step]                              # the requeued run starts from that checkpoint
    assert f"finished at step {STEPS} (max steps)" in log
    assert [r["step"] for r in rows(run)] == list(range(1, STEPS + 1))  # every step once
    assert (run / "hf_model" / "config.json").exists()


def test_phase_2_waits_for_phase_1_through_its_requeue_and_starts_from_its_weights(preempted):
    phase1, phase2 = preempted["jobs"]
    first, second = preempted["fields"]
    assert f"afterok:{phase1}" in preempted["waiting"]["Dependency"]
    assert preempted["waiting"]["JobState"] == "PENDING"
    assert second["JobState"] == "COMPLETED", preempted["logs"][1][-4000:]
    assert second["Restarts"] == "0"
    assert second["StartTime"] >= first["EndTime"]                   # ISO times: after phase 1 ended, for good
    config = json.loads((preempted["run2"] / "run_config.json").read_text())
    assert config["args"]["init_from"] == str(preempted["run1"])
    assert json.loads((preempted["run2"] / "summary.json").read_text())["step"] == 6


@pytest.fixture(scope="module")
def out_of_time(slurm, train_data, tmp_path_factory, preempted):
    """One job through two interruptions. A 1-minute limit and USR1 20 s before it (Slurm sends it
    up to 30 s earlier here): run 1 stops at the signal and requeues the job. Its requeued run
    trains 5 steps more, past a checkpoint of its own (--save-every 5); then node2 dies (slurmd and
    the job's processes killed), Slurm requeues the job, and it resumes once the node is back.
    From step 12 on its ranks compute a quarter of the time (COMMODITY_BERT_SLOW_RANKS): the wait
    is Slurm's clock, and the steps before it stay as fast as the preempted job's, which stops
    near step 7 (slowed from the start, a run once stopped at the same step, and the comparison
    of the two was skipped)."""
    out = tmp_path_factory.mktemp("time_limit")
    run = out / "run"
    env = {**job_env(slurm, train_data, run, 1000, "--save-every", 5), SLOW_RANKS_ENV: "0:4:12-,1:4:12-"}
    job = slurm.sbatch("-N", "2", "--time", "1", "--signal", "USR1@20", "--output", str(out / "job-%j.out"), str(SBATCH),
                       env=env, cwd=REPO)

    def log() -> str:
        return log_of(out, job)

    stopped = wait_for(lambda: stopped_at(log()), 150, "the time limit's signal", log)[0]
    wait_for(lambda: "requeueing job" in log(), 60, "the requeue", log)
    slurm.run("scontrol", "update", f"JobId={job}", "TimeLimit=10")  # run 2 is not to be stopped again
    wait_for(lambda: max([r["step"] for r in rows(run)], default=0) >= stopped + 5, 150, "the requeued run", log)
    timed_out = {"fields": slurm.job(job), "log": log(), "rows": rows(run)}

    latest = run / "checkpoints" / "latest"
    wait_for(lambda: latest.read_text() > f"step_{stopped:08d}", 60, "the requeued run's checkpoint", log)
    killed = slurm.hosts.kill_host_processes(1, "")                   # node2: slurmd, the job's processes, all
    died = time.monotonic()
    lost = wait_for(lambda: [line for line in log().splitlines() if "lost a peer" in line], 60,
                    "node1's rank to notice", log)
    noticed_s = time.monotonic() - died
    saved = int(latest.read_text().removeprefix("step_"))
    fields = slurm.wait(job, {"PENDING"}, timeout=120)               # Slurm: node2 down, the job requeued (--requeue)
    node_lost = {"killed": killed, "noticed_s": noticed_s, "lost": lost, "saved": saved, "fields": fields,
                 "log": log(), "node2": slurm.node_state("node2")}
    slurm.start_slurmd(1)                                            # the node is back: the job runs again
    wait_for(lambda: len(resumed_at(log(), run)) == 2, 180, "the job requeued after the node failure", log)
    slurm.run("scancel", job)
    slurm.wait(job, {"CANCELLED", "COMPLETED"}, timeout=60)
    return {"run": run, "job": job, "stopped": stopped, "timed_out": timed_out, "node_lost": node_lost,
            "resumed": resumed_at(log(), run)}


def test_a_job_out_of_time_checkpoints_exits_0_and_its_requeued_run_goes_on(out_of_time):
    timed_out, run, step = out_of_time["timed_out"], out_of_time["run"], out_of_time["stopped"]
    log = timed_out["log"]
    assert f"stopped at step {step} (signal), before the end: requeueing job {out_of_time['job']}" in log, log[-3000:]
    assert "DUE TO TIME LIMIT" not in log                            # stopped by the signal, not killed at the limit
    # the nodes have 1 CPU each: the job says its rank and loader share it, and what to ask for
    assert "warning: 1 CPU(s) a node for 1 rank(s) and their 1 loader processes each: they share cores; " \
           "submit with --cpus-per-task 2 or more" in log
    assert timed_out["fields"]["Restarts"] == "1"
    assert resumed_at(log, run) == [step]
    steps = [r["step"] for r in timed_out["rows"]]
    assert steps == list(range(1, len(steps) + 1))


def test_the_interrupted_runs_train_the_same_steps_as_each_other(preempted, out_of_time):
    """The two jobs are the same run (config, seed, data, 2 ranks) stopped at different steps: where
    one trained on after its checkpoint the other had not stopped, so their rows must agree."""
    a, b = rows(preempted["run1"]), out_of_time["timed_out"]["rows"]
    stops = {stopped_at(preempted["logs"][0])[0], out_of_time["stopped"]}
    assert len(stops) == 2 or pytest.skip("both jobs stopped at the same step: nothing to compare across")
    common = [(x, y) for x, y in zip(a, b) if x["step"] == y["step"]]
    assert len(common) > min(stops) + 2
    for x, y in common:
        assert (x["loss"], x["mlm_acc"]) == (y["loss"], y["mlm_acc"]), x["step"]
        assert x["grad_norm"] == pytest.approx(y["grad_norm"], rel=1e-5)


def test_a_node_that_dies_ends_the_run_in_one_line_and_the_job_comes_back_when_it_does(slurm, out_of_time):
    """The job of out_of_time, after its requeue: node2 dies mid-run."""
    lost = out_of_time["node_lost"]
    log = lost["log"]
    assert lost["killed"]
    assert lost["noticed_s"] < 30
    assert len(lost["lost"]) == 1 and lost["lost"][0].startswith("train.py: error: rank 0 on node1 lost a peer (")
    assert "resume" in lost["lost"][0] and "Traceback" not in log    # one line, not a traceback
    assert "Node failure on node2" in log or "NODE FAILURE" in log
    assert lost["fields"]["Restarts"] == "2" and lost["node2"].startswith("DOWN")
    assert out_of_time["resumed"] == [out_of_time["stopped"], lost["saved"]]  # back with the node, from its checkpoint


def test_bert_ablate_submits_its_runs_as_a_job_array_and_the_report_after_them(slurm, train_data, tmp_path,
                                                                              out_of_time):
    """--slurm: one array task per run (here a good variant and one whose optimizer does not
    exist), each through pretrain.sbatch on a node of its own, then the report job."""
    out = tmp_path / "ABL"
    proc = slurm.run(str(BERT_LAUNCH.parent / "bert-ablate"), "--base", str(CPU_CONFIG),
                     "--vary", "optimizer.type=Nonesuch,Lamb", "--data", str(train_data), "--model", "tiny",
                     "--ranks", "1", "--samples", "256", "--train-args", "--num-workers 1", "--out", str(out),
                     "--slurm", "--sbatch-args", "--time 10", cwd=REPO)
    array, report = re.search(r"job array (\d+) \(2 runs.*report job (\d+) after it", proc.stdout).groups()
    assert f"afterany:{array}" in slurm.job(report)["Dependency"]
    fields = slurm.wait(report, {"COMPLETED", "FAILED", "CANCELLED"}, timeout=300)
    assert fields["JobState"] == "COMPLETED", (out / f"slurm-report-{report}.out").read_text()
    results = {r["variant"]: r for r in json.loads((out / "results.json").read_text())}
    good, bad = results["cpu_tiny_lamb__type=Lamb"], results["cpu_tiny_lamb__type=Nonesuch"]
    assert good["status"] == "finished" and good["final_val_mlm_acc"] is not None
    assert bad["status"] == "failed" and "Nonesuch" in bad["error"] and "train.py: error:" in bad["error"]
    summary = json.loads((Path(good["run_dir"]) / "summary.json").read_text())
    assert summary["step"] == 256 // 32 and summary["stopped_by"] == "max steps"
    assert "pretrain.sbatch: finished at step 8" in (Path(good["run_dir"]) / "train.log").read_text()
    assert "Nonesuch" in (out / "results.md").read_text()


def test_a_bare_srun_trains_across_nodes_and_its_usr1_checkpoints_and_exits_0(slurm, train_data, tmp_path,
                                                                                out_of_time):
    """`srun python train.py` with no launcher: each task takes its rank, world, node and the
    rendezvous from Slurm's variables (commodity_bert/launcher_env.py); Slurm's USR1 to the step reaches
    every rank, which checkpoint and exit 0."""
    run = tmp_path / "run"
    command = shlex.join([sys.executable, "-u", "train.py", "--deepspeed_config", str(CPU_CONFIG), "--model", "tiny",
                          "--data", str(train_data), "--output-dir", str(run), *train_flags(STEPS).split()])
    job = slurm.sbatch("-N", "2", "--ntasks-per-node", "1", "--chdir", str(REPO), "--output",
                       str(tmp_path / "job-%j.out"), "--wrap", f"srun {command}", env=slurm.env(GLOO_SOCKET_IFNAME="eth0"))
    wait_for(lambda: len(rows(run)) >= 3, 240, "the srun job's training", lambda: log_of(tmp_path, job))
    slurm.run("scancel", "--signal=USR1", job)
    fields = slurm.wait(job, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"}, timeout=300)
    log = log_of(tmp_path, job)
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", log[-4000:]
    [step] = stopped_at(log)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["hosts"] == ["node1", "node2"] and summary["stopped_by"] == "signal" and summary["step"] == step
    assert (run / "checkpoints" / f"step_{step:08d}" / "progress.json").is_file()


def test_a_job_requeued_onto_another_node_finds_rank_0_there(slurm, train_data, tmp_path):
    """A one-node job submitted with MASTER_ADDR exported (node1's address, as preflight used to
    print it): node2 drained, it starts on node1 and keeps the address; then node1 is drained,
    node2 resumed, and USR1 makes the job requeue itself, onto node2, where sbatch still passes
    node1's address: the requeued run works out node2's and goes on from its checkpoint. An
    address of no node of the job is refused on the first start, in one line."""
    node1, node2 = slurm.hosts.addresses[:2]
    env = job_env(slurm, train_data, tmp_path / "run", 1000)
    refused = slurm.sbatch("-N", "1", "--output", str(tmp_path / "job-%j.out"), str(SBATCH),
                           env={**env, "RUN": str(tmp_path / "refused"), "MASTER_ADDR": "10.254.254.254"}, cwd=REPO)
    run = tmp_path / "run"
    try:
        slurm.run("scontrol", "update", "NodeName=node2", "State=DRAIN", "Reason=test")
        job = slurm.sbatch("-N", "1", "--output", str(tmp_path / "job-%j.out"), str(SBATCH),
                           env={**env, "MASTER_ADDR": node1}, cwd=REPO)
        wait_for(lambda: len(rows(run)) >= 3, 240, "the job's training on node1", lambda: log_of(tmp_path, job))
        slurm.run("scontrol", "update", "NodeName=node1", "State=DRAIN", "Reason=test")
        slurm.run("scontrol", "update", "NodeName=node2", "State=RESUME")
        slurm.run("scancel", "--signal=USR1", job)
        wait_for(lambda: resumed_at(log_of(tmp_path, job), run), 180, "the run requeued onto node2",
                 lambda: log_of(tmp_path, job))
        [step] = stopped_at(log_of(tmp_path, job))
        wait_for(lambda: max(r["step"] for r in rows(run)) >= step + 2, 120, "training on node2",
                 lambda: log_of(tmp_path, job))
        fields = slurm.job(job)
        slurm.run("scancel", job)
        slurm.wait(job, {"CANCELLED", "COMPLETED"}, timeout=60)
    finally:
        slurm.run("scontrol", "update", "NodeName=node1,node2", "State=RESUME", check=False)
    log = log_of(tmp_path, job)
    assert f"job {job} (run 1) on node1: node1: 1 rank(s), from step 0; rank 0 at {node1}:" in log, log[-3000:]
    assert (f"MASTER_ADDR={node1} (exported at submission) is not an address of node2, this requeued run's "
            f"first node: rank 0 at {node2}") in log
    assert f"job {job} (run 2) on node2: node2: 1 rank(s), from step {step}; rank 0 at {node2}:" in log
    assert fields["Restarts"] == "1" and fields["NodeList"] == "node2"
    assert [r["step"] for r in rows(run)][:step + 2] == list(range(1, step + 3))  # on from the checkpoint
    refusal = slurm.wait(refused, {"FAILED", "COMPLETED", "CANCELLED"}, timeout=60)
    lines = [line for line in log_of(tmp_path, refused).splitlines() if "MASTER_ADDR" in line]
    assert refusal["JobState"] == "FAILED" and refusal["ExitCode"] == "2:0"
    [line] = lines
    node = refusal["NodeList"]
    assert line.startswith(f"pretrain.sbatch: MASTER_ADDR=10.254.254.254 is not an address of {node}, the job's "
                           "first node, where rank 0 runs (") and "submit without it" in line
    assert slurm.hosts.addresses[slurm.hosts.hosts.index(node)] in line
    assert not (tmp_path / "refused").exists()


def test_the_job_picks_bf16_or_fp16_from_the_gpus_on_its_nodes(slurm, train_data, tmp_path):
    """With CONFIG unset, pretrain.sbatch asks each compute node's nvidia-smi for its GPUs'
    compute capabilities and takes the _bf16 config only where every card has bf16 (8.0 and up).
    These nodes have no GPU: an nvidia-smi on PATH answers for two cards from FAKE_CAPS, the
    only part not real; each job is cancelled once its first line says what it trains."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "nvidia-smi"
    fake.write_text('#!/bin/sh\ncase "$*" in\n  -L) echo "GPU 0: A"; echo "GPU 1: B" ;;\n'
                    '  *compute_cap*) echo "$FAKE_CAPS" | tr , "\\n" ;;\nesac\n')
    fake.chmod(0o755)
    jobs = {}
    for caps in ("8.6,7.5", "8.6,8.0"):
        env = job_env(slurm, train_data, tmp_path / caps, 10)
        env.pop("CONFIG")
        env.update(MODEL="base", RANKS_PER_NODE="1", FAKE_CAPS=caps, PATH=f"{bin_dir}:{env['PATH']}")
        jobs[caps] = slurm.sbatch("-N", "1", "--output", str(tmp_path / "job-%j.out"), str(SBATCH), env=env, cwd=REPO)
    lines = {}
    for caps, job in jobs.items():
        lines[caps] = wait_for(lambda: [line for line in log_of(tmp_path, job).splitlines() if "(run 1)" in line],
                               60, "the job's first line", lambda: log_of(tmp_path, job))[0]
        slurm.run("scancel", job)
    assert lines["8.6,7.5"].endswith("; ds_configs/bert_base_phase1_lamb_fp16.json: fp16: a GPU without bf16 "
                                     "(compute capability 7.5 8.6; bf16 needs 8.0)")
    assert lines["8.6,8.0"].endswith("; ds_configs/bert_base_phase1_lamb_bf16.json: bf16: every GPU has it "
                                     "(compute capability 8.0 8.6)")


def test_the_rehearsal_of_the_job_runs_under_slurm_and_ends_without_a_requeue(slurm, train_data, tmp_path):
    """REHEARSE=1: pretrain.sbatch runs bert-plan rehearse with the job's flags on its allocation (srun,
    one bert-launch a node, no ssh) and ends with the rehearsal's status: no requeue, no checkpoint
    in RUN/checkpoints for the real job to resume."""
    run = tmp_path / "run"
    job = slurm.sbatch("-N", "2", "--output", str(tmp_path / "job-%j.out"), str(SBATCH),
                       env={**job_env(slurm, train_data, run, 300), "REHEARSE": "1"}, cwd=REPO)
    fields = slurm.wait(job, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"}, timeout=300)
    log = log_of(tmp_path, job)
    assert fields["JobState"] == "COMPLETED" and fields["Restarts"] == "0", log[-4000:]
    assert "pretrain.sbatch: rehearsing the job: bert-plan rehearse --steps 8" in log and "rehearsal: passed" in log
    report = json.loads((run / "rehearsal" / "report.json").read_text())
    assert report["passed"] and report["world_size"] == 2
    assert "node1, node2" in next(c for c in report["checks"] if c["name"] == "output directory")["detail"]
    assert not (run / "checkpoints").exists() and "requeue" not in log


def test_preflight_runs_under_srun_alone_and_names_the_hosts(slurm, tmp_path):
    """bert-plan preflight as `srun python -m commodity_bert.plan preflight` inside an allocation:
    no pdsh, no ssh; each rank takes its place from srun's variables, and the hosts, their
    interfaces and the lines to paste are named."""
    out = tmp_path / "profile.json"
    command = shlex.join([sys.executable, "-m", "commodity_bert.plan", "preflight", "--model", "tiny", "--seq-len", "32",
                          "--micro-batch", "2", "--steps", "1", "--vocab-size", "2000", "--sizes-mb", "1",
                          "--link-mb", "1", "--out", str(out)])
    job = slurm.sbatch("-N", "2", "--ntasks-per-node", "1", "--chdir", str(REPO), "--output",
                       str(tmp_path / "job-%j.out"), "--wrap", f"srun {command}", env=slurm.env(GLOO_SOCKET_IFNAME="eth0"))
    fields = slurm.wait(job, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"}, timeout=300)
    log = log_of(tmp_path, job)
    assert out.exists(), log[-4000:]
    profile = json.loads(out.read_text())
    assert [r["host"] for r in profile["ranks"]] == ["node1", "node2"] and profile["hosts"] == 2
    assert (fields["JobState"] == "COMPLETED") == (not profile["problems"]), log[-3000:]  # a busy core may flag a slow rank
    addresses = slurm.hosts.addresses
    assert f"node1: eth0 {addresses[0]} reaches node2" in log and f"node2: eth0 {addresses[1]} reaches node1" in log
    assert f"  MASTER_ADDR={addresses[0]}   " in log
