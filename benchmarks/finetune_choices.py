"""Fine-tuning choices measured on one pretrained model: each --pooling (and any other
bert-finetune flags given as variants) on each task, the same seeds and --lr auto for every
variant. Prints a table; writes every bert-finetune result object, whole, to --json.

    python benchmarks/finetune_choices.py --model RUN --tasks embedded:party embedded:polarity \
        --variants "--pooling mean" "--pooling pooler" "--pooling cls" --seeds 1 2 3 --json OUT.json
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_common import REPO, cpu_name


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, type=Path)
    p.add_argument("--tasks", nargs="+", default=["embedded:party", "embedded:polarity"])
    p.add_argument("--variants", nargs="+", default=["--pooling mean", "--pooling pooler", "--pooling cls"])
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--extra", default="", help="bert-finetune flags for every variant, one string")
    p.add_argument("--random-init", action="store_true")
    p.add_argument("--json", type=Path, required=True)
    args = p.parse_args()
    results = []
    for task in args.tasks:
        for variant in args.variants:
            with tempfile.TemporaryDirectory() as tmp:
                out = Path(tmp) / "r.json"
                cmd = [sys.executable, "-m", "commodity_bert.finetune", "--model", str(args.model), "--task", task,
                       "--seeds", *map(str, args.seeds), "--quiet", "--json", str(out), *variant.split(),
                       *args.extra.split(), *(["--random-init"] if args.random_init else [])]
                proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False)
                if proc.returncode:
                    raise SystemExit(f"bert-finetune failed ({variant}, {task}):\n{proc.stderr[-3000:]}")
                print(proc.stdout, flush=True)
                results.append({"variant": variant, "result": json.loads(out.read_text())})
    print("| task | variant | pretrained median (min–max) | lr | bag of words |")
    print("|---|---|---|---|---|")
    for r in results:
        x = r["result"]
        print(f"| {x['task']} | `{r['variant']}` | {100 * x['median']:.1f} ({100 * x['min']:.1f}–{100 * x['max']:.1f}) "
              f"| {x['lr']:g} | {100 * x['bag_of_words']['value']:.1f} |")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"machine": {"cpu": cpu_name(), "cores": __import__("os").cpu_count()},
                                     "command": sys.argv, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
