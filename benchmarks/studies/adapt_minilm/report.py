"""The adaptation study's table and plot, from its raw results.

    python benchmarks/studies/adapt_minilm/report.py [--collect WORK] [--results DIR]

--collect copies run.sh's results from WORK (the bert-finetune --json objects of screen/ and
judge/, and each continued-pretraining run's steps, time and validation MLM accuracy) into DIR
(default benchmarks/results/adapt_minilm), which is committed; the table (markdown, to stdout)
and DIR/screen.png are made from DIR alone. Random init (`mini`, the project's corpus vocabulary)
comes from the project's existing tables, named in REFERENCES.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
RESULTS = REPO / "benchmarks" / "results"
REFERENCES = {  # random-init `mini` at 1,000 labels, 3 seeds: the project's earlier tables
    "polarity": {"lr 1e-3": "gain_curve/cpu_mini_8M_polarity_1000_lr1e-3.json",
                 "--lr-folds 3": "gain_curve/cpu_mini_8M_polarity_1000_folds3.json"},
    "party": {"lr 1e-3": "small_budget/random_init_party_1000_lr1e-3.json"},
}


def collect(work: Path, out: Path) -> None:
    for stage in ("screen", "judge"):
        for path in sorted((work / stage).glob("*.json")):
            (out / stage).mkdir(parents=True, exist_ok=True)
            shutil.copy(path, out / stage / path.name)
    runs = {}
    for run in sorted((work / "runs").glob("*")):
        for export in sorted(run.glob("hf_model_*")):
            summary = json.loads((export / "summary.json").read_text())
            config = json.loads((run / "ds_config.json").read_text())
            runs[f"{run.name}_s{export.name.removeprefix('hf_model_')}"] = {
                "steps": summary["step"], "sequences": summary["samples"], "trained_s": round(summary["trained_s"], 1),
                "val_mlm_acc": summary.get("val_mlm_acc"), "devices": summary.get("devices"),
                "world_size": summary.get("world_size"), "ds_config": config}
    (out / "runs.json").write_text(json.dumps(runs, indent=1) + "\n")


def cell(result: dict) -> str:
    return f"{100 * result['median']:.1f}% [{100 * result['min']:.1f}–{100 * result['max']:.1f}]"


ARM = re.compile(r"(?P<text>.+?)_(?P<rate>[0-9.]+e-\d+)_warmup(?P<warmup>\d+)(?:_after_(?P<after>.+))?_s(?P<steps>\d+)$")


def describe(name: str) -> str:
    """imdb_1e-4_warmup50_s200 -> the text, rate, head warm-up and steps of that arm."""
    if name == "unadapted":
        return "all-MiniLM-L6-v2 as published"
    arm = ARM.match(name)
    if not arm:
        return name
    after = f" after {describe(arm['after'])}" if arm["after"] else ""
    return (f"{arm['text']}, AdamW {arm['rate']}, head warm-up {arm['warmup']}, {arm['steps']} steps{after}")


def cost(name: str, runs: dict) -> str:
    """Seconds of continued pretraining behind an arm (an arm run after another adds that one's),
    and its validation MLM accuracy."""
    run = runs.get(name)
    if not run or run.get("val_mlm_acc") is None:
        return ""
    arm = ARM.match(name)
    before = runs.get(arm["after"]) if arm and arm["after"] else None
    seconds = (f"{before['trained_s'] + run['trained_s']:.0f} s ({before['trained_s']:.0f} + {run['trained_s']:.0f})"
               if before else f"{run['trained_s']:.0f} s")
    return f"{seconds}, {100 * run['val_mlm_acc']:.1f}%"


def table(results: Path) -> str:
    runs = json.loads((results / "runs.json").read_text()) if (results / "runs.json").exists() else {}
    lines = []
    for stage, title in (("screen", "Screen: 1,000 labels, 3 seeds, fine-tuning rate 1e-4"),
                         ("judge", "Judged: 1,000 labels, 5 seeds, rate by --lr-folds 3")):
        found = sorted((results / stage).glob("*.json"))
        if not found:
            continue
        lines += [f"**{title}**", "", "| task | model | continued pretraining (s of the 2 cores, validation MLM) | accuracy, median "
                  "[min–max] | median − unadapted median | median − unadapted max | frozen probe | mean cosine | "
                  "bag of words |", "|---|---|---|---|---|---|---|---|---|"]
        for path in found:
            task, name = path.stem.split("_", 1)
            result = json.loads(path.read_text())
            base = results / stage / f"{task}_unadapted.json"
            probe = (result.get("linear_probe") or {}).get("pretrained", {}).get("value")
            cosine = (result.get("representations") or {}).get("mean_cosine")
            to_median = to_max = ""
            if base.exists() and name != "unadapted":
                unadapted = json.loads(base.read_text())
                to_median = f"{100 * (result['median'] - unadapted['median']):+.1f}"
                to_max = f"{100 * (result['median'] - unadapted['max']):+.1f}"
            lines.append(f"| {task} | {describe(name)} | {cost(name, runs)} | {cell(result)} | {to_median} | {to_max} | "
                         f"{'' if probe is None else f'{100 * probe:.1f}%'} | "
                         f"{'' if cosine is None else f'{cosine:.2f}'} | {100 * result['bag_of_words']['value']:.1f}% |")
        lines.append("")
    lines += ["**Random init** (`mini`, 1,000 labels, 3 seeds; earlier tables)", ""]
    for task, files in REFERENCES.items():
        for how, file in files.items():
            reference = json.loads((RESULTS / file).read_text())["random_init"]
            lines.append(f"- {task}, {how}: {cell(reference)} (`results/{file}`)")
    return "\n".join(lines)


def plot(results: Path) -> Path | None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    found = sorted((results / "screen").glob("*.json"))
    if not found:
        return None
    tasks = sorted({p.stem.split("_", 1)[0] for p in found})
    fig, axes = plt.subplots(1, len(tasks), figsize=(7 * len(tasks), 4.5), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        arms = [p for p in found if p.stem.startswith(task + "_")]
        arms.sort(key=lambda p: (p.stem != f"{task}_unadapted", p.stem))
        for x, path in enumerate(arms):
            result = json.loads(path.read_text())
            values = [100 * s["value"] for s in result["per_seed"]]
            ax.scatter([x] * len(values), values, color="C0" if x else "C1", s=18)
            ax.hlines(statistics.median(values), x - 0.3, x + 0.3, color="k")
        ax.set_xticks(range(len(arms)), [p.stem.split("_", 1)[1] for p in arms], rotation=35, ha="right", fontsize=7)
        ax.set_ylabel("dev accuracy (%), 1,000 labels")
        ax.set_title(f"embedded:{task}: adapted all-MiniLM-L6-v2 against the published one")
    fig.tight_layout()
    path = results / "screen.png"
    fig.savefig(path, dpi=110)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--collect", type=Path, help="run.sh's WORK directory to copy the raw results from")
    parser.add_argument("--results", type=Path, default=RESULTS / "adapt_minilm")
    args = parser.parse_args()
    if args.collect:
        collect(args.collect, args.results)
    print(table(args.results))
    if path := plot(args.results):
        print(f"\nplot: {path.relative_to(REPO)}")


if __name__ == "__main__":
    main()
