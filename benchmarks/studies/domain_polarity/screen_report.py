"""The domain screen's table: each variant's polarity score at the screen's fixed setting beside
random init's, the gain, the frozen probe beside random features', and the run's validation MLM
accuracy (comparable only between variants with the same masking and length).

    python benchmarks/studies/domain_polarity/screen_report.py [RESULTS_DIR]
writes RESULTS_DIR/screen.md and screen.json (default benchmarks/results/domain_polarity).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def row(judged: dict, pretraining: dict) -> dict:
    probe = judged["linear_probe"]
    return {"median": judged["median"], "min": judged["min"], "max": judged["max"],
            "random_init": {k: judged["random_init"][k] for k in ("median", "min", "max")},
            "gain_points": 100 * (judged["median"] - judged["random_init"]["median"]),
            "probe": probe["pretrained"]["value"], "probe_random_init": probe["random_init"]["value"],
            "seeds": [s["seed"] for s in judged["per_seed"]], "lr": judged["lr"], "steps": judged["steps"],
            "val_mlm_acc": pretraining.get("val_mlm_acc"), "pretraining_samples": pretraining["samples"],
            "pretraining_s": pretraining["trained_s"]}


def main() -> None:
    results = Path(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/domain_polarity")
    rows = {}
    for path in sorted(results.glob("screen_*_pretraining.json")):
        variant = path.name[len("screen_"):-len("_pretraining.json")]
        rows[variant] = row(json.loads((results / f"screen_{variant}.json").read_text()), json.loads(path.read_text()))
    pct = lambda r: f"{100 * r['median']:.1f}% [{100 * r['min']:.1f}–{100 * r['max']:.1f}]"  # noqa: E731
    lines = ["| variant | pretrained | random init | gain | probe (random features) | val MLM | pretraining |",
             "|---|---|---|---|---|---|---|"]
    for variant, r in rows.items():
        lines.append(f"| {variant} | {pct(r)} | {pct(r['random_init'])} | {r['gain_points']:+.1f} | "
                     f"{100 * r['probe']:.1f}% ({100 * r['probe_random_init']:.1f}%) | "
                     f"{100 * (r['val_mlm_acc'] or 0):.1f}% | {r['pretraining_s'] / 60:.0f} min |")
    (results / "screen.md").write_text("\n".join(lines) + "\n")
    (results / "screen.json").write_text(json.dumps(rows, indent=1) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
