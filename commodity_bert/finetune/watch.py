"""Probe a pretraining run while it trains: fine-tune each new checkpoint (and the final
export) on a downstream task and append its row to RUN/downstream.jsonl and to TensorBoard
(RUN/tensorboard/downstream, tag downstream/TASK/METRIC, at the checkpoint's step).

It runs as its own process beside training (`bert-finetune --watch RUN`, or train.py's
--watch-downstream, which starts it at the lowest CPU priority on rank 0's host) and only reads
the run's files, so it can neither slow the training's collectives nor break them. It always
takes the newest checkpoint it has not probed, skipping those that appeared while it was busy,
and a probe that fails (a checkpoint rotated away while being read, a full disk) is logged and
the next one tried. Restarted, it goes on after the steps already in downstream.jsonl."""
from __future__ import annotations

import json
import os
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from commodity_bert.finetune import models
from commodity_bert.finetune.evaluation import evaluate
from commodity_bert.model.card import refresh_card
from commodity_bert.run_dir import CHECKPOINTS, HF_MODEL, SUMMARY
from commodity_bert.train import checkpoint as ckpt

ROWS = "downstream.jsonl"


@dataclass(frozen=True)
class Candidate:
    step: int
    path: Path
    kind: str  # checkpoint | export


def candidates(run_dir: Path) -> list[Candidate]:
    """Complete checkpoints (at or before the one `latest` names: a newer directory is still
    being written) and, once the run has finished, its export; oldest first."""
    found: dict[int, Candidate] = {}
    directory = run_dir / CHECKPOINTS
    newest = ckpt.latest(directory)
    if newest:
        limit = int(ckpt.TAG.match(newest).group(1))
        for step_dir in directory.iterdir():
            match = ckpt.TAG.match(step_dir.name)
            if match and int(match.group(1)) <= limit and (step_dir / ckpt.MODEL_FILE).is_file():
                found[int(match.group(1))] = Candidate(int(match.group(1)), step_dir, "checkpoint")
    summary = run_dir / SUMMARY
    if summary.is_file() and (run_dir / HF_MODEL / "config.json").is_file():
        step = json.loads(summary.read_text())["step"]
        found[step] = Candidate(step, run_dir / HF_MODEL, "export")  # the same weights, in fp32
    return [found[s] for s in sorted(found)]


def probed(run_dir: Path, task_name: str) -> set[int]:
    done = set()
    path = run_dir / ROWS
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short when the watcher was killed
            if row.get("task") == task_name:
                done.add(row["step"])
    return done


def _alive(pid: int | None) -> bool:
    if pid is None:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _pause(seconds: float, pid: int | None) -> None:
    """Wait for the next poll, or less: the training's end is noticed within a second, so its
    final export is probed at once rather than up to a poll later."""
    until = time.monotonic() + seconds
    while _alive(pid) and (left := until - time.monotonic()) > 0:
        time.sleep(min(left, 1.0))


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] watch: {message}", flush=True)


def probe(run_dir: Path, candidate: Candidate, task, hp, seeds, device, cache_dir, progress, writer,
          selection: dict | None = None) -> dict:
    """`selection`: evaluate's lr_grid, lr_folds, steps_grid and early_stopping, as bert-finetune's flags set them."""
    pretrained = models.load(candidate.path, flag="--watch")
    result = evaluate(pretrained, task, hp, seeds, device, cache_dir, random_init=False, progress=progress,
                      **(selection or {}))
    known = pretrained.provenance
    row = {"step": candidate.step, "samples": known.get("samples"), "elapsed_s": known.get("elapsed_s"),
           "task": task.name, "family": task.family, "task_type": result["task_type"], "metric": task.metric,
           "median": result["median"],
           "min": result["min"], "max": result["max"], "seeds": len(seeds), "source": candidate.kind,
           "seconds": result["seconds"]}
    if "linear_probe" in result:  # classification's probe on frozen features
        row["linear_probe"] = result["linear_probe"]["pretrained"]["value"]
    with open(run_dir / ROWS, "a") as fh:
        fh.write(json.dumps(row) + "\n")
    tag = f"downstream/{task.name.replace(':', '_')}"
    writer.add_scalar(f"{tag}/{task.metric}", result["median"], candidate.step)
    if "linear_probe" in row:
        writer.add_scalar(f"{tag}/linear_probe", row["linear_probe"], candidate.step)  # frozen: no seed noise
    writer.flush()
    return row


def finished(run_dir: Path, available: list[Candidate]) -> bool:
    """The run's summary is there and no checkpoint is newer than its export (train.py removes
    the summary when it starts, so a relaunched run is not mistaken for a finished one)."""
    return any(c.kind == "export" for c in available) and available[-1].kind == "export"


def run(run_dir: Path, task, hp, seeds, device, cache_dir, poll_seconds: float = 30.0, once: bool = False,
        stop_with_pid: int | None = None, progress: bool = True, selection: dict | None = None) -> None:
    """While the training runs, probe the newest unprobed checkpoint (skipping older ones);
    once it has ended (or with --once), probe every unprobed one, oldest first, for the curve."""
    from torch.utils.tensorboard import SummaryWriter
    if not run_dir.is_dir():
        raise models.ModelError(f"--watch {run_dir}: no such directory")
    writer = SummaryWriter(str(run_dir / "tensorboard" / "downstream"))
    done = probed(run_dir, task.name)
    failed: set[int] = set()
    log(f"watching {run_dir} for {task.name} ({len(seeds)} seeds); already probed: {sorted(done) or 'none'}")
    try:
        while True:
            try:
                available = candidates(run_dir)
            except (OSError, ValueError, KeyError) as exc:  # a file caught mid-write or mid-rotation
                log(f"cannot list the run's checkpoints now ({type(exc).__name__}: {exc}); retrying")
                _pause(poll_seconds, stop_with_pid)
                continue
            over = once or not _alive(stop_with_pid) or (stop_with_pid is None and finished(run_dir, available))
            todo = [c for c in available if c.step not in done | failed]
            if not over:  # racing a live run: only what is newer than the last probe, newest first
                todo = [c for c in todo if c.step > max(done | failed, default=-1)]
                if len(todo) > 1:
                    log(f"skipping step(s) {', '.join(str(c.step) for c in todo[:-1])}: step {todo[-1].step} "
                        f"is newer")
                todo = todo[-1:]
            for candidate in todo:
                try:
                    row = probe(run_dir, candidate, task, hp, seeds, device, cache_dir, progress, writer, selection)
                    done.add(candidate.step)
                    log(f"step {row['step']} ({candidate.kind}): {task.metric} median {100 * row['median']:.1f}% "
                        f"(min {100 * row['min']:.1f}%, max {100 * row['max']:.1f}%) in {row['seconds']:.0f} s")
                except models.ModelError as exc:  # a damaged checkpoint: its digest says so, no traceback
                    failed.add(candidate.step)
                    log(f"step {candidate.step} ({candidate.kind}) skipped: {exc}")
                except Exception as exc:  # noqa: BLE001 - a failed probe must not end the watch
                    failed.add(candidate.step)
                    log(f"step {candidate.step} ({candidate.kind}) failed: {type(exc).__name__}: "
                        f"{str(exc).splitlines()[0] if str(exc) else ''}")
                    traceback.print_exc()
            if todo:
                continue  # a newer checkpoint may have appeared meanwhile
            if over:
                log("the run has finished" if finished(run_dir, available) else
                    "training has ended" if stop_with_pid else "nothing more to probe")
                refresh_card(run_dir, log)
                return
            _pause(poll_seconds, stop_with_pid)
    finally:
        writer.close()
