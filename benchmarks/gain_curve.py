"""The pretraining gain curve: what a pretrained model buys downstream, by pretraining tokens and
by label count, against random init and a bag of words, from bert-finetune's JSON results.

Each input is one `bert-finetune --json` result (one model, one task, one --train-examples N,
several seeds, with --random-init, or without it where another input of the same task, rows, seeds
and recipe has that arm: random init is computed once per task and N). The model's processed tokens come from the result's
`pretraining` record (sequences × --seq-len); the label count from `train_size`. One table row
per (task, N, tokens): the pretrained median [min–max], random init's, the gain in points, the
frozen-feature probe beside random features', and the bag of words. The plot: one panel per
task, the gain (pretrained median − random-init median) against processed tokens, a line per
label count, min–max as error bars.

    python benchmarks/gain_curve.py results/gain_curve/*.json --table T.md --plot P.png --json OUT.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


# the fine-tuning settings two results must share for one's random-init arm to stand for the
# other's; a setting a result predates is read at today's default
SAME_RECIPE = {"epochs": None, "lr": None, "batch_size": None, "max_seq_len": None, "warmup_fraction": None,
               "weight_decay": None, "dropout": None, "max_grad_norm": None, "precision": None, "min_steps": None,
               "pooling": None, "reinit_layers": 0, "head_lr": None, "head_init": "fresh", "layer_lr_decay": 1.0,
               "steps": None}


def random_init_key(result: dict) -> str:
    """What a random-init arm depends on: the task, the rows (--train-examples and its draw), the
    seeds, the fine-tuning recipe. Random init does not depend on the pretrained model, so one
    arm per key is computed once and serves every model of the curve."""
    recipe = {k: result.get("hyperparameters", {}).get(k, default) for k, default in SAME_RECIPE.items()}
    selection = result.get("selection") or {}
    chosen = [selection.get("folds", 1)]  # --lr-folds: how the rate was chosen; and the length, where it was
    chosen += [selection["steps_grid"]] if selection.get("early_stopping") and selection.get("steps_grid") else []
    return json.dumps([result["task"], result.get("train_examples"), [s["seed"] for s in result["per_seed"]], recipe,
                       *chosen], sort_keys=True)


def load_rows(paths: list[Path], seq_len: int, random_init_from: Path | None = None) -> list[dict]:
    """One row per result. A result fine-tuned without --random-init takes the random-init arm
    (and random features' probe) of another input with the same task, rows, seeds and recipe,
    or, with `random_init_from`, that result's arm whatever its recipe (a curve whose points
    fine-tune at the rate and length the full run's own selection chose, beside random init at
    its own choice)."""
    results = {path: json.loads(path.read_text()) for path in paths}
    arms = {random_init_key(r): (path, r) for path, r in results.items() if r.get("random_init")}
    fixed = None
    if random_init_from:
        if not random_init_from.is_file():
            raise SystemExit(f"gain_curve.py: error: --random-init-from {random_init_from}: no such file")
        fixed = (random_init_from, json.loads(random_init_from.read_text()))
        if not fixed[1].get("random_init"):
            raise SystemExit(f"gain_curve.py: error: --random-init-from {random_init_from}: a result without a "
                             f"random-init arm; give one fine-tuned with --random-init")
        for path, result in results.items():
            if (result["task"], result.get("train_examples")) != (fixed[1]["task"], fixed[1].get("train_examples")):
                raise SystemExit(f"gain_curve.py: error: {path} is another task or label count than "
                                 f"--random-init-from {random_init_from}")
    rows = []
    for path, result in results.items():
        random_source, random_result = fixed or ((path, result) if result.get("random_init") else
                                                 arms.get(random_init_key(result), (None, None)))
        if random_result is None:
            raise SystemExit(f"gain_curve.py: error: {path} has no random-init arm and no other input has one for "
                             f"its task, rows, seeds and recipe; run bert-finetune with --random-init once for them")
        samples = (result.get("pretraining") or {}).get("samples")
        if not samples:
            raise SystemExit(f"gain_curve.py: error: {path}: its model records no pretraining samples "
                             f"(an exported RUN/hf_model or checkpoint has them)")
        random_init = random_result["random_init"]
        probe = {**(result.get("linear_probe") or {}),
                 "random_init": (random_result.get("linear_probe") or {}).get("random_init")}
        rows.append({
            "task": result["task"], "train_size": result["train_size"],
            "all_labels": result.get("train_examples") is None, "tokens": samples * seq_len,
            "pretrained": {k: result.get(k, result["per_seed"][0].get(k)) for k in ("median", "min", "max", "lr", "steps")},
            "random_init": {k: random_init.get(k, random_init["per_seed"][0].get(k))
                            for k in ("median", "min", "max", "lr", "steps")},
            "gain_points": round(100 * (result["median"] - random_init["median"]), 2),
            "above_random_max": result["median"] > random_init["max"],
            "probe": (probe.get("pretrained") or {}).get("value"),
            "random_probe": (probe.get("random_init") or {}).get("value"),
            "bag_of_words": result["bag_of_words"]["value"], "seeds": len(result["per_seed"]),
            "model": result["model"], "source": str(path), "random_init_source": str(random_source)})
    return sorted(rows, key=lambda r: (r["task"], r["train_size"], r["tokens"]))


def tokens_label(tokens: int) -> str:
    return f"{tokens / 1e9:.2g}B" if tokens >= 1e9 else f"{tokens / 1e6:.3g}M"


def table(rows: list[dict]) -> str:
    def pct(v: float) -> str:
        return f"{100 * v:.1f}"
    lines = [("| task | labels | tokens | pretrained median [min–max] (lr) | random init [min–max] (lr) | gain | "
              "probe: pretrained / random | bag of words |"), "|---|---:|---:|---|---|---:|---|---:|"]
    for r in rows:
        p, q = r["pretrained"], r["random_init"]
        probe = f"{pct(r['probe'])} / {pct(r['random_probe'])}" if r["probe"] is not None else "–"
        lines.append(f"| {r['task'].removeprefix('embedded:')} | {r['train_size']:,}{' (all)' if r['all_labels'] else ''} "
                     f"| {tokens_label(r['tokens'])} | {pct(p['median'])} [{pct(p['min'])}–{pct(p['max'])}] ({p['lr']:g}) "
                     f"| {pct(q['median'])} [{pct(q['min'])}–{pct(q['max'])}] ({q['lr']:g}) | {r['gain_points']:+.1f} "
                     f"| {probe} | {pct(r['bag_of_words'])} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    tasks = sorted({r["task"] for r in rows})
    fig, axes = plt.subplots(1, len(tasks), figsize=(5 * len(tasks), 3.8), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        for size in sorted({r["train_size"] for r in rows if r["task"] == task}):
            points = [r for r in rows if r["task"] == task and r["train_size"] == size]
            x = [r["tokens"] for r in points]
            y = [r["gain_points"] for r in points]
            low = [y_ - 100 * (r["pretrained"]["median"] - r["pretrained"]["min"]) for y_, r in zip(y, points)]
            high = [100 * (r["pretrained"]["max"] - r["pretrained"]["median"]) + y_ for y_, r in zip(y, points)]
            ax.errorbar(x, y, yerr=[[a - b for a, b in zip(y, low)], [b - a for a, b in zip(y, high)]], marker="o",
                        capsize=3, label=f"{size:,} labels")
        ax.axhline(0, color="gray", linewidth=1)
        ax.set_xscale("log")
        ax.set_xlabel("pretraining tokens processed")
        ax.set_ylabel("pretrained − random init (points, medians)")
        ax.set_title(task.removeprefix("embedded:"))
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", type=Path, help="bert-finetune --json results, one model/task/N each")
    parser.add_argument("--seq-len", type=int, default=128, help="the pretraining sequence length")
    parser.add_argument("--random-init-from", type=Path, metavar="RESULT",
                        help="take every row's random-init arm from this result (whatever its recipe)")
    parser.add_argument("--table", type=Path, help="write the Markdown table here")
    parser.add_argument("--plot", type=Path, help="write the PNG here")
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args(argv)
    missing = [str(p) for p in args.results if not p.is_file()]
    if missing:
        raise SystemExit(f"gain_curve.py: error: no such result file: {', '.join(missing)}")
    rows = load_rows(args.results, args.seq_len, args.random_init_from)
    text = table(rows)
    sys.stdout.write(text)
    if args.table:
        args.table.write_text(text)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
