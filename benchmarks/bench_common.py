"""Helpers the benchmark scripts share (imported as a sibling: the scripts run from this folder)."""
from __future__ import annotations

import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from commodity_bert.host import cpu_model, free_port  # free_port: the benchmarks take it from here too

REPO = Path(__file__).resolve().parents[1]


def cpu_and_wall(cmd: list[str]) -> tuple[float, float]:
    """CPU-seconds of `cmd` and every process it waited for, and its wall seconds."""
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True)
    wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
    return after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime, wall


def medians(measured: list[tuple[float, float]]) -> dict:
    """(CPU, wall) pairs of several runs: their medians and the runs."""
    return {"cpu_s": round(statistics.median(c for c, _ in measured), 2),
            "wall_s": round(statistics.median(w for _, w in measured), 2),
            "cpu_s_runs": [round(c, 2) for c, _ in measured], "wall_s_runs": [round(w, 2) for _, w in measured]}


def report(cases: dict, runs: int, json_path: Path | None, width: int = 30) -> None:
    """Each case's medians on a line, and the whole as JSON with the machine and the command."""
    for name, case in cases.items():
        print(f"{name:{width}s} CPU {case['cpu_s']:.2f} s  wall {case['wall_s']:.2f} s", flush=True)
    if json_path:
        json_path.write_text(json.dumps({"machine": cpu_name(), "command": " ".join(sys.argv), "runs": runs,
                                         "cases": cases}, indent=1) + "\n")


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
