"""A large run by simulation: ≥ 1 GB of real text prepared with every worker, then trained from.

The text is the shared State of the Union and Wikipedia corpora (13.5 MB) repeated, each copy
with every document's sentences in another order (seeded per copy): new NSP pairs, new
instances and new masks, the same words. It reports the preparation's wall time, MB/s and peak
RSS (the largest process: main or worker), the disk per sample, then trains `--steps` steps on 2
local ranks (train.py's defaults: streaming, 2 shards in memory) and reports throughput and
each rank's peak RSS (summary.json).

    python benchmarks/large_run.py --work W [--gigabytes 1.0] [--workers 2] [--steps 300] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench_common import REPO, free_port

sys.path.insert(0, str(REPO))
from data_prep.sentences import split_sentences  # noqa: E402

CORPORA = REPO.parent / "shared" / "corpora"


def documents(path: Path) -> list[list[str]]:
    """Blank-line separated documents, each a list of its sentences."""
    docs, lines = [], []
    for line in path.read_text().splitlines():
        if line.strip():
            lines.append(line)
        elif lines:
            docs.append(lines)
            lines = []
    if lines:
        docs.append(lines)
    return [[s for line in doc for s in split_sentences(line)] for doc in docs]


def make_corpus(out: Path, gigabytes: float) -> dict:
    if out.exists():
        return json.loads(out.with_suffix(".json").read_text())
    base = documents(CORPORA / "sotu.txt") + documents(CORPORA / "enwiki_gensim.txt")
    budget, copies = int(gigabytes * 1e9), 0
    tmp = out.with_suffix(".tmp")
    with open(tmp, "w") as fh:
        while fh.tell() < budget:
            rng = random.Random(copies)  # copy k: each document's sentences in the k-th order
            for doc in base:
                order = doc[:] if copies == 0 else rng.sample(doc, len(doc))
                fh.write("\n".join(order) + "\n\n")
            copies += 1
    tmp.rename(out)
    info = {"bytes": out.stat().st_size, "copies": copies, "documents": copies * len(base)}
    out.with_suffix(".json").write_text(json.dumps(info))
    return info


def prepare(text: Path, out: Path, workers: int, num_shards: int) -> dict:
    cmd = [sys.executable, "-m", "data_prep", "shards", "--input", str(text), "--output", str(out),
           "--vocab", "embedded:bert-base-uncased", "--seq-len", "128", "--dupe-factor", "5",
           "--num-shards", str(num_shards), "--workers", str(workers), "--val-fraction", "0.001"]
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    main_cpu = [0.0]  # the main process's own CPU seconds: the part that does not spread over workers

    def poll():
        ticks = os.sysconf("SC_CLK_TCK")
        while proc.returncode is None:
            try:
                fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
                main_cpu[0] = (int(fields[11]) + int(fields[12])) / ticks
            except (OSError, IndexError):
                pass
            time.sleep(0.5)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    _, status, usage = os.wait4(proc.pid, 0)  # ru_maxrss: the largest of it and its workers
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - started
    if proc.returncode:
        raise SystemExit(f"data preparation failed: {' '.join(cmd)}")
    manifest = json.loads((out / "manifest.json").read_text())
    samples = sum(s["samples"] for s in manifest["splits"].values())
    disk = sum(p.stat().st_size for p in out.rglob("*.hdf5"))
    return {"wall_s": wall, "mb_per_s": text.stat().st_size / 1e6 / wall,
            "mb_per_s_per_worker": text.stat().st_size / 1e6 / wall / workers,
            "peak_rss_mb": usage.ru_maxrss / 1024, "samples": samples, "main_process_cpu_s": main_cpu[0],
            "all_processes_cpu_s": usage.ru_utime + usage.ru_stime,
            "input_tokens": manifest["input"]["tokens"], "disk_bytes": disk, "disk_bytes_per_sample": disk / samples,
            "shards": num_shards, "padding_fraction": manifest["splits"]["train"]["padding_fraction"]}


def train(data: Path, run: Path, steps: int, model: str) -> dict:
    deepspeed = Path(sys.executable).with_name("deepspeed")
    cmd = [str(deepspeed), "--num_gpus", "2", "--master_port", str(free_port()), "train.py",
           "--deepspeed_config", str(REPO / "ds_configs" / "cpu_quickstart_lamb_fp32.json"), "--data", str(data),
           "--model", model, "--output-dir", str(run), "--max-steps", str(steps), "--log-every", "25",
           "--save-every", "0", "--num-workers", "1"]
    started = time.perf_counter()
    with open(run.with_suffix(".log"), "w") as log:
        subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, check=True)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rates = [r["seq_per_s"] for r in rows if "seq_per_s" in r][1:]
    summary = json.loads((run / "summary.json").read_text())
    return {"wall_s": time.perf_counter() - started, "steps": summary["step"], "seq_per_s": statistics.median(rates),
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows if "tokens_per_s" in r),
            "data_wait_s": statistics.median(r["data_wait_s"] for r in rows if "data_wait_s" in r),
            "rank_peak_rss_mb": summary["peak_rss_mb"], "val_mlm_acc": summary.get("val_mlm_acc")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--gigabytes", type=float, default=1.0)
    p.add_argument("--workers", type=int, default=os.cpu_count())
    p.add_argument("--num-shards", type=int, default=64)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--model", default="tiny")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    text = args.work / f"corpus_{args.gigabytes:g}gb.txt"
    corpus = make_corpus(text, args.gigabytes)
    print(f"corpus: {corpus}", flush=True)
    data = args.work / "shards"
    prep = prepare(text, data, args.workers, args.num_shards) if not (data / "manifest.json").exists() else None
    print(f"preparation: {prep}", flush=True)
    run = args.work / "run"
    subprocess.run(["rm", "-rf", str(run)], check=True)
    trained = train(data, run, args.steps, args.model)
    print(f"training: {trained}", flush=True)
    report = {"machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
              "command": " ".join(sys.argv), "corpus": corpus, "preparation": prep, "training": trained}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
