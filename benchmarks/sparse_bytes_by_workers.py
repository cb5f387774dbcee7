"""Bytes over a run per worker for DiLoCo's sparse pseudo-gradient at 2, 4 and 8 workers, beside
dense int4 and LAMB: sparse payloads cannot be summed on the way, so each worker receives (and, in
the all-gather's ring, passes on) W − 1 of them and its bytes grow with W, where a ring allreduce's
stay near 2× the message.

Layouts (namespace hosts, tools/netns_cluster.py): 2 hosts × 1 rank, 4 × 1, and 4 × 2 (8 ranks:
fp32 inside a node, the compressed exchange between nodes, comm/topology.py). The bytes of a
round are fixed, so a few rounds suffice: DiLoCo runs H = 2 for 8 steps (rounds at 4, 6, 8
measured), LAMB 6 steps; read from the metrics (`bytes_sent`: a rank's; `node_bytes_sent`: what
a node's link sent to other nodes) and from node1's eth0, and set beside bert-plan's count for
the same exchange. Over a run: rounds × bytes a round against LAMB's steps × bytes a step (the
study's run: 1,000 steps, H = 20). bf16, `mini`, micro-batch 2, the slow-links study's data.

    sudo python benchmarks/sparse_bytes_by_workers.py --data WORK/seq128 [--layouts 2x1 4x1 4x2]
        [--run-steps 1000] [--inner-steps 20] [--work DIR] [--json OUT] [--markdown OUT.md]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]
from slow_links_timing import config_of  # noqa: E402
from slow_network import one_thread_per_rank, run_variant  # noqa: E402
from two_level_exchange import parameters  # noqa: E402

from commodity_bert.optim.registry import PlannedStep  # noqa: E402
from commodity_bert.plan.step_model import (Network, Workload, mode_step, planned_step,  # noqa: E402
                                             ring_allreduce_bytes, two_levels)
from tools.netns_cluster import Cluster, unavailable_reason  # noqa: E402

ROUND = 2  # H of the measured runs: every window of 2 steps holds one round
VARIANTS = {  # variant: (DiLoCo compression or None for LAMB, steps, log every)
    "lamb": (None, 6, 1),
    "diloco_sparse": ("sparse", 8, ROUND),
    "diloco_int4": ("int4", 8, ROUND),
}


def config(variant: str, micro_batch: int) -> dict:
    compression, steps, _ = VARIANTS[variant]
    c = config_of("lamb" if compression is None else "diloco_sparse_h10", micro_batch, steps)
    c["bf16"] = {"enabled": True}
    if compression:
        c["commodity_bert"]["diloco"].update(inner_steps=ROUND, compression=compression, error_feedback=True)
    return c


def planned_node_bytes(variant: str, params: int, hosts: int, slots: int) -> float:
    """bert-plan's bytes a node's link sends in one round (DiLoCo) or one step (LAMB's bf16
    allreduce). The planner counts a rank's bytes on the GPU path, where two levels reduce the
    node's fp32 buffer with collectives; CPU ranks share memory there (comm/topology.py), so that
    part is taken out and the node's slices added up."""
    compression = VARIANTS[variant][0]
    work = Workload(name=variant, params=params, global_batch=hosts * slots * 2, micro_batch=2, steps=2,
                    grad_bytes=2, fb_s=0.0, optimizer_s=0.0, inner_steps=ROUND,
                    outer_compression=compression or "none", density=0.01, value_bits=2, hierarchy="auto")
    net = Network(link_bytes_per_s=1e9)
    if compression is None:  # one flat ring: each node's link carries one hop, a rank's bytes
        return planned_step(work, PlannedStep(), hosts, slots, net).bytes_per_rank
    rank = mode_step(work, "diloco", "outer", hosts, slots, net).bytes_per_rank
    if not two_levels(work, hosts, slots):
        return rank
    return (rank - ring_allreduce_bytes(4.0 * params, slots)) * slots


