"""Training metrics: rank 0 appends one JSON object per log step to RUN/metrics.jsonl and sends
the same scalars wherever the DeepSpeed config's monitor blocks say:

    "tensorboard": {"enabled": true, "output_path": "...", "job_name": "..."}  default RUN/tensorboard
    "csv_monitor": {"enabled": true, "output_path": "...", "job_name": "..."}  default RUN/csv_monitor
    "wandb":       {"enabled": true, "project": "...", "team": "...", "group": "..."}

With no monitor block at all, TensorBoard in RUN/tensorboard, as before. A `comet` block is left
to DeepSpeed's engine (its own loss, lr and loss-scale events); the project's metrics do not go there.

Why the project reads DeepSpeed's blocks and writes the sinks itself instead of handing its
events to the engine's MonitorMaster (train.py removes the blocks before DeepSpeed sees them):
- one x axis: the engine logs its own events against samples, the project against optimizer
  steps, and wandb drops any event whose step is lower than one it has seen;
- a resumed run goes on from its checkpoint: the rows of steps after it are about to be trained
  again, so the history drops them (TensorBoard's purge_step, the CSV files cut back, wandb
  resumed as the same run, which ignores steps it already has) and a fresh start in a directory
  that holds a finished run moves its metrics.jsonl aside instead of mixing two runs in one file;
  DeepSpeed's writers open a new TensorBoard file, append to the CSV files and start a new wandb
  run at every launch;
- the run's config and its final summary belong on the wandb run (DeepSpeed's sends neither).
"""
from __future__ import annotations

import contextlib
import csv
import json
import math
import os
import tempfile
import time
import uuid
from pathlib import Path

from commodity_bert.run_dir import METRICS

MONITOR_BLOCKS = ("tensorboard", "csv_monitor", "wandb", "comet")
OURS = ("tensorboard", "csv_monitor", "wandb")


def without_our_monitors(ds_config: dict) -> dict:
    """The config for deepspeed.initialize: the blocks the project writes itself taken out."""
    return {k: v for k, v in ds_config.items() if k not in OURS}


def enabled_blocks(ds_config: dict) -> dict[str, dict]:
    """The monitor blocks that are on; with none set at all, TensorBoard."""
    if not any(name in ds_config for name in MONITOR_BLOCKS):
        return {"tensorboard": {"enabled": True}}
    return {name: ds_config[name] for name in OURS if isinstance(ds_config.get(name), dict)
            and ds_config[name].get("enabled", False)}


# the module each sink imports, the package that brings it, and how a user gets that
SINK_PACKAGES = {"tensorboard": ("torch.utils.tensorboard", "tensorboard", "pip install tensorboard"),
                 "wandb": ("wandb", "wandb", "pip install wandb"),
                 "comet": ("comet_ml", "comet_ml", "pip install comet_ml")}


def sink_directory(name: str, block: dict, run_dir: Path) -> Path:
    """Where a tensorboard or csv_monitor block writes: its output_path (RUN/NAME by default) and job_name."""
    return Path(block.get("output_path") or run_dir / name) / (block.get("job_name") or "")


def monitor_problem(ds_config: dict, run_dir: Path) -> str | None:
    """What would stop a monitor block on rank 0 once the engine is built, said before it is: its
    library missing, or its directory one that cannot be made or written."""
    import importlib
    blocks = enabled_blocks(ds_config)
    comet = ds_config.get("comet")
    if isinstance(comet, dict) and comet.get("enabled"):
        blocks["comet"] = comet
    for name, block in blocks.items():
        if name in SINK_PACKAGES:
            module, package, install = SINK_PACKAGES[name]
            try:  # imported as the sink will: a package present but broken counts as missing
                importlib.import_module(module)
            except ImportError:
                if name not in ds_config:
                    return (f"with no monitor block in the DeepSpeed config, metrics go to TensorBoard, which needs "
                            f'the {package} package: {install}, or add "csv_monitor": {{"enabled": true}}')
                return (f'the "{name}" block of the DeepSpeed config needs the {package} package, which is not '
                        f'installed: {install}, or set "{name}": {{"enabled": false}}')
        if name in ("tensorboard", "csv_monitor"):
            directory = sink_directory(name, block, run_dir)
            if problem := unwritable(directory):
                return (f'the "{name}" block writes to {directory}, which cannot be made or written '
                        f'({problem}); give another "output_path"')
    return None


def unwritable(directory: Path) -> str | None:
    """Why `directory` cannot be made or written, or None: made as the sink would make it, a
    file written there and removed, and whatever the check made removed again, so that a launch
    refused for another reason leaves no directories behind."""
    made = [d for d in (directory, *directory.parents) if not d.exists()]
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as exc:
        return str(exc.strerror or exc)
    finally:
        for d in made:  # deepest first
            with contextlib.suppress(OSError):
                d.rmdir()
    return None


