"""What a relaunch on another layout costs a rank before its first batch: working out which
samples of the epoch earlier launches trained (their plans, from the manifest alone) and dealing
the rest to the new ranks (TrainingBatches.current_stream). It reads no shard, so a manifest of
the size of a real data set is enough: `--shards` shards of `--samples-per-shard` sequences in 4
length strata. Prints seconds and peak memory for one rank of the new layout, median of
`--repeats` fresh processes' measurements (each in its own process: the peak is the process's).

    python benchmarks/relaunch_data_order.py [--shards 256] [--samples-per-shard 40000] \\
        [--before 16x64] [--after 10x64] [--trained 0.5] [--repeats 3] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import cpu_name  # noqa: E402

SHARES = (0.05, 0.15, 0.30, 0.50)  # a seq-128 data set's strata, shortest first, about


def manifest(shards: int, per_shard: int) -> dict:
    counts = [round(per_shard * s) for s in SHARES]
    return {"num_strata": len(SHARES), "splits": {"train": {"shards": [{"strata_counts": counts}] * shards}}}


def one_measurement(args) -> dict:
    import numpy as np

    from commodity_bert.data.loader import Layout, StreamPlan, TrainingBatches
    world_before, micro_before = map(int, args.before.split("x"))
    world_after, micro_after = map(int, args.after.split("x"))
    m = manifest(args.shards, args.samples_per_shard)
    epoch_batches = StreamPlan(m, 0, world_before, micro_before, 1, 2).batches_in_epoch(0)
    trained = int(epoch_batches * args.trained)
    batches = TrainingBatches.__new__(TrainingBatches)  # the position's arithmetic alone: no shards to open
    batches.manifest, batches.seed, batches.where, batches.rank, batches.epoch = m, 1, "synthetic", 0, 0
    batches.layout, batches._remaining = Layout(world_after, micro_after, 2), None
    batches.earlier = [Layout(world_before, micro_before, 2, trained)]
    start = time.perf_counter()
    stream = batches.current_stream()
    first = next(iter(stream.plans(0))).plan[0]
    seconds = time.perf_counter() - start
    assert len(first) == micro_after and np.all(first >= 0)
    return {"seconds": seconds, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "samples": sum(sum(e["strata_counts"]) for e in m["splits"]["train"]["shards"]),
            "trained_before": trained * world_before * micro_before,
            "left_batches": stream.batches_in_epoch(0)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shards", type=int, default=256)
    p.add_argument("--samples-per-shard", type=int, default=40000)
    p.add_argument("--before", default="16x64", help="RANKSxMICRO of the launch that trained part of the epoch")
    p.add_argument("--after", default="10x64", help="RANKSxMICRO of the relaunch")
    p.add_argument("--trained", type=float, default=0.5, help="the share of the epoch trained before")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", type=Path)
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(one_measurement(args)))
        return
    argv = ["--shards", str(args.shards), "--samples-per-shard", str(args.samples_per_shard), "--before", args.before,
            "--after", args.after, "--trained", str(args.trained), "--one"]
    runs = [json.loads(subprocess.run([sys.executable, __file__, *argv], capture_output=True, text=True,
                                      check=True).stdout) for _ in range(args.repeats)]
    row = {"machine": cpu_name(), "shards": args.shards, "samples": runs[0]["samples"], "before": args.before,
           "after": args.after, "trained_before": runs[0]["trained_before"],
           "seconds_median": statistics.median(r["seconds"] for r in runs),
           "peak_rss_mb_median": statistics.median(r["peak_rss_mb"] for r in runs), "runs": runs,
           "command": " ".join(["python", "benchmarks/relaunch_data_order.py", *sys.argv[1:]])}
    print(f"{row['samples']:,} samples, {row['trained_before']:,} trained on {args.before} (ranks x micro-batch), "
          f"relaunched on {args.after}: {row['seconds_median']:.1f} s and {row['peak_rss_mb_median']:.0f} MB peak "
          f"for one rank (median of {args.repeats}; {row['machine']})")
    if args.json:
        args.json.write_text(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
