"""One Markdown table from bert-finetune --json results, a task per row: the pretrained
model's median (min–max) over seeds beside random initialisation and the majority class.

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
    lines = ["| task | metric | dev | pretrained | random init | majority | seeds |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['task']} | {r['metric']} | {r['dev_size']} | {cell(r)} | {cell(r.get('random_init'))} | "
                     f"{100 * r['majority']['value']:.1f} | {len(r['per_seed'])} |")
    models = sorted({r["model"] for r in results})
    return "\n".join(lines) + f"\n\nmedian (min–max) over seeds, in %; model: {', '.join(models)}"


def main(argv: list[str] | None = None) -> None:
    paths = [Path(p) for p in (argv if argv is not None else sys.argv[1:])]
    if not paths:
        print("usage: python -m commodity_bert.finetune.table RESULT.json...", file=sys.stderr)
        raise SystemExit(2)
    print(table([json.loads(p.read_text()) for p in paths]))


if __name__ == "__main__":
    main()
