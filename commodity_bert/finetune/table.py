"""One Markdown table from bert-finetune --json results, a task per row (any family): the
pretrained model's median (min–max) over seeds and its chosen lr, beside random initialisation,
the family's baseline that needs no model (bag of words, sliding window, majority tag), the
linear probe on frozen features (pretrained / random init) and the majority class, where the
family has them.

    python -m commodity_bert.finetune.table RUN/downstream/*.json
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from commodity_bert.finetune import evaluation  # noqa: F401  (every family registers itself)
from commodity_bert.finetune.families import DEFAULT, FAMILIES


def cell(row: dict | None) -> str:
    if not row:
        return "–"
    return f"{100 * row['median']:.1f} ({100 * row['min']:.1f}–{100 * row['max']:.1f})"


def model_free(r: dict) -> str:
    """The family's baseline that needs no model (classification: the bag of words; QA: the
    sliding window; tagging: the majority tag)."""
    family = FAMILIES.get(r.get("family", DEFAULT))
    baseline = family.no_model_baseline(r) if family else None
    return f"{100 * baseline[0]:.1f} ({baseline[1]})" if baseline else "–"


def table(results: list[dict]) -> str:
    lines = ["| task | family | metric | dev | pretrained | lr | random init | lr | no-model baseline | linear probe "
             "| majority | seeds |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        rand = r.get("random_init")
        probe = r.get("linear_probe")
        probe_cell = (f"{100 * probe['pretrained']['value']:.1f} / {100 * probe['random_init']['value']:.1f}"
                      if probe else "–")
        majority = f"{100 * r['majority']['value']:.1f}" if r.get("majority") else "–"
        metric = r["metric"] + (f" (exact match {100 * r['exact_match']['median']:.1f})"
                                if isinstance(r.get("exact_match"), dict) else "")
        lines.append(f"| {r['task']} | {r.get('family', DEFAULT)} | {metric} | {r['dev_size']} | {cell(r)} | "
                     f"{lr(r)} | {cell(rand)} | {lr(rand)} | {model_free(r)} | {probe_cell} | {majority} | "
                     f"{len(r['per_seed'])} |")
    models = sorted({r["model"] for r in results})
    notes = [f"{r['task']}: the pretrained model's representations look collapsed" for r in results
             if (r.get("representations") or {}).get("collapsed")]
    return "\n".join(lines) + (f"\n\nmedian (min–max) over seeds, in %; lr: the rate chosen on a held-out slice of "
                               f"the training data (or given); no-model baseline: bag of words (classification), "
                               f"sliding window (extractive QA, F1), each word's majority tag (tagging, entity F1); "
                               f"linear probe: logistic regression on the frozen mean-pooled features, pretrained / "
                               f"random init; model: {', '.join(models)}") + \
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
