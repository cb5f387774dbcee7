"""Part 4 of the plateau study, gathered: every run of WORK/shipped_* as bert-ablate recorded it
(results.json: curves, throughput) with what train.py's summary.json says of the plateau
(unigram_acc, on_plateau), one JSON list, and a table per model and corpus.

    python benchmarks/studies/plateau/collect.py WORK --json OUT.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/, for bench_common
from bench_common import cpu_name  # noqa: E402

from commodity_bert.train.plateau import FACTOR as PLATEAU_FACTOR  # noqa: E402 - train.py's own line


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("work", type=Path)
    p.add_argument("--json", type=Path, required=True)
    args = p.parse_args()
    rows = []
    for abl in sorted(args.work.glob("shipped_*")):
        _, model, corpus = abl.name.split("_", 2)
        if not (abl / "results.json").is_file():
            continue
        for row in json.loads((abl / "results.json").read_text()):
            summary = json.loads((Path(row["run_dir"]) / "summary.json").read_text())
            rows.append({"model": model, "corpus": corpus, **row, "unigram_acc": summary.get("unigram_acc"),
                         "on_plateau": summary.get("on_plateau"), "peak_rss_mb": summary.get("peak_rss_mb")})
    flags = Path("/proc/cpuinfo").read_text()
    machine = {"cpu": cpu_name(), "amx_bf16": "amx_bf16" in flags, "avx512_bf16": "avx512_bf16" in flags,
               "cores": len(os.sched_getaffinity(0))}
    tmp = args.json.with_name(args.json.name + ".tmp")
    tmp.write_text(json.dumps({"machine": machine, "runs": rows}, indent=1) + "\n")
    tmp.replace(args.json)
    print(f"machine: {machine}")
    print("| model | corpus | config | val MLM acc per seed | unigram | ratio (min) | off the plateau | left it at step | train s (median) |")
    print("|---|---|---|---|---:|---:|---|---|---:|")
    groups: dict[tuple, list] = {}
    for row in rows:
        groups.setdefault((row["model"], row["corpus"], row["variant"]), []).append(row)
    for (model, corpus, variant), runs in groups.items():
        accs = [r["final_val_mlm_acc"] for r in runs]
        unigram = runs[0]["unigram_acc"]
        off = sum(a >= PLATEAU_FACTOR * unigram for a in accs)
        left = [next((c["step"] for c in r["curve"] if c["val_mlm_acc"] >= PLATEAU_FACTOR * unigram), None)
                for r in runs]
        print(f"| `{model}` | {corpus} | {variant} | {' / '.join(f'{100 * a:.2f}' for a in accs)} "
              f"(seeds {', '.join(str(r['seed']) for r in runs)}) | {100 * unigram:.2f} | "
              f"{min(accs) / unigram:.2f} | {off} of {len(runs)} | {' / '.join(str(x) for x in left)} | "
              f"{statistics.median(r['train_s'] for r in runs):.0f} |")


if __name__ == "__main__":
    main()
