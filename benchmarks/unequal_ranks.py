"""Ranks of unequal speed on the namespace cluster: the step time of the equal split, of the
balanced split (train/balance.py, speeds measured in the run) and the ideal, with one rank
slowed on purpose.

One rank per host (tools/netns_cluster.py, DeepSpeed's pdsh launcher), the last host's rank
slowed by FACTOR with COMMODITY_BERT_SLOW_RANKS (it sleeps (FACTOR − 1) × its forward's time after
each forward and twice that after each backward: its compute slows, its exchange does not).
The slow-down actually got is read from the balanced run's own measurement (its launch line's
speeds). The ideal step time is Σ speeds / (W · slowest) times faster than the equal split's
(W ranks of equal work wait for the slowest); the balanced split's, at whole micro-batches,
is the deal's max(n_r / speed_r). Accumulation 7 makes 1, 1, 1, 0.5 dealable exactly (8, 8, 8, 4
of 28). Each setting runs `--repeats` times; medians of the steady windows, then of the runs.

    sudo python benchmarks/unequal_ranks.py [--hosts 4] [--factors 2 1.5] [--repeats 3] [--json OUT]
    sudo python benchmarks/unequal_ranks.py --transient 2:10-25 [--steps 40] [--json OUT]

`--transient FACTOR:FIRST-LAST`: one run with the speeds measured every 3 steps and re-dealt as
they change (redeal_gain 0.1), the last rank slowed by FACTOR from step FIRST to LAST: each
step's time and shares.

`--predict MEASURED.json` (this script's own JSON): for each slow-down measured there, `bert-plan
preflight` on the same cluster with the same rank slowed (preflight multiplies that rank's timed
forward + backward by the factor), and bert-plan's step time of the equal and the balanced split
beside the measured ones.

On one machine the hosts share its cores: a rank that sleeps frees its core for the others,
which a slower GPU would not, so the table also gives each run's unslowed step time.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]
from slow_network import one_thread_per_rank, run_variant, set_up  # noqa: E402
from tools.netns_cluster import Cluster  # noqa: E402

from commodity_bert.data.deal import Deal  # noqa: E402
from commodity_bert.train.balance import SLOW_RANKS_ENV  # noqa: E402


def config(micro_batch: int, accumulation: int, steps: int, balanced: bool) -> dict:
    lamb = json.loads((REPO / "ds_configs" / "cpu_tiny_lamb.json").read_text())
    lamb.update({"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": accumulation})
    lamb["scheduler"]["params"].update({"total_num_steps": 10 * steps, "warmup_num_steps": steps})
    if balanced:  # measured over the first 2 steps, dealt once (a re-deal would move the windows)
        lamb["commodity_bert"] = {"balance": {"split": "speed", "measure_steps": 2, "redeal": False}}
    return lamb


def slowed(cluster: Cluster, text: str) -> None:
    """COMMODITY_BERT_SLOW_RANKS for every rank (DeepSpeed's launcher passes its env file on)."""
    env_file = cluster.directory / "deepspeed_env"
    kept = [line for line in env_file.read_text().splitlines() if not line.startswith(SLOW_RANKS_ENV)]
    env_file.write_text("\n".join(kept + ([f"{SLOW_RANKS_ENV}={text}"] if text else [])))


def measured_speeds(log: Path) -> list[float]:
    found = re.search(r"balance at step \d+: micro-batches a step per rank \[[^]]*\] of \d+ \(speeds ([^;]+);",
                      log.read_text())
    return [float(s) for s in found.group(1).split(", ")]


def logged_steps(work: Path, name: str, args) -> dict[int, dict]:
    """A run's logged rows by step, each with its step time (the global batch over seq/s)."""
    path = work / f"{name}_{args.hosts}hosts_unlimited" / "metrics.jsonl"
    global_batch = args.micro_batch * args.accumulation * args.hosts
    return {r["step"]: {**r, "step_s": global_batch / r["seq_per_s"]}
            for r in map(json.loads, path.read_text().splitlines()) if "loss" in r}


def transient(cluster: Cluster, data: Path, work: Path, args) -> dict:
    factor, steps = args.transient.split(":")
    slowed(cluster, f"{args.hosts - 1}:{factor}:{steps}")
    balanced = config(args.micro_batch, args.accumulation, args.steps, True)
    balanced["commodity_bert"]["balance"].update({"measure_steps": 3, "redeal": True})
    args.log_every = 1
    run_variant(cluster, data, work, "transient", args, balanced, first_steady=2)
    per_step = [{"step": step, "step_s": r["step_s"], "rank_share": r["rank_share"]}
                for step, r in logged_steps(work, "transient", args).items()]
    for row in per_step:
        print(json.dumps(row))
    return {"slowed": f"rank {args.hosts - 1} × {factor}, steps {steps}", "steps": per_step}


def predict(cluster: Cluster, data: Path, work: Path, args) -> list[dict]:
    from dataclasses import replace

    from plan_vs_measured import preflight

    from commodity_bert.plan import estimate as e
    from commodity_bert.plan.step_model import step_estimate
    measured = json.loads(Path(args.predict).read_text())
    lines = []
    for row in measured["summary"]:
        slowed(cluster, f"{args.hosts - 1}:{row['factor']}")
        args.steps, args.freeze_step = 12, 0
        profile = preflight(cluster, data, work, args)
        compute = e.compute_from_profile(profile)
        net = e.network_from_profile(profile, None, None, None)
        work_load = e.workload("unequal", config(args.micro_batch, args.accumulation, args.steps, False), args.model,
                               profile["ranks"][0]["seq_len"], compute, 30522, args.steps, None,
                               world_hint=args.hosts)
        speeds = e.speeds_from_profile(profile)
        equal = step_estimate(work_load, "lamb", "full", args.hosts, 1, net).step_s
        balanced = step_estimate(replace(work_load, speeds=speeds, balanced=True), "lamb", "full", args.hosts, 1,
                                 net).step_s if speeds else equal
        lines.append({"factor": row["factor"], "profile_speeds": speeds, "predicted_equal_s": equal,
                      "predicted_balanced_s": balanced, "measured_equal_s": row["equal_step_s"],
                      "measured_balanced_s": row["balanced_step_s"],
                      "error_equal": equal / row["equal_step_s"] - 1,
                      "error_balanced": balanced / row["balanced_step_s"] - 1})
        print(json.dumps(lines[-1]), flush=True)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--factors", type=float, nargs="+", default=[2.0, 1.5])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", default="mini")
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--accumulation", type=int, default=7)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--transient", metavar="FACTOR:FIRST-LAST")
    parser.add_argument("--predict", metavar="MEASURED.json")
    parser.add_argument("--work")
    parser.add_argument("--json")
    args = parser.parse_args()
    work, data = set_up("unequal_ranks.py", args.work)
    args.current_rate, args.log_every, args.freeze_step = "unlimited", 2, 0
    cluster = Cluster.up(work / "cluster", args.hosts, slots=1)
    results = []
    try:
        one_thread_per_rank(cluster)
        if args.predict:
            lines = predict(cluster, data, work, args)
            print("\n| slowed × | equal: measured | predicted | balanced: measured | predicted |")
            print("|---:|---:|---:|---:|---:|")
            for r in lines:
                print(f"| {r['factor']:g} | {r['measured_equal_s']:.3f} | {r['predicted_equal_s']:.3f} "
                      f"({r['error_equal']:+.0%}) | {r['measured_balanced_s']:.3f} | {r['predicted_balanced_s']:.3f} "
                      f"({r['error_balanced']:+.0%}) |")
            if args.json:
                Path(args.json).write_text(json.dumps({"args": vars(args), "predictions": lines}, indent=1))
            return
        if args.transient:
            out = transient(cluster, data, work, args)
            if args.json:
                Path(args.json).write_text(json.dumps({"args": vars(args), **out}, indent=1))
            return
        for factor in [1.0, *args.factors]:
            slowed(cluster, f"{args.hosts - 1}:{factor}" if factor != 1 else "")
            for split in ("equal", "speed") if factor != 1 else ("equal",):
                for repeat in range(args.repeats):
                    name = f"{split}_x{factor:g}_{repeat}"
                    result = run_variant(cluster, data, work, name, args,
                                         config(args.micro_batch, args.accumulation, args.steps, split == "speed"),
                                         first_steady=4)
                    windows = result["windows"]
                    rows = logged_steps(work, name, args)
                    entry = {"factor": factor, "split": split, "repeat": repeat,
                             "step_s": statistics.median(rows[s]["step_s"] for _, s in windows),
                             "windows": windows}
                    if split == "speed":
                        entry["speeds"] = measured_speeds(work / f"{name}_{args.hosts}hosts_unlimited.log")
                        entry["shares"] = rows[windows[-1][1]]["rank_share"]
                    results.append(entry)
                    print(json.dumps(entry), flush=True)
    finally:
        cluster.down()
    summary = []
    for factor in args.factors:
        def median(split):
            return statistics.median(r["step_s"] for r in results if r["factor"] == factor and r["split"] == split)
        speeds = [statistics.median(col) for col in zip(*(r["speeds"] for r in results
                                                         if r["factor"] == factor and r["split"] == "speed"))]
        equal, balanced = median("equal"), median("speed")
        ideal = sum(speeds) / (len(speeds) * min(speeds))
        dealt = Deal.equal(len(speeds), args.accumulation).step_time(speeds) / \
            Deal.from_speeds(speeds, args.accumulation).step_time(speeds)
        summary.append({"factor": factor, "measured_slow_rank_speed": speeds[-1], "equal_step_s": equal,
                        "balanced_step_s": balanced, "speedup": equal / balanced, "ideal_speedup": ideal,
                        "dealable_speedup": dealt, "of_ideal": equal / balanced / ideal})
    unslowed = statistics.median(r["step_s"] for r in results if r["factor"] == 1)
    print(f"\n{args.model}, {args.hosts} hosts × 1 rank, micro-batch {args.micro_batch} × accumulation "
          f"{args.accumulation}; no rank slowed: {unslowed:.3f} s a step\n")
    print("| slowed × | slow rank's measured speed | equal s/step | balanced s/step | speed-up | ideal | "
          "at whole micro-batches | of ideal |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for s in summary:
        print(f"| {s['factor']:g} | {s['measured_slow_rank_speed']:.3f} | {s['equal_step_s']:.3f} | "
              f"{s['balanced_step_s']:.3f} | {s['speedup']:.2f}× | {s['ideal_speedup']:.2f}× | "
              f"{s['dealable_speedup']:.2f}× | {s['of_ideal']:.0%} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "current_rate"},
                                               "unslowed_step_s": unslowed, "summary": summary,
                                               "runs": results}, indent=1))


if __name__ == "__main__":
    main()