def metric_name(key: str) -> str:
    return f"val/{key[4:]}" if key.startswith("val_") else f"train/{key}"


class TensorBoardSink:
    def __init__(self, log_dir: Path, start_step: int):
        from torch.utils.tensorboard import SummaryWriter
        self.writer = SummaryWriter(str(log_dir), purge_step=start_step + 1)

    def write(self, step: int, scalars: dict) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(metric_name(key), value, step)
        self.writer.flush()

    def close(self, summary: dict | None) -> None:
        self.writer.close()


class CsvSink:
    """DeepSpeed's csv_monitor layout: one file per metric, `step,NAME` rows (train_loss.csv: step,loss)."""

    def __init__(self, directory: Path, start_step: int):
        self.directory = directory
        if start_step == 0 and any(directory.glob("*.csv")):  # a fresh start: the earlier run's files aside
            directory.rename(directory.with_name(f"{directory.name}.{time.strftime('%Y%m%d-%H%M%S')}"))
        directory.mkdir(parents=True, exist_ok=True)
        for path in directory.glob("*.csv"):  # a resume: cut back to the checkpoint's step
            lines = path.read_text().splitlines()
            kept = lines[:1] + [line for line in lines[1:] if line.split(",", 1)[0].isdigit()
                                and int(line.split(",", 1)[0]) <= start_step]
            tmp = path.with_suffix(".tmp")
            tmp.write_text("".join(line + "\n" for line in kept))
            os.replace(tmp, path)

    def write(self, step: int, scalars: dict) -> None:
        for key, value in scalars.items():
            path = self.directory / (metric_name(key).replace("/", "_") + ".csv")
            new = not path.exists()
            with open(path, "a", newline="") as fh:
                writer = csv.writer(fh)
                if new:
                    writer.writerow(["step", key.removeprefix("val_")])
                writer.writerow([step, value])

    def close(self, summary: dict | None) -> None:
        pass


class WandbSink:
    """One wandb run per training run: its id is kept in RUN/wandb_run_id, so a relaunched or
    requeued run that resumes logs on into the same wandb run; a fresh start (no checkpoint) in
    the same directory is a new one. WANDB_MODE=offline keeps it on disk (RUN/wandb/)."""

    def __init__(self, block: dict, run_dir: Path, run_config: dict, start_step: int):
        import wandb
        id_file = run_dir / "wandb_run_id"
        resumed = start_step > 0 and id_file.exists()  # a fresh start in the same directory is a new run
        run_id = id_file.read_text().strip() if resumed else uuid.uuid4().hex[:8]
        id_file.write_text(run_id + "\n")
        self.run = wandb.init(project=block.get("project") or "commodity-bert", entity=block.get("team"),
                              group=block.get("group"), name=run_dir.resolve().name, id=run_id, resume="allow",
                              dir=str(run_dir), config=run_config)

    def write(self, step: int, scalars: dict) -> None:
        self.run.log({metric_name(k): v for k, v in scalars.items()}, step=step)

    def close(self, summary: dict | None) -> None:
        if summary:
            self.run.summary.update({k: v for k, v in summary.items() if isinstance(v, (int, float, str, bool))})
        self.run.finish()


class MetricsLogger:
    def __init__(self, run_dir: Path, enabled: bool, start_step: int = 0, ds_config: dict | None = None,
                 run_config: dict | None = None):
        self.enabled = enabled
        self.path = run_dir / METRICS
        self.sinks: list = []
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        self._start_history_at(start_step)
        for name, block in enabled_blocks(ds_config or {}).items():
            if name == "wandb":
                self.sinks.append(WandbSink(block, run_dir, run_config or {}, start_step))
                continue
            directory = sink_directory(name, block, run_dir)
            self.sinks.append((TensorBoardSink if name == "tensorboard" else CsvSink)(directory, start_step))

    def _start_history_at(self, start_step: int) -> None:
        if not self.path.exists():
            return
        if start_step == 0:
            aside = self.path.with_name(f"metrics.jsonl.{time.strftime('%Y%m%d-%H%M%S')}")
            os.replace(self.path, aside)
            print(f"fresh start: the earlier run's metrics moved to {aside}", flush=True)
            return
        kept = []
        for line in self.path.read_text().splitlines():
            try:
                if json.loads(line).get("step", 0) <= start_step:
                    kept.append(line)
            except json.JSONDecodeError:
                continue  # a line cut short when the run was killed
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, self.path)

    def log(self, row: dict) -> None:
        if not self.enabled:
            return
        row = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
        with open(self.path, "a") as fh:
            fh.write(json.dumps(row) + "\n")
        scalars = {k: v for k, v in row.items()
                   if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
        for sink in self.sinks:
            sink.write(row["step"], scalars)

    def close(self, summary: dict | None = None) -> None:
        for sink in self.sinks:
            sink.close(summary)
        self.sinks = []
