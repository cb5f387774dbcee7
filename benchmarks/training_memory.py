"""A training rank's peak memory and throughput against the size of the data set.

Prepares real text at 1× and 4× (the shared State of the Union and Wikipedia corpora; shards of
the same size: 4 and 16 of them), then trains `tiny` on 2 local ranks from each with train.py,
and reports per run each rank's peak RSS (polled from /proc: works for any checkout), the
largest process's (the launcher's wait4 usage, loader workers included), the arrays' size and
the throughput (median seq/s over the logged windows); then medians over the repeats. `--repo` runs another
checkout's train.py (e.g. a worktree of the commit before streaming), to compare.

    python benchmarks/training_memory.py --work W [--repo DIR] [--steps 100] [--repeats 3] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench_common import REPO, free_port

CORPORA = REPO.parent / "shared" / "corpora"


def corpus(work: Path, megabytes: float) -> Path:
    """`megabytes` of sotu.txt then enwiki_gensim.txt (13.5 MB together), again from the start
    where more is asked: repeated documents make arrays like new ones."""
    path = work / f"text_{megabytes:g}mb.txt"
    if not path.exists():
        budget, lines = int(megabytes * 1e6), []
        while budget > 0:
            for name in ("sotu.txt", "enwiki_gensim.txt"):
                for line in [*(CORPORA / name).read_text().splitlines(keepends=True), "\n"]:
                    if budget <= 0:
                        break
                    lines.append(line)
                    budget -= len(line.encode())
        path.write_text("".join(lines))
    return path


def shards(work: Path, text: Path, num_shards: int, workers: int) -> Path:
    out = work / f"{text.stem}_shards"
    if not (out / "manifest.json").exists():
        subprocess.run([sys.executable, "-m", "data_prep", "shards", "--input", str(text),
                        "--vocab", "embedded:bert-base-uncased", "--output", str(out), "--seq-len", "128",
                        "--dupe-factor", "10", "--num-shards", str(num_shards), "--workers", str(workers)],
                       cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    return out


def arrays_mb(data: Path) -> float:
    """The training arrays a loader holds (all keys but input_mask, rebuilt from lengths)."""
    import h5py
    total = 0
    manifest = json.loads((data / "manifest.json").read_text())
    for entry in manifest["splits"]["train"]["shards"]:
        with h5py.File(data / entry["name"]) as f:
            total += sum(f[k].size * f[k].dtype.itemsize for k in f if k != "input_mask")
    return total / 2**20


def _proc(pid: str, name: str) -> str:
    try:
        return (Path("/proc") / pid / name).read_text()
    except OSError:
        return ""


class RankPeaks(threading.Thread):
    """Polls the peak RSS (VmHWM) of the training ranks: the processes whose parent is
    DeepSpeed's launch.py (their loader workers are the ranks' children, not counted)."""

    def __init__(self):
        super().__init__(daemon=True)
        self.peaks: dict[str, float] = {}
        self.seen: dict[str, tuple] = {}
        self.timeline: dict[str, list[tuple[float, float]]] = {}  # pid: (seconds, VmRSS MB), every ~2 s
        self.started = time.perf_counter()
        self.done = threading.Event()

    def run(self):
        while not self.done.wait(0.2):
            for pid in filter(str.isdigit, os.listdir("/proc")):
                status = _proc(pid, "status")
                if "VmHWM:" not in status:
                    continue
                parent = status.split("PPid:")[1].split()[0]
                if "train.py" in _proc(pid, "cmdline") and "deepspeed.launcher.launch" in _proc(parent, "cmdline"):
                    self.seen[pid] = (parent, _proc(pid, "cmdline").replace("\0", " ")[:80])
                    mb = int(status.split("VmHWM:")[1].split()[0]) / 1024
                    self.peaks[pid] = max(self.peaks.get(pid, 0.0), mb)
                    now, line = time.perf_counter() - self.started, self.timeline.setdefault(pid, [])
                    if not line or now - line[-1][0] >= 2:
                        line.append((round(now, 1), int(status.split("VmRSS:")[1].split()[0]) / 1024))


def train(repo: Path, data: Path, run: Path, steps: int, extra: list[str], model: str = "tiny",
          config: Path = REPO / "ds_configs" / "cpu_quickstart_lamb_fp32.json", env: dict | None = None) -> dict:
    deepspeed = Path(sys.executable).with_name("deepspeed")
    cmd = [str(deepspeed), "--num_gpus", "2", "--master_port", str(free_port()), "train.py",
           "--deepspeed_config", str(config), "--data", str(data),
           "--model", model, "--output-dir", str(run), "--max-steps", str(steps), "--log-every", "25",
           "--eval-every", "0", "--save-every", "0", "--num-workers", "1", *extra]
    started = time.perf_counter()
    ranks = RankPeaks()
    ranks.start()
    with open(run.with_suffix(".log"), "w") as log:
        proc = subprocess.Popen(cmd, cwd=repo, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        _, status, usage = os.wait4(proc.pid, 0)
    ranks.done.set()
    ranks.join()
    if os.waitstatus_to_exitcode(status):
        raise SystemExit(f"training failed, see {run.with_suffix('.log')}")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rates = [r["seq_per_s"] for r in rows if "seq_per_s" in r][1:]  # the first window holds start-up
    summary = json.loads((run / "summary.json").read_text())
    return {"wall_s": time.perf_counter() - started, "largest_process_peak_rss_mb": usage.ru_maxrss / 1024,
            "rank_peak_rss_mb": sorted(ranks.peaks.values()), "summary_peak_rss_mb": summary.get("peak_rss_mb"),
            "rank_processes": {pid: [*ranks.seen[pid], ranks.peaks[pid]] for pid in ranks.peaks},
            "rank_rss_timeline_mb": ranks.timeline,
            "seq_per_s": statistics.median(rates) if rates else None, "seq_per_s_windows": rates}


LOADER_PEAK = """
import inspect, sys, time
from commodity_bert.data.dataset import ShardSet
from commodity_bert.data.loader import TrainingBatches
def peak_mb():
    return int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0]) / 1024
