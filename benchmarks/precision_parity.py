"""bf16 against fp32 through train.py: the same run in each precision, several times, on real
text, through DeepSpeed's launcher (bf16 goes through DeepSpeed's FP16_UnfusedOptimizer
wrapper with the project's LAMB, as fp16 does on a GPU). Prints per precision the median
sequences/s, the training loss at each logged step (median over repeats) and the largest
difference from fp32, and the final validation accuracy.

    python benchmarks/precision_parity.py [--model mini] [--steps 40] [--ranks 1] [--repeats 3] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))  # site-packages may hold another `benchmarks`
from bench_common import free_port, make_shards

BASE_CONFIG = REPO / "ds_configs" / "cpu_tiny_lamb.json"


def run_once(work: Path, data: Path, precision: str, args, repeat: int) -> dict:
    config = json.loads(BASE_CONFIG.read_text())
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    config_path = work / f"{precision}.json"
    config_path.write_text(json.dumps(config))
    out = work / f"{precision}_{repeat}"
    cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", str(args.ranks), "--master_port",
           str(free_port()), "train.py", "--deepspeed_config", str(config_path), "--data", str(data),
           "--model", args.model, "--output-dir", str(out), "--max-steps", str(args.steps),
           "--log-every", str(args.log_every), "--num-workers", "1", "--resume", "none"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "loss" in r]
    return {"precision": precision, "repeat": repeat,
            "loss": {r["step"]: r["loss"] for r in trained},
            "grad_norm": {r["step"]: r["grad_norm"] for r in trained},
            "seq_per_s": statistics.median(r["seq_per_s"] for r in trained[1:] or trained),
            "val_mlm_acc": next(r["val_mlm_acc"] for r in reversed(rows) if "val_mlm_acc" in r)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="mini")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16"])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data = make_shards(work / "data", "embedded:sotu", 128, "--dupe-factor", "1", "--num-shards", "4",
                           "--val-fraction", "0.02")
        runs = [run_once(work, data, p, args, r) for r in range(args.repeats) for p in args.precisions]
    summary = {}
    for precision in args.precisions:
        mine = [r for r in runs if r["precision"] == precision]
        steps = sorted(mine[0]["loss"])
        summary[precision] = {
            "seq_per_s_median": statistics.median(r["seq_per_s"] for r in mine),
            "seq_per_s_all": [r["seq_per_s"] for r in mine],
            "loss_median": {s: statistics.median(r["loss"][s] for r in mine) for s in steps},
            "val_mlm_acc_median": statistics.median(r["val_mlm_acc"] for r in mine)}
    reference = summary[args.precisions[0]]
    print(f"{args.model}, {args.steps} steps, {args.ranks} rank(s), {args.repeats} repeats; "
          f"{platform.processor() or platform.machine()}")
    print("| precision | seq/s (median; all) | loss at " + " / ".join(str(s) for s in reference["loss_median"])
          + " | max |Δ loss| vs " + args.precisions[0] + " | val MLM acc |")
    print("|---|---|---|---:|---:|")
    for precision, row in summary.items():
        losses = row["loss_median"]
        delta = max(abs(losses[s] - reference["loss_median"][s]) for s in losses)
        row["max_abs_loss_difference"] = delta
        print(f"| {precision} | {row['seq_per_s_median']:.1f} ({', '.join(f'{v:.1f}' for v in row['seq_per_s_all'])})"
              f" | {' / '.join(f'{v:.4f}' for v in losses.values())} | {delta:.4f} | {row['val_mlm_acc_median']:.2%} |")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                         "machine": platform.platform(), "runs": runs, "summary": summary},
                                        indent=1))


if __name__ == "__main__":
    main()
