"""bert-ablate --slurm: the ablation's runs as one Slurm job array, and its report as a job after it.

    bert-ablate --base C.json --vary optimizer.params.lr=1e-3,5e-3 --seeds 1 2 ... --out ABL \\
        --slurm --sbatch-args "--partition gpu --gpus-per-node 8 --time 4:00:00"

writes ABL/slurm_array.sbatch (task i trains run i of ABL/ablation.json through
recipes/slurm/pretrain.sbatch: preempted or out of time, the run checkpoints and the task
requeues itself) and submits it, then submits `bert-ablate ... --report-only` with
--dependency=afterany on the array, so that results.md is there when the last run ends,
whether it finished or failed. Each task's output goes to its RUN/train.log, as bert-ablate's own
runs' does; a task that fails leaves RUN/failed.json (exit status and error line), which the
report shows. With --downstream, a task that finishes fine-tunes its model, as bert-ablate does.

Why a module of its own and not a loop over sbatch: one array is one entry in squeue, one
`scancel`, and Slurm's own limit on how many run at once (--sbatch-args "--array=...%2")."""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

from commodity_bert.ablate import runs
from commodity_bert.ablate.record import Ablation, run_downstream
from commodity_bert.model.card import refresh_card

PRETRAIN_SBATCH = runs.REPO / "recipes" / "slurm" / "pretrain.sbatch"


class SlurmError(Exception):
    pass


def nodes_and_ranks(settings: dict) -> tuple[int, int]:
    """How many nodes a run takes and how many ranks on each."""
    if not settings.get("hostfile"):
        return 1, settings["ranks"]
    slots = [int(p.split("=", 1)[1]) for line in Path(settings["hostfile"]).read_text().splitlines()
             for p in line.split("#")[0].split()[1:] if p.startswith("slots=")]
    return len(slots), slots[0]


def array_script(out: Path, indices: list[int], settings: dict, downstream: list[str] | None,
                 downstream_args: str) -> str:
    nodes, ranks = nodes_and_ranks(settings)
    task = [sys.executable, "-m", "commodity_bert.ablate.slurm", str(out), "$SLURM_ARRAY_TASK_ID"]
    if downstream:
        task += ["--downstream", *downstream, "--downstream-args", downstream_args]
    command = " ".join(a if a.startswith("$") else shlex.quote(a) for a in task)
    return "\n".join([
        "#!/bin/bash",
        f"# written by: {settings.get('argv', 'bert-ablate')}",
        "# One array task per run of ablation.json; each trains through recipes/slurm/pretrain.sbatch.",
        "#SBATCH --job-name=bert-ablate",
        f"#SBATCH --array={','.join(map(str, indices))}",
        f"#SBATCH --nodes={nodes}",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --signal=USR1@360",
        "#SBATCH --requeue",
        "#SBATCH --open-mode=append",
        f"#SBATCH --output={out}/slurm-%A_%a.out",
        "set -euo pipefail",
        f"cd {shlex.quote(str(runs.REPO))}",
        f"export RANKS_PER_NODE={ranks}",
        f"exec {command}",
        ""])


def submit(out: Path, settings: dict, indices: list[int], argv: list[str], sbatch_args: str, downstream: list[str] | None,
           downstream_args: str, dry_run: bool) -> str:
    """Write ABL/slurm_array.sbatch and, unless dry_run, submit it and the report after it."""
    script = out / "slurm_array.sbatch"
    tmp = script.with_name(script.name + ".tmp")
    tmp.write_text(array_script(out, indices, settings, downstream, downstream_args))
    os.replace(tmp, script)
    if dry_run:
        return f"Slurm job array: {script} (not submitted: --dry-run)"
    extra = shlex.split(sbatch_args)
    array = _sbatch([*extra, str(script)])
    report = [sys.executable, "-m", "commodity_bert.ablate", *_without_slurm_flags(argv), "--report-only"]
    report_job = _sbatch([*extra, "--job-name", "bert-ablate-report", "--nodes", "1", "--dependency",
                          f"afterany:{array}", "--output", str(out / "slurm-report-%j.out"),
                          "--wrap", f"cd {shlex.quote(str(runs.REPO))} && {shlex.join(report)}"])
    return (f"Slurm: job array {array} ({len(indices)} runs, {script}); report job {report_job} after it "
            f"(results in {out / 'results.md'})")


