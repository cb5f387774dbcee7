"""What the link costs on GPU-class compute, on paper: BERT-base's recipe (phases 1 and 2) on 8
nodes of 4 GPUs of RTX 3090 and A100 class, at 1 Gbit/s, 100 Mbit/s + 20 ms and 20 Mbit/s + 50 ms
a hop, for LAMB, 1-bit LAMB, DiLoCo with int4 pseudo-gradients (the shipped `diloco_int4` configs,
H = 112) and with sparse ones (the shipped `diloco_sparse` configs): `bert-plan estimate` by hand,
days and the share of the step spent communicating (inside the nodes too: at 200 Gbit/s, a small
part of it).

    python benchmarks/plan_gpu_class.py [--mfu 0.35] [--json OUT] [--markdown OUT.md]

A step on these GPUs is ~100× shorter than on the CPU ranks the study measures, so a round's
bytes that hide behind a CPU's inner steps may not hide here; the planner's step model is the one
checked against the namespace runs (benchmarks/slow_links_timing.py). The GPUs' rates are the
dense bf16 tensor-core peaks with fp32 accumulation of bert-plan's card table (plan/memory.py:
RTX 3090 71 TFLOP/s, A100 312) at an assumed MFU, not a measurement.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from commodity_bert.plan.memory import GPUS as CARDS  # noqa: E402
CONFIGS = REPO / "ds_configs"
GPUS = {"RTX 3090": CARDS["3090"].tflops, "A100": CARDS["a100-80"].tflops}
LINKS = [("1gbit", 0.05), ("100mbit", 20.0), ("20mbit", 50.0)]
MODES = {  # name: (bert-plan --optimizer, the config of each phase)
    "LAMB": ("lamb", "lamb_bf16"),
    "1-bit LAMB": ("onebit_lamb", "onebit_lamb_bf16"),
    "DiLoCo int4": ("diloco", "diloco_int4_lamb_bf16"),
    "DiLoCo sparse": ("diloco", "diloco_sparse_lamb_bf16"),
}


def estimate(tflops: float, mfu: float, link: str, latency_ms: float, nodes: int, gpus_per_node: int,
             optimizer: str, config: Path, seq_len: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        subprocess.run([sys.executable, "-m", "commodity_bert.plan", "estimate", "--gpu-tflops", str(tflops),
                        "--mfu", str(mfu), "--link", link, "--latency-ms", str(latency_ms), "--nodes", str(nodes),
                        "--gpus-per-node", str(gpus_per_node), "--model", "base", "--config", str(config),
                        "--seq-len", str(seq_len), "--optimizer", optimizer, "--json", str(out)],
                       check=True, cwd=REPO, capture_output=True, text=True)
        (row,) = json.loads(out.read_text())
        return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mfu", type=float, default=0.35)
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--gpus-per-node", type=int, default=4)
    parser.add_argument("--json")
    parser.add_argument("--markdown")
    args = parser.parse_args()
    rows = []
    for gpu, tflops in GPUS.items():
        for link, latency_ms in LINKS:
            for mode, (optimizer, kind) in MODES.items():
                phases = [estimate(tflops, args.mfu, link, latency_ms, args.nodes, args.gpus_per_node, optimizer,
                                   CONFIGS / f"bert_base_{phase}_{kind}.json", seq_len)
                          for phase, seq_len in (("phase1", 128), ("phase2", 512))]
                days = sum(p["days"] for p in phases)
                rows.append({"gpu": gpu, "gpu_tflops": tflops, "mfu": args.mfu, "link": link, "latency_ms": latency_ms,
                             "mode": mode, "days": days,
                             "link_share": sum(p["days"] * p["comm_s"] / p["step_s"] for p in phases) / days,
                             "bytes_per_rank": sum(p["bytes_per_rank"] for p in phases),
                             "phases": [{k: p[k] for k in ("step_s", "comm_s", "bytes_per_rank", "days")}
                                        for p in phases]})
    lamb = {(r["gpu"], r["link"]): r for r in rows if r["mode"] == "LAMB"}
    title = f"BERT-base recipe (phases 1 + 2), {args.nodes} nodes × {args.gpus_per_node} GPUs, MFU {args.mfu:g} assumed"
    lines = [title, "",
             "| GPU | link | mode | days | LAMB's days ÷ this | communication's share of the step |",
             "|---|---|---|---:|---:|---:|"]
    for r in rows:
        ref = lamb[(r["gpu"], r["link"])]
        lines.append(f"| {r['gpu']} | {r['link']} + {r['latency_ms']:g} ms | {r['mode']} | {r['days']:.2f} | "
                     f"{ref['days'] / r['days']:.2f}× | {r['link_share']:.1%} |")
    table = "\n".join(lines)
    print(table)
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
