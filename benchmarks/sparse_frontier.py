"""The frontier of DiLoCo's compressions: masked-LM accuracy below LAMB against the bytes a worker
sends over the run, from bert-ablate's results (benchmarks/studies/sparse_diloco/run.sh), one
point per variant (the median of its seeds), one line per compression.

    python benchmarks/sparse_frontier.py ABL/results.json [...] --json OUT --plot OUT.png [--markdown OUT.md]

Beside each sparse point, the share of the pending update (Δ plus the residual) its rounds sent,
the median of its rows' `sparse_sent_share` over the run's second half: where it is low, most of
the ranks' progress waits in their residuals, and the density, not the rounds, holds the shared
model back.

The baseline is each ablation's LAMB variant (its 16-bit gradient allreduce at every step, ring
bytes as the metrics count them) at the same samples and seeds; bytes are the metrics' whole-run
`bytes_sent` of one worker (values, offsets, scales, every hop).
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path


def setting(variant: str) -> dict:
    """compression, H, density and bits from bert-ablate's variant name (its --vary keys)."""
    keys = dict(re.findall(r"(compression|inner_steps|density|value_bits)=([^_]+(?:\.\d+)?)", variant))
    if not variant.startswith("diloco"):
        return {"compression": "LAMB"}
    compression = keys.get("compression", "none")
    out = {"compression": compression, "inner_steps": int(keys.get("inner_steps", 50))}
    if compression == "sparse":
        out.update(density=float(keys.get("density", 0.01)), value_bits=int(keys.get("value_bits", 2)))
    return out


def label(s: dict) -> str:
    if s["compression"] == "sparse":
        return f"sparse {s['density']:.1%} {s['value_bits']}-bit"
    return s["compression"]


def sent_share(run_dir: Path) -> float | None:
    """The median of the run's logged `sparse_sent_share` over its second half (None where the run
    logged none: another compression, or a run from before the metric). Of a variant's seeds, the
    first whose run directory is at hand: rows carried from another machine's results have none."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    shares = [r["sparse_sent_share"] for r in rows if r.get("sparse_sent_share") is not None
              and r["step"] > rows[-1]["step"] / 2]
    return statistics.median(shares) if shares else None


def points(paths: list[Path]) -> list[dict]:
    runs = [r for p in paths for r in json.loads(p.read_text()) if r.get("status") == "finished"]
    by_variant: dict[str, list[dict]] = {}
    for r in runs:
        by_variant.setdefault(r["variant"], []).append(r)
    lamb = [r for v, rs in by_variant.items() if not v.startswith("diloco") for r in rs]
    if not lamb:
        raise SystemExit("no finished LAMB run among the results: the frontier is measured against it")
    lamb_acc = statistics.median(r["final_val_mlm_acc"] for r in lamb)
    lamb_bytes = statistics.median(r["total_bytes"] for r in lamb)
    out = []
    for variant, rs in sorted(by_variant.items()):
        s = setting(variant)
        acc = statistics.median(r["final_val_mlm_acc"] for r in rs)
        sent = statistics.median(r["total_bytes"] for r in rs)
        kept = [Path(r["run_dir"]) for r in rs if r.get("run_dir") and (Path(r["run_dir"]) / "metrics.jsonl").exists()]
        out.append({"variant": variant, **s, "label": label(s), "seeds": sorted(r["seed"] for r in rs),
                    "val_mlm_acc": acc, "accs": [r["final_val_mlm_acc"] for r in rs],
                    "gap_points": 100 * (lamb_acc - acc), "bytes_sent": sent, "fewer_bytes_than_lamb": lamb_bytes / sent,
                    "steps": rs[0]["steps"],
                    "sent_share": sent_share(kept[0]) if s["compression"] == "sparse" and kept else None})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", type=Path)
    parser.add_argument("--json")
    parser.add_argument("--plot")
    parser.add_argument("--markdown")
    args = parser.parse_args()
    rows = points(args.results)
    lines = ["| compression | H | val MLM acc | below LAMB (points) | LAMB's bytes ÷ this | sent share | seeds |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for r in sorted(rows, key=lambda r: r["fewer_bytes_than_lamb"]):
        share = f"{r['sent_share']:.0%}" if r["sent_share"] is not None else ""
        lines.append(f"| {r['label']} | {r.get('inner_steps', 1)} | {r['val_mlm_acc']:.2%} | {r['gap_points']:.2f} | "
                     f"{r['fewer_bytes_than_lamb']:,.0f}× | {share} | {', '.join(map(str, r['seeds']))} |")
    table = "\n".join(lines)
    print(table)
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps({"results": [str(p) for p in args.results], "points": rows}, indent=1))
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for name in sorted({r["label"] for r in rows if r["compression"] != "LAMB"}):
            line = sorted((r for r in rows if r["label"] == name), key=lambda r: r["fewer_bytes_than_lamb"])
            # the bar: the seeds' spread, each seed against LAMB's median
            below = [100 * (max(r["accs"]) - r["val_mlm_acc"]) for r in line]
            above = [100 * (r["val_mlm_acc"] - min(r["accs"])) for r in line]
            ax.errorbar([r["fewer_bytes_than_lamb"] for r in line], [r["gap_points"] for r in line],
                        yerr=[below, above], fmt="o-", capsize=3, label=name)
            for r in line:
                ax.annotate(f"H={r['inner_steps']}", (r["fewer_bytes_than_lamb"], r["gap_points"]), fontsize=7,
                            textcoords="offset points", xytext=(4, 3))
        ax.axhline(0, color="grey", lw=0.8)
        ax.axhline(0.3, color="grey", lw=0.8, ls="--")  # the goal: ≥ 1,000× at ≤ 0.3 point below LAMB
        ax.axvline(1000, color="grey", lw=0.8, ls=":")
        ax.set_xscale("log")
        ax.set_xlabel("LAMB's bytes ÷ the variant's (one worker, whole run)")
        ax.set_ylabel("val MLM accuracy below LAMB (points)")
        ax.legend(fontsize=8)
        ax.set_title(f"DiLoCo's compressions against LAMB, {rows[0]['steps']} steps")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)


if __name__ == "__main__":
    main()
