"""One run of an ablation: its train.py command, whether it finished, and its figures read back
from the RUN directory that train.py wrote (metrics.jsonl, summary.json)."""
from __future__ import annotations

import json
import re
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from statistics import median

from commodity_bert.run_dir import CHECKPOINTS, METRICS, SUMMARY

REPO = Path(__file__).resolve().parents[2]
TRAIN_SCRIPT = REPO / "train.py"


@dataclass
class Run:
    variant: str
    seed: int
    config_path: Path
    run_dir: Path
    max_steps: int

    @property
    def log_path(self) -> Path:
        return self.run_dir / "train.log"


def launcher() -> str:
    """bert-launch: DeepSpeed's launcher with its arguments, which passes a stop (Ctrl-C, a
    preemption's SIGTERM) to the ranks so that they checkpoint; the run then resumes."""
    beside = Path(sys.executable).parent / "bert-launch"
    return str(beside) if beside.exists() else "bert-launch"


def command(run: Run, settings: dict, port: int) -> list[str]:
    where = ["--hostfile", settings["hostfile"]] if settings.get("hostfile") else ["--num_gpus", str(settings["ranks"])]
    cmd = [launcher(), *where, "--master_port", str(port), str(TRAIN_SCRIPT),
           "--deepspeed_config", str(run.config_path), "--data", settings["data"], "--model", settings["model"],
           "--output-dir", str(run.run_dir), "--seed", str(run.seed), "--max-steps", str(run.max_steps),
           "--eval-every", str(settings["eval_every"]), "--log-every", str(settings["log_every"]),
           "--save-every-minutes", str(settings["save_every_minutes"])]
    if settings.get("minutes"):
        cmd += ["--time-budget", f"{settings['minutes'] * 60:g}"]
    return cmd + shlex.split(settings.get("train_args") or "")


def summary(run: Run) -> dict | None:
    try:
        return json.loads((run.run_dir / SUMMARY).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def is_finished(run: Run) -> bool:
    """summary.json is written by every clean exit; a stop for a signal is not the end."""
    done = summary(run)
    return bool(done) and (done.get("step", 0) >= run.max_steps or done.get("stopped_by") == "time budget")


def has_checkpoint(run: Run) -> bool:
    return any((run.run_dir / CHECKPOINTS).glob("step_*"))


def error_line(log_text: str) -> str:
    """The line that says what went wrong: train.py's own error line, else the last exception."""
    lines = [line.strip() for line in log_text.splitlines() if line.strip()]
    for line in reversed(lines):
        if "train.py: error:" in line:
            return line[line.index("train.py: error:"):]
    for line in reversed(lines):
        if re.match(r"^(\[[^\]]*\]\s*)?[A-Za-z_.]*(Error|Exception)\b.*:", line):
            return line
    return lines[-1] if lines else "no output"


def execute(cmd: list[str], run: Run, stop_requested) -> int:
    """Run the launcher in a session of its own, its output appended to RUN/train.log; a stop
    asked of bert-ablate is passed on once (bert-launch takes a second as 'kill now')."""
    run.run_dir.mkdir(parents=True, exist_ok=True)
    with open(run.log_path, "a") as log:
        log.write(f"\n$ {shlex.join(cmd)}\n")
        log.flush()
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        forwarded = False
        while True:
            try:
                return proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                if stop_requested() and not forwarded:
                    proc.send_signal(signal.SIGTERM)
                    forwarded = True


def read_rows(run: Run) -> list[dict]:
    path = run.run_dir / METRICS
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut by a kill
    return rows


def last_step(run: Run) -> int:
    """The step of metrics.jsonl's last row, from the file's tail (a progress bar polls it)."""
    path = run.run_dir / METRICS
    try:
        with open(path, "rb") as f:
            f.seek(max(0, path.stat().st_size - 4096))
            return json.loads(f.read().decode(errors="ignore").strip().splitlines()[-1])["step"]
    except (OSError, IndexError, KeyError, json.JSONDecodeError):
        return 0


def figures(run: Run, target: float | None) -> dict:
    """What the ablation compares, from the run's own files."""
    rows = read_rows(run)
    done = summary(run) or {}
    evals = [r for r in rows if "val_mlm_acc" in r]
    logged = [r for r in rows if "loss" in r]
    totals, previous_step = dict.fromkeys(("bytes_sent", "bytes_received", "node_bytes_sent"), 0.0), 0
    for r in logged:  # each row holds its window's bytes per step
        for field in totals:
            if r.get(field) is not None:
                totals[field] += r[field] * (r["step"] - previous_step)
        previous_step = r["step"]
    total_bytes = totals["bytes_sent"]
    steps = logged[-1]["step"] if logged else 0
    reached = next((r for r in evals if target is not None and r["val_mlm_acc"] >= target), None)
    return {
        "final_val_mlm_acc": done.get("val_mlm_acc", evals[-1]["val_mlm_acc"] if evals else None),
        "best_val_mlm_acc": max((r["val_mlm_acc"] for r in evals), default=None),
        "final_loss": logged[-1]["loss"] if logged else None,
        "steps": steps,
        "samples": done.get("samples", logged[-1]["samples"] if logged else 0),
        "train_s": done.get("trained_s", logged[-1]["elapsed_s"] if logged else None),
        "wall_s": done.get("wall_s"),
        "samples_to_target": reached["samples"] if reached else None,
        "seconds_to_target": reached.get("elapsed_s") if reached else None,
        "seq_per_s": median(r["seq_per_s"] for r in logged) if logged else None,
        "tokens_per_s": median(r["tokens_per_s"] for r in logged) if logged else None,
        "bytes_per_step": total_bytes / steps if steps else None,
        "bytes_per_step_last": logged[-1].get("bytes_sent") if logged else None,
        "total_bytes": total_bytes,
        "total_bytes_received": totals["bytes_received"],  # rank 0's, as total_bytes is what it sent
        "total_node_bytes": totals["node_bytes_sent"],  # what a node's link sent, mean over nodes
        "curve": [{"step": r["step"], "samples": r["samples"], "elapsed_s": r.get("elapsed_s"),
                   "val_mlm_acc": r["val_mlm_acc"]} for r in evals],
        "loss_curve": [{"step": r["step"], "samples": r["samples"], "loss": r["loss"],
                        "bytes_sent": r.get("bytes_sent")} for r in logged],
    }
