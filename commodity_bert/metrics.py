"""Training metrics: rank 0 appends one JSON object per log step to RUN/metrics.jsonl and
writes the same scalars to TensorBoard (RUN/tensorboard)."""
from __future__ import annotations

import json
import math
from pathlib import Path


class MetricsLogger:
    def __init__(self, run_dir: Path, enabled: bool):
        self.enabled = enabled
        self.path = run_dir / "metrics.jsonl"
        self.writer = None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter
            run_dir.mkdir(parents=True, exist_ok=True)
            self.writer = SummaryWriter(str(run_dir / "tensorboard"))

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