def layout(text: str) -> tuple[int, int]:
    hosts, slots = text.split("x")
    return int(hosts), int(slots)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, help="the study's shards (benchmarks/studies/sotu_seq128.sh)")
    parser.add_argument("--layouts", nargs="+", default=["2x1", "4x1", "4x2"], help="HOSTSxRANKS each")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--run-steps", type=int, default=1000, help="the run the totals are for")
    parser.add_argument("--inner-steps", type=int, default=20, help="H of the run the totals are for")
    parser.add_argument("--model", default="mini")
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--work")
    parser.add_argument("--json")
    parser.add_argument("--markdown")
    parser.add_argument("--from-json", help="tabulate this file's runs again instead of running")
    args = parser.parse_args()
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        report(args, saved["runs"])
        return
    if reason := unavailable_reason():
        raise SystemExit(f"sparse_bytes_by_workers.py: {reason}")
    work = Path(args.work or tempfile.mkdtemp(prefix="sparse_bytes_by_workers_")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    data = Path(args.data).resolve()
    params = parameters(args.model, data)
    runs = []
    for hosts, slots in map(layout, args.layouts):
        cluster = Cluster.up(work / f"cluster_{hosts}x{slots}", hosts, slots=slots)
        one_thread_per_rank(cluster)
        try:
            for variant in args.variants:
                _, steps, log_every = VARIANTS[variant]
                args.steps, args.log_every, args.freeze_step, args.current_rate = steps, log_every, 0, "unlimited"
                measured = run_variant(cluster, data, work, variant, args, config=config(variant, args.micro_batch),
                                       first_steady=3)
                per = 1 if VARIANTS[variant][0] is None else ROUND  # steps a measured unit spans
                runs.append({"variant": variant, "hosts": hosts, "slots": slots, "workers": hosts * slots,
                             "params": params, "windows": measured["windows"],
                             "rank_bytes": measured["bytes_metrics"] * per,
                             "node_bytes": measured["node_bytes"] * per,
                             "eth0_bytes": measured["bytes_interface"] * per})
                print(json.dumps(runs[-1]), flush=True)
        finally:
            cluster.down()
    report(args, runs)


def report(args, runs: list[dict]) -> None:
    """Per layout: a round's (a step's) bytes, and over the run a node's link's bytes against LAMB's."""
    rounds = args.run_steps // args.inner_steps
    header = ("| workers (hosts × ranks) | exchange | rank bytes a round (metrics) | node link bytes a round "
              f"(metrics) | bert-plan | node1 eth0 | node link bytes over {args.run_steps:,} steps "
              f"(H = {args.inner_steps}) | fewer than LAMB |")
    lines = [header, "|---|---|---:|---:|---:|---:|---:|---:|"]
    rows = []
    for r in runs:
        r["planned_node_bytes"] = planned_node_bytes(r["variant"], r["params"], r["hosts"], r["slots"])
        total = r["node_bytes"] * (args.run_steps if r["variant"] == "lamb" else rounds)
        rows.append({**r, "run_node_bytes": total})
    for r in rows:
        lamb = next((x for x in rows if x["variant"] == "lamb" and (x["hosts"], x["slots"]) == (r["hosts"], r["slots"])),
                    None)
        r["fewer_than_lamb"] = lamb["run_node_bytes"] / r["run_node_bytes"] if lamb else None
        unit = "a step" if r["variant"] == "lamb" else "a round"
        lines.append(f"| {r['workers']} ({r['hosts']} × {r['slots']}) | {r['variant']} ({unit}) | {r['rank_bytes']:,.0f} | "
                     f"{r['node_bytes']:,.0f} | {r['planned_node_bytes']:,.0f} | {r['eth0_bytes']:,.0f} | "
                     f"{r['run_node_bytes']:,.0f} | " + (f"{r['fewer_than_lamb']:,.0f}×" if r["fewer_than_lamb"] else "") + " |")
    text = "\n".join(lines)
    print(f"\n{args.model}, bf16, micro-batch {args.micro_batch}; medians of the measured rounds (steps)\n\n{text}")
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "current_rate"},
                                               "runs": rows}, indent=1))


if __name__ == "__main__":
    main()
