"""One Markdown table from bert-finetune --json results, a task per row: the pretrained
model's median (min–max) over seeds and its chosen lr, beside random initialisation, a
bag-of-words logistic regression, the linear probe on frozen features (pretrained / random
init) and the majority class.

    python -m commodity_bert.finetune.table RUN/downstream/*.json
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def cell(row: dict | None) -> str:
    if not row:
        return "–"
    return f"{100 * row['median']:.1f} ({100 * row['min']:.1f}–{100 * row['max']:.1f})"


def table(results: list[dict]) -> str:
    lines = ["| task | metric | dev | pretrained | lr | random init | lr | bag of words | linear probe | majority "
             "| seeds |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        rand = r.get("random_init")
        bow = r.get("bag_of_words")
        bow_cell = f"{100 * bow['value']:.1f}" if bow else "–"
        probe = r.get("linear_probe")
        probe_cell = (f"{100 * probe['pretrained']['value']:.1f} / {100 * probe['random_init']['value']:.1f}"
                      if probe else "–")
        lines.append(f"| {r['task']} | {r['metric']} | {r['dev_size']} | {cell(r)} | {lr(r)} | {cell(rand)} | "
                     f"{lr(rand)} | {bow_cell} | {probe_cell} | "
                     f"{100 * r['majority']['value']:.1f} | {len(r['per_seed'])} |")
    models = sorted({r["model"] for r in results})
    notes = [f"{r['task']}: the pretrained model's representations look collapsed" for r in results
             if (r.get("representations") or {}).get("collapsed")]
    return "\n".join(lines) + (f"\n\nmedian (min–max) over seeds, in %; lr: the rate chosen on a held-out slice of "
                               f"the training data (or given); linear probe: logistic regression on the frozen "
                               f"mean-pooled features, pretrained / random init; model: {', '.join(models)}") + \
        "".join(f"\n\nwarning: {n}" for n in notes)


def lr(row: dict | None) -> str:
    if not row or row.get("lr") is None:
        return "–"
    return f"{row['lr']:g}"


def main(argv: list[str] | None = None) -> None:
    paths = [Path(p) for p in (argv if argv is not None else sys.argv[1:])]
    if not paths:
        print("usage: python -m commodity_bert.finetune.table RESULT.json...", file=sys.stderr)
        raise SystemExit(2)
    print(table([json.loads(p.read_text()) for p in paths]))


if __name__ == "__main__":
    main()