def _sbatch(args: list[str]) -> str:
    try:
        proc = subprocess.run(["sbatch", "--parsable", *args], capture_output=True, text=True, check=False)
    except FileNotFoundError as exc:
        raise SlurmError("--slurm: sbatch not found; run bert-ablate on a Slurm login node, or drop --slurm") from exc
    if proc.returncode:
        raise SlurmError(f"--slurm: sbatch refused the job: {proc.stderr.strip().splitlines()[-1:] or proc.returncode}")
    return proc.stdout.strip().split(";")[0]


def _without_slurm_flags(argv: list[str]) -> list[str]:
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--slurm":
            continue
        elif arg == "--sbatch-args":
            skip = True
        elif not arg.startswith("--sbatch-args="):
            kept.append(arg)
    return kept


def run_task(out: Path, index: int, downstream: list[str] | None, downstream_args: str) -> int:
    """Array task `index`: train that run through pretrain.sbatch (which requeues the task when the
    run stops early), then record a failure or fine-tune the finished model."""
    state = json.loads((out / "ablation.json").read_text())
    settings = state["settings"]
    run = Ablation(out, settings).all_runs()[index]
    flags = runs.command(run, settings, port=0)
    flags = flags[flags.index(str(runs.TRAIN_SCRIPT)) + 1:]
    for name in ("--deepspeed_config", "--data", "--model", "--output-dir"):  # pretrain.sbatch gives these
        at = flags.index(name)
        del flags[at:at + 2]
    env = {**os.environ, "DATA": settings["data"], "MODEL": settings["model"], "RUN": str(run.run_dir),
           "CONFIG": str(run.config_path), "EXTRA": shlex.join(flags), "MASTER_PORT": str(29500 + index % 1000)}
    run.run_dir.mkdir(parents=True, exist_ok=True)
    (run.run_dir / "failed.json").unlink(missing_ok=True)
    with open(run.log_path, "a") as log:
        log.write(f"\n$ [{os.environ.get('SLURM_JOB_ID')}] bash {PRETRAIN_SBATCH} with EXTRA={env['EXTRA']}\n")
        log.flush()
        code = subprocess.run(["bash", str(PRETRAIN_SBATCH)], cwd=runs.REPO, env=env, stdout=log,
                              stderr=subprocess.STDOUT, check=False).returncode
    if code:
        record = {"exit": code, "error": runs.error_line(run.log_path.read_text())}
        (run.run_dir / "failed.json").write_text(json.dumps(record) + "\n")
        print(f"{run.variant} seed {run.seed}: FAILED (exit {code}): {record['error']}", flush=True)
        return code
    if downstream and runs.is_finished(run):
        problem = run_downstream(run, downstream, downstream_args)
        print(f"{run.variant} seed {run.seed}: downstream " + (f"failed: {problem}" if problem else "done"), flush=True)
        if not problem:
            refresh_card(run.run_dir)
    return 0


def main(argv=None) -> None:
    import argparse
    p = argparse.ArgumentParser(prog="python -m commodity_bert.ablate.slurm", description="one task of the job array")
    p.add_argument("out", type=Path)
    p.add_argument("index", type=int)
    p.add_argument("--downstream", nargs="+")
    p.add_argument("--downstream-args", default="")
    args = p.parse_args(argv)
    sys.exit(run_task(args.out, args.index, args.downstream, args.downstream_args))


if __name__ == "__main__":
    main()
