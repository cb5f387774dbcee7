"""Training metrics: rank 0 appends one JSON object per log step to RUN/metrics.jsonl and
writes the same scalars to TensorBoard (RUN/tensorboard).

The file describes one run's history: a resumed run drops the rows of steps after its
checkpoint (they are about to be trained again; TensorBoard's purge_step does the same for
its events), and a fresh start in a directory that holds a finished run's metrics moves them
aside to metrics.jsonl.<time> instead of mixing two runs in one file."""
from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path


class MetricsLogger:
    def __init__(self, run_dir: Path, enabled: bool, start_step: int = 0):
        self.enabled = enabled
        self.path = run_dir / "metrics.jsonl"
        self.writer = None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter
            run_dir.mkdir(parents=True, exist_ok=True)
            self._start_history_at(start_step)
            self.writer = SummaryWriter(str(run_dir / "tensorboard"), purge_step=start_step + 1)

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
        for key, value in row.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(f"train/{key}" if not key.startswith("val_") else f"val/{key[4:]}",
                                       value, row["step"])
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
