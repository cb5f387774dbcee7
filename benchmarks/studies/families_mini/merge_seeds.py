"""Join `bert-finetune --json` results of the same task and settings, each run with other
seeds, into the one result a single call with all the seeds would have written (per-seed rows
concatenated, median/min/max recomputed for both arms). Why: a long fine-tuning split by seed
runs on two one-thread queues side by side.

    python merge_seeds.py seed1.json seed2.json seed3.json --output merged.json
"""
import argparse
import json
from pathlib import Path

from commodity_bert.finetune.trainer import summarise  # what bert-finetune summarises its seeds with

IGNORED = {"per_seed", "median", "min", "max", "exact_match", "seconds"}  # recomputed below


def merged_arm(arms: list[dict]) -> dict:
    rows = sorted((row for arm in arms for row in arm["per_seed"]), key=lambda row: row["seed"])
    out = {key: value for key, value in arms[0].items() if key not in IGNORED}
    out.update(summarise(rows))
    if all("exact_match" in row for row in rows):  # QA's second metric, as evaluation.evaluate writes it
        out["exact_match"] = {k: v for k, v in summarise([{"value": row["exact_match"]} for row in rows]).items()
                              if k != "per_seed"}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", type=Path)
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args()
    results = [json.loads(path.read_text()) for path in args.results]
    same = {"task", "family", "metric", "model", "hyperparameters", "train_size", "dev_size"}
    for key in same:
        if any(r.get(key) != results[0].get(key) for r in results):
            raise SystemExit(f"merge_seeds: {key} differs between the results; merge only runs of one setting")
    merged = merged_arm(results)
    merged["seconds"] = round(sum(r["seconds"] for r in results), 1)
    if all(r.get("random_init") for r in results):
        merged["random_init"] = merged_arm([r["random_init"] for r in results])
    merged["merged_from"] = [path.name for path in args.results]
    tmp = args.output.with_suffix(".tmp")
    tmp.write_text(json.dumps(merged, indent=1))
    tmp.rename(args.output)
    print(f"{args.output}: {merged['task']} {merged['metric']} median {merged['median']:.4f} over seeds "
          f"{[row['seed'] for row in merged['per_seed']]}")


if __name__ == "__main__":
    main()