data, batches = sys.argv[1], int(sys.argv[2])
open("/proc/self/clear_refs", "w").write("5")  # the peak from here on
start, started = peak_mb(), time.perf_counter()
loader = TrainingBatches(ShardSet.open(data), 0, 2, 32, seed=1, num_workers=0)
stream = iter(loader)
for _ in range(batches):
    next(stream)
print(peak_mb() - start, time.perf_counter() - started)
"""


def loader_peak(repo: Path, data: Path, batches: int) -> dict:
    """Rank 0 of 2's loader alone, in a fresh process: its peak RSS above the start (after
    imports) over `batches` micro-batches of 32, and the seconds it took."""
    out = subprocess.run([sys.executable, "-c", LOADER_PEAK, str(data), str(batches)], cwd=repo, check=True,
                         capture_output=True, text=True).stdout.split()
    return {"loader_peak_rss_mb": float(out[-2]), "loader_s": float(out[-1])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--repo", type=Path, default=REPO, help="the checkout whose train.py runs")
    p.add_argument("--text-mb", type=float, nargs=2, default=[6.0, 24.0])
    p.add_argument("--shards", type=int, nargs=2, default=[4, 16])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--train-args", default="", help="more train.py flags, e.g. '--shards-in-memory 2'")
    p.add_argument("--loader-only", action="store_true", help="only the loader-alone runs (no training)")
    p.add_argument("--loader-batches", type=int, default=2000, help="micro-batches the loader-only runs read")
    p.add_argument("--repeats", type=int, default=3, help="runs per size, alternating sizes; medians reported")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    sizes = [(mb, num, shards(args.work, corpus(args.work, mb), num, args.workers))
             for mb, num in zip(args.text_mb, args.shards)]
    runs = []
    for repeat in range(0 if args.loader_only else args.repeats):
        for megabytes, num, data in sizes:
            run = args.work / f"run_{megabytes:g}mb_{args.repo.name}"
            if run.exists():
                subprocess.run(["rm", "-rf", str(run)], check=True)
            measured = train(args.repo.resolve(), data, run, args.steps, args.train_args.split())
            runs.append({"text_mb": megabytes, "shards": num, "arrays_mb": arrays_mb(data), "repeat": repeat,
                         **measured})
            print(json.dumps(runs[-1]), flush=True)
    for megabytes, num, data in sizes:
        for repeat in range(args.repeats):
            runs.append({"text_mb": megabytes, "shards": num, "repeat": repeat, "loader_only": True,
                         **loader_peak(args.repo.resolve(), data, args.loader_batches)})
            print(json.dumps(runs[-1]), flush=True)
    medians = []
    nan = float("nan")
    for megabytes, num, data in sizes:
        mine = [r for r in runs if r["text_mb"] == megabytes and not r.get("loader_only")]
        loader = [r for r in runs if r["text_mb"] == megabytes and r.get("loader_only")]
        medians.append({"text_mb": megabytes, "shards": num, "arrays_mb": arrays_mb(data),
                        "rank_peak_rss_mb": statistics.median(max(r["rank_peak_rss_mb"]) for r in mine) if mine else nan,
                        "seq_per_s": statistics.median(r["seq_per_s"] for r in mine) if mine else nan,
                        "loader_peak_rss_mb": statistics.median(r["loader_peak_rss_mb"] for r in loader),
                        "loader_s": statistics.median(r["loader_s"] for r in loader)})
    grown = medians[1]["rank_peak_rss_mb"] - medians[0]["rank_peak_rss_mb"]
    loader_grown = medians[1]["loader_peak_rss_mb"] - medians[0]["loader_peak_rss_mb"]
    added = medians[1]["arrays_mb"] - medians[0]["arrays_mb"]
    report = {"machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
              "command": " ".join(sys.argv), "repo": str(args.repo), "runs": runs, "medians": medians,
              "rank_peak_rss_growth_mb": grown, "arrays_added_mb": added, "growth_per_array_mb": grown / added,
              "loader_peak_rss_growth_mb": loader_grown, "loader_growth_per_array_mb": loader_grown / added}
    print(f"arrays {medians[0]['arrays_mb']:.0f} → {medians[1]['arrays_mb']:.0f} MB: a rank's peak RSS (median of "
          f"{args.repeats}) {medians[0]['rank_peak_rss_mb']:.0f} → {medians[1]['rank_peak_rss_mb']:.0f} MB "
          f"({grown / added:.2f} MB per MB added); seq/s {medians[0]['seq_per_s']:.1f} / {medians[1]['seq_per_s']:.1f}")
    print(f"the loader alone (rank 0 of 2, {args.loader_batches} batches): peak RSS above start "
          f"{medians[0]['loader_peak_rss_mb']:.0f} → {medians[1]['loader_peak_rss_mb']:.0f} MB "
          f"({loader_grown / added:.2f} MB per MB added), {medians[0]['loader_s']:.1f} / {medians[1]['loader_s']:.1f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
