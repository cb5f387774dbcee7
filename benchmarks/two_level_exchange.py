"""The two-level exchange (comm/topology.py) against the flat one, measured: 2 namespace hosts of
2 ranks each (hostfile slots=2), or of unequal ranks (`--slots 2,1`), the link rate-limited, 1-bit LAMB's compressed stage, 0/1 Adam's
1-bit steps and DiLoCo's int8 outer steps with `"hierarchy": {"enabled": false}` and with the
default (two levels on more than one node).

For each variant, `--repeats` runs of each exchange, alternating: the median step time of the
steady windows (the median over the runs in the table, each run's beside it), what a host's link sent per step
by the metrics (`node_bytes_sent`) and by node1's eth0, and bert-plan's step model for the same
exchange at the set rate (communication only: the compute of 4 ranks on 2 shared cores is not
a GPU node's).

    sudo python benchmarks/two_level_exchange.py [--link 100mbit] [--slots 2,1] [--json OUT] [--markdown OUT.md]

fp32, `mini`, micro-batch 2, as slow_links_timing.py's runs.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]
from slow_links_timing import config_of  # noqa: E402
from slow_network import one_thread_per_rank, run_variant, set_up  # noqa: E402
from tools.netns_cluster import Cluster  # noqa: E402

from commodity_bert.plan.step_model import Network, Workload, parse_rate, step_estimates  # noqa: E402

FREEZE = 4
VARIANTS = {  # variant: (config variant, planner optimizer and stage, steps, log every, first steady step)
    "onebit_lamb": ("onebit_lamb", ("onebit_lamb", "compressed"), 20, 2, FREEZE + 2),
    "zero_one_adam": ("zero_one_adam", ("zero_one_adam", "onebit"), 31, 10, 11),
    "diloco_int8_h10": ("diloco_h10", ("diloco", "outer"), 31, 10, 1),
}


def config(variant: str, micro_batch: int, levels: bool) -> dict:
    base, _, steps, _, _ = VARIANTS[variant]
    c = config_of(base, micro_batch, steps)
    if variant.startswith("diloco"):
        c["commodity_bert"]["diloco"]["compression"] = "int8"
    c.setdefault("commodity_bert", {})["hierarchy"] = {"enabled": "auto" if levels else False}
    return c


def planned(variant: str, params: int, rate: float, levels: bool, slots: tuple[int, ...]) -> dict:
    """bert-plan's communication at the set rate, per step over the same steady steps the
    measurement takes (0/1 Adam's schedule and DiLoCo's rounds as the configs above set them)."""
    optimizer, _ = VARIANTS[variant][1]
    _, _, steps, _, first = VARIANTS[variant]
    work = Workload(name=variant, params=params, global_batch=sum(slots) * 2, micro_batch=2, steps=steps,
                    grad_bytes=4, fb_s=0.0, optimizer_s=0.0, scale_block=256 if optimizer == "onebit_lamb" else 32,
                    schedule=dict(freeze_step=FREEZE, var_freeze_step=FREEZE, var_update_scaler=2,  # each reads its own
                                  local_step_scaler=2, local_step_clipper=5), inner_steps=10,
                    outer_compression="int8", hierarchy="auto" if levels else False)
    net = Network(link_bytes_per_s=rate, latency_s=0.0, intra_bytes_per_s=rate * 1000)  # shared memory
    per_node = slots if len(set(slots)) > 1 else slots[0]
    per_step, _ = step_estimates(work, optimizer, len(slots), per_node, net)
    steady = per_step[first - 1: steps - 1]
    return {"planned_comm_s": statistics.fmean(s.comm_s for s in steady)}


def parameters(model: str, data: Path) -> int:
    from commodity_bert.data.shard_format import load_manifest
    from commodity_bert.model.bert import build_config, build_model
    manifest = load_manifest(data)
    hf_model = build_model(build_config(model, manifest["vocab"]["size"]), nsp=manifest["nsp"])
    return sum(p.numel() for p in hf_model.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--link", default="100mbit")
    parser.add_argument("--slots", default="2,2", type=lambda v: tuple(int(n) for n in v.split(",")),
                        help="ranks on each host: 2,2 or unequal, 2,1")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--model", default="mini")
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each variant and exchange, alternating")
    parser.add_argument("--work")
    parser.add_argument("--json")
    parser.add_argument("--markdown")
    parser.add_argument("--from-json", help="tabulate this file's runs again (the plan recomputed) instead of running")
    args = parser.parse_args()
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        params = saved["args"].get("params") or parameters(saved["args"]["model"], Path(saved["args"]["work"]) / "seq128")
        args.params, args.slots = params, tuple(saved["args"].get("slots") or (2, 2))
        report(args, saved["runs"], params)
        return
    work, data = set_up("two_level_exchange.py", args.work)
    args.params = params = parameters(args.model, data)
    slots = list(args.slots) if len(set(args.slots)) > 1 else args.slots[0]
    cluster = Cluster.up(work / "cluster", len(args.slots), slots=slots, rate=args.link)
    one_thread_per_rank(cluster)
    runs = []
    try:
        for repeat in range(args.repeats):
            for variant in args.variants:
                for levels in (False, True):
                    _, _, steps, log_every, first = VARIANTS[variant]
                    args.steps, args.log_every, args.freeze_step = steps, log_every, FREEZE
                    args.current_rate = f"{args.link}_{'two_levels' if levels else 'flat'}_{repeat}"
                    measured = run_variant(cluster, data, work, f"{variant}_{'two' if levels else 'flat'}", args,
                                           config=config(variant, args.micro_batch, levels), first_steady=first,
                                           last_steady=steps - 1)
                    measured.pop("windows")
                    runs.append({**measured, "variant": variant, "levels": "two" if levels else "flat",
                                 "repeat": repeat, **planned(variant, params, parse_rate(args.link), levels, args.slots)})
                    print(json.dumps(runs[-1]), flush=True)
    finally:
        cluster.down()
    report(args, runs, params)


def slots_of(args) -> tuple[int, ...]:
    """The ranks on each host (files written before --slots: 2 hosts of 2)."""
    return tuple(getattr(args, "slots", None) or (2, 2))


def report(args, runs: list[dict], params: int) -> None:
    for r in runs:  # the plan as the current step model makes it
        r.update(planned(r["variant"], params, parse_rate(args.link), r["levels"] == "two", slots_of(args)))
    variants = list(dict.fromkeys(r["variant"] for r in runs))
    results = []  # per variant and exchange: the median over the repeats
    for variant in variants:
        for levels in ("flat", "two"):
            same = [r for r in runs if (r["variant"], r["levels"]) == (variant, levels)]
            results.append({**same[0], **{k: statistics.median(r[k] for r in same)
                                          for k in ("step_s", "node_bytes", "bytes_interface", "bytes_metrics")},
                            "step_s_runs": [r["step_s"] for r in same]})
    lines = ["| variant | exchange | s/step (median; runs) | node bytes/step (metrics) | node1 eth0 bytes/step |",
             "|---|---|---:|---:|---:|"]
    for r in results:
        each = ", ".join(f"{x:.3f}" for x in r["step_s_runs"])
        lines.append(f"| {r['variant']} | {r['levels']} | {r['step_s']:.3f} ({each}) | {r['node_bytes']:,.0f} | "
                     f"{r['bytes_interface']:,.0f} |")
    by = {(r["variant"], r["levels"]): r for r in results}
    lines += ["", "| variant | node bytes flat / two levels | s/step flat − two levels | planned comm s/step flat − two |",
              "|---|---:|---:|---:|"]
    for variant in variants:
        flat, two = by[(variant, "flat")], by[(variant, "two")]
        lines.append(f"| {variant} | {flat['node_bytes'] / two['node_bytes']:.2f} | "
                     f"{flat['step_s'] - two['step_s']:+.3f} | {flat['planned_comm_s'] - two['planned_comm_s']:+.3f} |")
    text = "\n".join(lines)
    print(f"\n{args.model}, fp32, micro-batch {args.micro_batch}, hosts of {list(slots_of(args))} ranks at {args.link}; "
          f"medians of the steady windows\n\n{text}")
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "current_rate"},
                                               "results": results, "runs": runs}, indent=1))

if __name__ == "__main__":
    main()
