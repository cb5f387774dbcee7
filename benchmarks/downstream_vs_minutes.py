"""Downstream accuracy against pretraining minutes, train.py against the Hugging Face Trainer.

Fine-tunes every snapshot `benchmarks/vs_hf_trainer.py --snapshot-minutes ...` kept
(WORK/snapshots/{project,hf_trainer}_Mmin) on one task with `bert-finetune`, the same seeds
and hyperparameters for each, plus the same architecture from random initialisation and the
majority class; prints a table, writes JSON (every bert-finetune result object, whole) and a
PNG.

    python benchmarks/vs_hf_trainer.py --model mini --minutes 20 --snapshot-minutes 10 20 --work W
    python benchmarks/downstream_vs_minutes.py --work W [--task embedded:polarity] [--seeds 1 2 3 4 5]
        --json OUT.json --plot OUT.png
    # again for one side only, keeping the other side's rows and the baselines
    python benchmarks/downstream_vs_minutes.py --work W --reuse OUT.json --redo project --json NEW.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SNAPSHOT = re.compile(r"^(project|hf_trainer)_([0-9.]+)min$")


def finetune(model: Path, task: str, seeds: list[int], extra: list[str], random_init: bool) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "commodity_bert.finetune", "--model", str(model), "--task", task, "--seeds",
               *map(str, seeds), "--json", str(out), "--quiet", *extra, *(["--random-init"] if random_init else [])]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False)
        if proc.returncode:
            raise SystemExit(f"bert-finetune failed on {model}:\n{proc.stderr[-3000:]}")
        print(proc.stdout, flush=True)
        return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", required=True, type=Path, help="vs_hf_trainer.py's --work directory")
    parser.add_argument("--task", default="embedded:polarity")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    parser.add_argument("--extra", default="", help="more bert-finetune flags, one string")
    parser.add_argument("--reuse", type=Path, help="an earlier --json: keep its rows (and baselines) except "
                        "those of the sides named by --redo")
    parser.add_argument("--redo", nargs="*", default=[], choices=["project", "hf_trainer"])
    parser.add_argument("--newest-first", action="store_true", help="fine-tune the longest-trained snapshots first")
    parser.add_argument("--json", type=Path, help="written after every snapshot, so a cut-short run keeps its rows")
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()
    snapshots = sorted(((m.group(1), float(m.group(2)), p) for p in (args.work / "snapshots").iterdir()
                        if (m := SNAPSHOT.match(p.name))), key=lambda s: (s[0], -s[1] if args.newest_first else s[1]))
    if not snapshots:
        raise SystemExit(f"no snapshots in {args.work / 'snapshots'}; run vs_hf_trainer.py --snapshot-minutes first")
    earlier = json.loads(args.reuse.read_text()) if args.reuse else None
    rows = []
    for i, (side, minutes, path) in enumerate(snapshots):
        kept = [r for r in (earlier or {}).get("rows", []) if r["side"] == side and r["minutes"] == minutes]
        if kept and side not in args.redo:
            rows.append({**kept[0], "reused_from": str(args.reuse)})
            continue
        # the random-init baseline does not depend on the snapshot's weights: fine-tuned once
        result = finetune(path, args.task, args.seeds, args.extra.split(), random_init=i == 0 and not earlier)
        rows.append({"side": side, "minutes": minutes, "pretraining": json.loads((path / "pretraining.json").read_text()),
                     "result": result})
        if args.json:
            partial = {"task": args.task, "seeds": args.seeds, "rows": rows, "complete": False,
                       "baselines": earlier["baselines"] if earlier else None}
            args.json.write_text(json.dumps(partial, indent=1))
    if earlier:
        baselines = earlier["baselines"]
    else:
        first = rows[0]["result"]
        baselines = {"random_init": first["random_init"], "majority": first["majority"]}
    first = rows[0]["result"]
    machine = f"{platform.machine()}, {os.cpu_count()} cores"
    print(f"\n{args.task}, {first['metric']}, median of {len(args.seeds)} seeds (min–max); {machine}")
    print(f"{'pretraining':<28}{'median':>8}{'min':>8}{'max':>8}")
    for row in rows:
        r = row["result"]
        print(f"{row['side'] + ' ' + format(row['minutes'], 'g') + ' min':<28}{100 * r['median']:>7.1f}%"
              f"{100 * r['min']:>7.1f}%{100 * r['max']:>7.1f}%")
    ri = baselines["random_init"]
    print(f"{'random init':<28}{100 * ri['median']:>7.1f}%{100 * ri['min']:>7.1f}%{100 * ri['max']:>7.1f}%")
    print(f"{'majority':<28}{100 * baselines['majority']['value']:>7.1f}%")
    out = {"machine": machine, "task": args.task, "seeds": args.seeds, "work": str(args.work), "rows": rows,
           "baselines": baselines, "complete": True}
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6, 4))
        for side, label in (("project", "train.py (LAMB, unpadded)"), ("hf_trainer", "HF Trainer (AdamW)")):
            mine = [r for r in rows if r["side"] == side]
            ax.errorbar([r["minutes"] for r in mine], [100 * r["result"]["median"] for r in mine],
                        yerr=[[100 * (r["result"]["median"] - r["result"]["min"]) for r in mine],
                              [100 * (r["result"]["max"] - r["result"]["median"]) for r in mine]],
                        marker="o", capsize=3, label=label)
        ax.axhline(100 * ri["median"], color="gray", linestyle="--", linewidth=1, label="random init")
        ax.axhline(100 * baselines["majority"]["value"], color="gray", linestyle=":", linewidth=1, label="majority")
        ax.set_xlabel("pretraining minutes (CPU, 2 cores)")
        ax.set_ylabel(f"{args.task} dev {first['metric']} (%)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)


if __name__ == "__main__":
    main()
