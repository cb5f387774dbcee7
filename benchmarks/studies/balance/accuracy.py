"""Does a balanced run learn as the equal split does? The quickstart's recipe (tiny, bf16 LAMB,
seq-64 MLM) on 2 ranks, micro-batch 16 × accumulation 2, 300 steps (the schedule sized to
them), seeds 1-3: the equal split, and the same micro-batches dealt 1 : 3 (rank 1 trains three
of the step's four: `"balance": {"split": "speed", "speeds": [1, 3]}`). Validation MLM accuracy
at the end, each run's and the medians; the balanced runs should fall within the equal runs'
spread (their steps are the same up to the order of the sums and dropout's draws).

    python benchmarks/studies/balance/accuracy.py --data WORK/data/seq64 [--json OUT]

(--data: the quickstart's shards, `bash recipes/quickstart.sh` makes them.)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def config(balanced: bool, steps: int) -> dict:
    recipe = json.loads((REPO / "ds_configs" / "cpu_quickstart_lamb_bf16.json").read_text())
    recipe.update({"train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": 2})
    recipe["scheduler"]["params"].update({"total_num_steps": steps, "warmup_num_steps": steps // 10})
    if balanced:
        recipe["commodity_bert"] = {"balance": {"split": "speed", "speeds": [1, 3]}}
    return recipe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--work")
    parser.add_argument("--json")
    args = parser.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="balance_accuracy_"))
    work.mkdir(parents=True, exist_ok=True)
    runs = []
    for seed in args.seeds:
        for split in ("equal", "balanced"):
            name = f"{split}_seed{seed}"
            path = work / f"{name}.json"
            path.write_text(json.dumps(config(split == "balanced", args.steps)))
            run = work / name
            cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2", "--master_port", "29721",
                   "train.py", "--deepspeed_config", str(path), "--model", "tiny", "--data", args.data,
                   "--output-dir", str(run), "--max-steps", str(args.steps), "--seed", str(seed),
                   "--log-every", "50", "--num-workers", "1", "--save-every-minutes", "0", "--resume", "none"]
            with open(work / f"{name}.log", "w") as log:
                subprocess.run(cmd, cwd=REPO, check=True, stdout=log, stderr=subprocess.STDOUT,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
            summary = json.loads((run / "summary.json").read_text())
            runs.append({"split": split, "seed": seed, "val_mlm_acc": summary["val_mlm_acc"],
                         "val_loss": summary["val_loss"], "trained_s": summary["trained_s"]})
            print(json.dumps(runs[-1]), flush=True)
    result = {"args": vars(args), "runs": runs}
    for split in ("equal", "balanced"):
        accs = [r["val_mlm_acc"] for r in runs if r["split"] == split]
        result[split] = {"median": statistics.median(accs), "min": min(accs), "max": max(accs)}
        print(f"{split}: validation MLM accuracy {statistics.median(accs):.4f} [{min(accs):.4f}–{max(accs):.4f}]")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
