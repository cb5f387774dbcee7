"""The slow-links study: wall time to LAMB's final validation accuracy (or `--target`), per mode and link.

Which step each accuracy run first reached LAMB's final accuracy (the median over LAMB's seeds)
comes from its evaluations (bert-ablate's results.json, every 25 steps). What those steps cost
on a link comes from bert-plan's step model, fed by the preflight profile that
benchmarks/slow_links_timing.py measured on the namespace cluster at that link (the same JSON
holds the model's predictions beside measured step times), for the accuracy runs' own workload:
mini, seq 128, global batch 64 split over the cluster's hosts, their precision and schedules,
step by step (a DiLoCo round's inner steps, 0/1 Adam's local steps and syncs, 1-bit LAMB before
and after its freeze). `--added-latency-ms` adds a one-way delay per ring hop to the measured
link: the test hosts' kernels have no netem, so delayed links are modelled, not measured.

    python benchmarks/studies/slow_links/time_to_accuracy.py --ablation ABL --timing TIMING.json
        [--added-latency-ms 0 20] [--json OUT] [--markdown OUT.md]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))
from commodity_bert.optim import build  # noqa: E402,F401  (the optimizers register themselves)
from commodity_bert.optim.registry import registered  # noqa: E402
from commodity_bert.plan import estimate as e  # noqa: E402
from commodity_bert.plan.step_model import step_estimates  # noqa: E402

GLOBAL_BATCH = 64
VOCAB = 8192


def mode_of(config: dict) -> str:
    if "diloco" in config.get("commodity_bert", {}):
        return "diloco"
    plan = registered(config["optimizer"]["type"]).plan
    return plan.name if plan else "lamb"


def seconds_per_step(profile: dict, config: dict, hosts: int, steps: int, latency_ms: float,
                     gpu_tflops: float | None = None) -> list[float]:
    """Each step's predicted seconds, steps 1 … steps, for `config` on `hosts` hosts of one rank
    (with `gpu_tflops`, compute by hand at 35% MFU instead of this CPU cluster's)."""
    mode = mode_of(config)
    config = {**config, "train_batch_size": GLOBAL_BATCH, "train_micro_batch_size_per_gpu": GLOBAL_BATCH // hosts}
    compute = e.hand_compute(gpu_tflops, e.DEFAULT_MFU) if gpu_tflops else e.compute_from_profile(profile)
    net = e.network_from_profile(profile, None, None, None)
    net.latency_s += latency_ms / 1000
    work = e.workload(mode, config, "mini", 128, compute, VOCAB, steps, None, world_hint=hosts,
                      log_every=0, optimizer=mode)
    per_step, _ = step_estimates(work, mode, hosts, 1, net)
    return [est.step_s for est in per_step]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ablation", type=Path, required=True, help="bert-ablate's directory (results.json, configs/)")
    parser.add_argument("--timing", type=Path, required=True, help="benchmarks/slow_links_timing.py's --json")
    parser.add_argument("--added-latency-ms", type=float, nargs="+", default=[0.0, 20.0])
    parser.add_argument("--target", type=float, help="an accuracy (0-1) instead of LAMB's final one")
    parser.add_argument("--gpu-tflops", type=float,
                        help="compute by hand, a GPU of this peak at 35%% MFU, instead of the CPU cluster's "
                             "(the links stay as measured): where a GPU cluster's balance lies")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args()
    runs = [r for r in json.loads((args.ablation / "results.json").read_text()) if r["status"] == "finished"]
    timing = json.loads(args.timing.read_text())
    hosts = timing["args"]["hosts"]
    target = args.target or statistics.median(r["final_val_mlm_acc"] for r in runs if r["variant"] == "lamb")
    rows = []
    for link, profile in timing["profiles"].items():
        for added in args.added_latency_ms:
            for run in runs:
                config = json.loads((args.ablation / "configs" / f"{run['variant']}.json").read_text())
                per_step = seconds_per_step(profile, config, hosts, run["max_steps"], added, args.gpu_tflops)
                reached = next((p["step"] for p in run["curve"] if p["val_mlm_acc"] >= target), None)
                rows.append({"link": link, "added_latency_ms": added, "variant": run["variant"],
                             "seed": run["seed"], "final": run["final_val_mlm_acc"], "best": run["best_val_mlm_acc"],
                             "total_bytes": run["total_bytes"], "step_reached": reached,
                             "seconds_to_target": sum(per_step[:reached]) if reached else None,
                             "seconds_whole_run": sum(per_step)})
    table = summarize(rows, target, hosts) + (f"\n\ncompute: by hand, {args.gpu_tflops:g} TFLOP/s × MFU "
                                              f"{e.DEFAULT_MFU}" if args.gpu_tflops else "")
    print(table)
    if args.markdown:
        args.markdown.write_text(table + "\n")
    if args.json:
        args.json.write_text(json.dumps({"target_val_mlm_acc": target, "hosts": hosts, "gpu_tflops": args.gpu_tflops,
                                         "rows": rows}, indent=1))


def summarize(rows: list[dict], target: float, hosts: int) -> str:
    """Per link and variant: medians over seeds (a seed that never reached the target counts as never)."""
    lines = [f"target validation MLM accuracy: {100 * target:.2f}%; "
             f"{hosts} hosts of one rank; seconds from bert-plan's model of each link", "",
             "| link | added latency | variant | seeds reaching it | step reached (median) | s to reach (median) "
             "| whole run s |", "|---|---:|---|---:|---:|---:|---:|"]
    keys = sorted({(r["link"], r["added_latency_ms"], r["variant"]) for r in rows})
    for link, added, variant in keys:
        mine = [r for r in rows if (r["link"], r["added_latency_ms"], r["variant"]) == (link, added, variant)]
        reached = [r for r in mine if r["step_reached"] is not None]
        step = statistics.median(r["step_reached"] for r in reached) if len(reached) == len(mine) else None
        seconds = statistics.median(r["seconds_to_target"] for r in reached) if len(reached) == len(mine) else None
        lines.append(f"| {link} | {added:g} ms | {variant} | {len(reached)}/{len(mine)} | "
                     f"{'never' if step is None else f'{step:g}'} | {'-' if seconds is None else f'{seconds:,.0f}'} | "
                     f"{statistics.median(r['seconds_whole_run'] for r in mine):,.0f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
