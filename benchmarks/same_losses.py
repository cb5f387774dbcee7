"""Does a change to the training code leave training bit for bit as it was?

Runs train.py from two checkouts (`--before`, e.g. a `git worktree` of the last commit, and
`--after`, this one) on the same shards, seed and ranks, once per shipped CPU config in
ds_configs/ (and the bf16 variants of the communication modes, whose DeepSpeed wrapper takes
other paths), and compares every logged step's loss, gradient norm, loss scale and MLM accuracy
and the final validation figures as exact floats. A refactor that claims "behaviour unchanged"
shows it here.

    python benchmarks/same_losses.py --before /tmp/before --after . --data SHARDS \
        [--steps 30] [--only NAME ...] [--json OUT]

SHARDS: any seq-64 (or longer) shards made by bert-data-prep; `tiny` is the model for every
config (the mini configs too: the question is the code path, not the size). Exit status 1 when
any config differs, naming the first step and field that do.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_common import REPO, cpu_name, free_port

FIELDS = ("loss", "mlm_acc", "grad_norm", "loss_scale", "lr", "val_mlm_acc", "val_loss")


def variants(steps: int) -> dict[str, dict]:
    """name -> the DeepSpeed config to run: every shipped CPU config, then the communication
    modes under bf16 (DeepSpeed's FP16_UnfusedOptimizer wrapper), then accumulation."""
    out = {}
    for path in sorted((REPO / "ds_configs").glob("cpu_*.json")):
        out[path.stem] = json.loads(path.read_text())
    for name in ("cpu_tiny_lamb", "cpu_tiny_diloco_lamb", "cpu_tiny_lamb_bucketwise_clip", "cpu_tiny_onebit_lamb",
                 "cpu_tiny_zero_one_adam"):
        out[f"{name}+bf16"] = {**out[name], "bf16": {"enabled": True}}
    out["cpu_tiny_lamb+accumulation2"] = {**out["cpu_tiny_lamb"], "gradient_accumulation_steps": 2,
                                          "train_micro_batch_size_per_gpu": 16}
    for config in out.values():  # the schedules of the run, whatever the config was written for
        params = config.get("scheduler", {}).get("params", {})
        if "total_num_steps" in params:
            params.update(total_num_steps=steps, warmup_num_steps=max(1, steps // 5))
    return out


def run(checkout: Path, config: dict, data: Path, steps: int, work: Path) -> list[dict]:
    work.mkdir(parents=True, exist_ok=True)
    (work / "ds_config.json").write_text(json.dumps(config))
    deepspeed = Path(sys.executable).parent / "deepspeed"
    command = [str(deepspeed), "--num_gpus", "2", "--master_port", str(free_port()), "train.py",
               "--deepspeed_config", str(work / "ds_config.json"), "--model", "tiny", "--data", str(data),
               "--output-dir", str(work / "run"), "--max-steps", str(steps), "--log-every", "1",
               "--eval-every", str(steps // 2), "--num-workers", "1", "--seed", "3", "--resume", "none",
               "--save-every-minutes", "0"]
    proc = subprocess.run(command, cwd=checkout, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"same_losses.py: error: train.py in {checkout} failed ({proc.returncode}):\n"
                         f"{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return [json.loads(line) for line in (work / "run" / "metrics.jsonl").read_text().splitlines()]


def first_difference(before: list[dict], after: list[dict]) -> str | None:
    if len(before) != len(after):
        return f"{len(before)} metrics rows before, {len(after)} after"
    for b, a in zip(before, after):
        for field in FIELDS:
            if b.get(field) != a.get(field):
                return f"step {b['step']}: {field} {b.get(field)!r} before, {a.get(field)!r} after"
    return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", type=Path, required=True, help="the checkout to compare against")
    p.add_argument("--after", type=Path, default=REPO)
    p.add_argument("--data", type=Path, required=True)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--only", nargs="+", help="these variants only (names as printed)")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    for checkout in (args.before, args.after):
        if not (checkout / "train.py").is_file():
            p.error(f"{checkout} has no train.py: give a checkout of this repository")
    chosen = variants(args.steps)
    if args.only:
        unknown = sorted(set(args.only) - set(chosen))
        if unknown:
            p.error(f"--only {' '.join(unknown)}: not a variant; the variants are {', '.join(chosen)}")
        chosen = {k: v for k, v in chosen.items() if k in args.only}
    results, started = [], time.time()
    with tempfile.TemporaryDirectory(prefix="same_losses_") as tmp:
        for name, config in chosen.items():
            rows = {side: run(checkout, config, args.data, args.steps, Path(tmp) / name / side)
                    for side, checkout in (("before", args.before), ("after", args.after))}
            difference = first_difference(rows["before"], rows["after"])
            final = rows["after"][-1]
            results.append({"variant": name, "identical": difference is None, "difference": difference,
                            "steps": args.steps, "final_loss": final.get("loss"),
                            "val_mlm_acc": final.get("val_mlm_acc")})
            print(f"{name:34s} {'identical' if difference is None else 'DIFFERS: ' + difference}"
                  f"  (loss at step {final['step']}: {final.get('loss')!r})", flush=True)
    report = {"benchmark": "same_losses", "before": str(args.before.resolve()), "after": str(args.after.resolve()),
              "data": str(args.data), "steps": args.steps, "ranks": 2, "model": "tiny", "seed": 3,
              "cpu": cpu_name(), "wall_s": round(time.time() - started, 1),
              "results": results}
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0 if all(r["identical"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
