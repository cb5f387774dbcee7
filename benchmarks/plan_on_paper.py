"""BERT-large on 16–256 commodity GPUs over 1, 10 and 25 Gbit/s Ethernet, LAMB against 1-bit
LAMB, on paper: `bert-plan estimate` by hand (no GPU was measured), one run per link and
freeze assumption, summarised in one table; then a second table of every mode's shipped recipe
(LAMB, 1-bit LAMB, 0/1 Adam, DiLoCo) per link and latency, with the DiLoCo settings of the streaming study (int4
at H = 112, and the same streamed in 4 fragments overlapped with 5 inner steps) beside them.

    python benchmarks/plan_on_paper.py [--gpu-tflops 125] [--mfu 0.35] [--gpus-per-node 4]
        [--json OUT] [--markdown OUT.md]

Two freeze assumptions for 1-bit LAMB's phase 1: the shipped config's "auto" rule counted at
its latest step (3,519 of 7,038), and DeepSpeed's tuned BERT-large setting, step 1,000 (phase 2
keeps its shipped 312 of 1,563 in both). And with and without train.py's logged gradient norm
(every 50 steps, as the recipes log), which costs an fp32 allreduce once 1-bit LAMB has frozen.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "ds_configs"


def estimate(args, link: str, optimizer: str, config: Path, seq_len: int, extra: list[str]) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        subprocess.run([sys.executable, "-m", "commodity_bert.plan", "estimate", "--gpu-tflops", str(args.gpu_tflops),
                        "--mfu", str(args.mfu), "--link", link, "--nodes", args.nodes, "--gpus-per-node",
                        str(args.gpus_per_node), "--model", "large", "--config", str(config), "--seq-len", str(seq_len),
                        "--optimizer", optimizer, "--usd-per-gpu-hour", str(args.usd_per_gpu_hour), "--json", str(out),
                        *extra], check=True, cwd=REPO, capture_output=True, text=True)
        return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpu-tflops", type=float, default=125.0, help="V100's fp16 tensor-core peak")
    parser.add_argument("--mfu", type=float, default=0.35)
    parser.add_argument("--gpus-per-node", type=int, default=4)
    parser.add_argument("--nodes", default="4,8,16,64")
    parser.add_argument("--links", nargs="+", default=["1gbit", "10gbit", "25gbit"])
    parser.add_argument("--latencies-ms", type=float, nargs="+", default=[0.05, 20.0],
                        help="per ring hop, for the modes table (a LAN; two sites joined over the internet)")
    parser.add_argument("--usd-per-gpu-hour", type=float, default=2.0)
    parser.add_argument("--json")
    parser.add_argument("--markdown")
    args = parser.parse_args()
    cases = {"auto (counted at 3,519)": [], "1,000 (DeepSpeed's)": ["--freeze-step", "1000"]}
    rows = []
    for link in args.links:
        for log_every in (50, 0):
            lamb = [estimate(args, link, "lamb", CONFIGS / f"bert_large_{p}_lamb_fp16.json", s,
                             ["--log-every", str(log_every)]) for p, s in (("phase1", 128), ("phase2", 512))]
            for freeze, extra in cases.items():
                onebit = [estimate(args, link, "onebit_lamb", CONFIGS / "bert_large_phase1_onebit_lamb_fp16.json", 128,
                                   [*extra, "--log-every", str(log_every)]),
                          estimate(args, link, "onebit_lamb", CONFIGS / "bert_large_phase2_onebit_lamb_fp16.json", 512,
                                   ["--log-every", str(log_every)])]
                for i, (l1, o1) in enumerate(zip(lamb[0], onebit[0])):
                    l2, o2 = lamb[1][i], onebit[1][i]
                    lamb_s = l1["days"] + l2["days"]
                    onebit_s = o1["days"] + o2["days"]
                    rows.append({
                        "link": link, "gpus": l1["gpus"], "nodes": l1["nodes"], "freeze": freeze,
                        "log_every": log_every, "lamb_days": lamb_s, "onebit_days": onebit_s,
                        "speedup": lamb_s / onebit_s, "lamb_efficiency": l1["efficiency"],
                        "onebit_efficiency": o1["efficiency"],
                        "lamb_step_s_phase1": l1["step_s"], "lamb_comm_s_phase1": l1["comm_s"],
                        "onebit_compressed_step_s_phase1": o1["phases"][0]["stages"]["compressed"]["step_s"],
                        "volume_ratio_phase1": l1["bytes_per_rank"] / o1["bytes_per_rank"],
                        "volume_ratio_recipe": (l1["bytes_per_rank"] + l2["bytes_per_rank"])
                        / (o1["bytes_per_rank"] + o2["bytes_per_rank"]),
                        "lamb_usd": l1["usd"] + l2["usd"], "onebit_usd": o1["usd"] + o2["usd"],
                        "rows": {"lamb": [l1, l2], "onebit_lamb": [o1, o2]}})
    lines = ["| link | GPUs | 1-bit freeze (phase 1) | grad-norm logging | LAMB days | 1-bit LAMB days | end-to-end speed-up "
             "| LAMB phase-1 step s (comm) | 1-bit compressed step s | volume ÷, phase 1 | volume ÷, recipe |",
             "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['link']} | {r['gpus']} | {r['freeze']} | {'every 50' if r['log_every'] else 'off'} | "
                     f"{r['lamb_days']:.2f} | {r['onebit_days']:.2f} | {r['speedup']:.2f}× | "
                     f"{r['lamb_step_s_phase1']:.2f} ({r['lamb_comm_s_phase1']:.2f}) | "
                     f"{r['onebit_compressed_step_s_phase1']:.2f} | {r['volume_ratio_phase1']:.2f}× | "
                     f"{r['volume_ratio_recipe']:.2f}× |")
    table = "\n".join(lines)
    print(f"BERT-large recipe, {args.gpus_per_node} GPUs per node at {args.gpu_tflops:g} TFLOP/s × MFU {args.mfu:g}\n")
    print(table)
    modes, modes_table = slow_link_modes(args)
    print("\nThe shipped recipes of each mode (--recipe), phases 1 + 2, logging every 50 steps\n")
    print(modes_table)
    if args.markdown:
        Path(args.markdown).write_text(table + "\n\n" + modes_table + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows, "modes": modes}, indent=1))


MODES = "lamb,onebit_lamb,zero_one_adam,diloco"
# the streaming study's settings, on paper: the shipped int4 DiLoCo recipe (H = 112, error feedback) as it is,
# and streamed (its block changed)
DERIVED = {
    "diloco_int4_h112": {},
    "streaming_diloco_int4_h112": {"fragments": 4, "overlap_steps": 5},
}


def derived_recipe(args, link: str, latency_ms: float, mode: str, block: dict) -> list[dict]:
    """The int4 DiLoCo recipe's two phases with `block` merged into their diloco blocks, estimated per
    phase (--config) and summed as --recipe sums them: days, USD and bytes add up; the
    communication share is the phases' weighted by their days."""
    per_gpus: dict[int, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for phase, seq_len in (("phase1", 128), ("phase2", 512)):
            config = json.loads((CONFIGS / f"bert_large_{phase}_diloco_int4_lamb_fp16.json").read_text())
            config["commodity_bert"]["diloco"].update(block)
            settings = config["commodity_bert"]["diloco"]
            path = Path(tmp) / f"{mode}_{phase}.json"
            path.write_text(json.dumps(config))
            for r in estimate(args, link, "diloco", path, seq_len, ["--latency-ms", str(latency_ms)]):
                per_gpus.setdefault(r["gpus"], []).append(r)
    rows = []
    for gpus, phases in per_gpus.items():
        days = sum(p["days"] for p in phases)
        share = sum(p["days"] * p["comm_s"] / p["step_s"] for p in phases) / days
        rows.append({"link": link, "latency_ms": latency_ms, "optimizer": mode, "nodes": phases[0]["nodes"],
                     "gpus": gpus, "days": days, "usd": sum(p["usd"] or 0 for p in phases) or None,
                     "bytes_per_rank": sum(p["bytes_per_rank"] for p in phases), "comm_share": share,
                     "settings": settings, "stages_phase1": phases[0]["phases"][0]["stages"]})
    return rows


def slow_link_modes(args) -> tuple[list[dict], str]:
    """Every mode's shipped recipe (the configs bert-plan --recipe reads), per link, latency and
    node count: days, bytes per rank and the share of the step spent communicating."""
    rows = []
    for link in args.links:
        for latency_ms in args.latencies_ms:
            with tempfile.TemporaryDirectory() as tmp:
                out = Path(tmp) / "rows.json"
                subprocess.run([sys.executable, "-m", "commodity_bert.plan", "estimate", "--gpu-tflops",
                                str(args.gpu_tflops), "--mfu", str(args.mfu), "--link", link, "--latency-ms",
                                str(latency_ms), "--nodes", args.nodes, "--gpus-per-node", str(args.gpus_per_node),
                                "--model", "large", "--recipe", "--optimizer", MODES, "--usd-per-gpu-hour",
                                str(args.usd_per_gpu_hour), "--json", str(out)],
                               check=True, cwd=REPO, capture_output=True, text=True)
                for r in json.loads(out.read_text()):
                    rows.append({"link": link, "latency_ms": latency_ms, **{k: v for k, v in r.items() if k != "phases"},
                                 "comm_share": r["comm_s"] / r["step_s"], "stages_phase1": r["phases"][0]["stages"]})
            for mode, block in DERIVED.items():
                rows += derived_recipe(args, link, latency_ms, mode, block)
    lamb = {(r["link"], r["latency_ms"], r["gpus"]): r for r in rows if r["optimizer"] == "lamb"}
    lines = ["| link | latency per hop | GPUs | mode | days | vs LAMB | comm share of step | bytes per rank | LAMB's ÷ this |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        ref = lamb[(r["link"], r["latency_ms"], r["gpus"])]
        lines.append(f"| {r['link']} | {r['latency_ms']:g} ms | {r['gpus']} | {r['optimizer']} | {r['days']:.2f} | "
                     f"{ref['days'] / r['days']:.2f}× | {r['comm_share']:.0%} | "
                     f"{r['bytes_per_rank'] / 1e12:.2f} TB | {ref['bytes_per_rank'] / r['bytes_per_rank']:.1f}× |")
    return rows, "\n".join(lines)


if __name__ == "__main__":
    main()
