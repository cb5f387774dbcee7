"""Helpers the benchmark scripts share (imported as a sibling: the scripts run from this folder)."""
from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

from commodity_bert.host import cpu_model, free_port  # free_port: the benchmarks take it from here too

REPO = Path(__file__).resolve().parents[1]


def single_rank_environment() -> None:
    """torch.distributed at world size 1, as DeepSpeed's launcher would set it (without these,
    DeepSpeed looks for an MPI launch)."""
    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())})


def cpu_name() -> str:
    """The CPU's model name, for the record every figure carries (bf16 speed depends on it)."""
    return cpu_model() or platform.processor() or platform.machine()


def make_shards(out: Path, input_spec: str, seq_len: int, *extra: str) -> Path:
    """`bert-data-prep shards` of real text, kept in `out` for the next run."""
    if not (out / "manifest.json").exists():
        proc = subprocess.run([sys.executable, "-m", "data_prep", "shards", "--input", input_spec,
                               "--output", str(out), "--seq-len", str(seq_len), *extra],
                              cwd=REPO, capture_output=True, text=True, check=False)
        if proc.returncode:
            raise SystemExit(f"data preparation failed: {proc.stderr.strip().splitlines()[-1]}")
    return out
