"""results.md and the plots of an ablation, from the rows of results.json."""
from __future__ import annotations

from pathlib import Path
from statistics import median


def by_variant(results: list[dict]) -> dict[str, list[dict]]:
    groups: dict[str, list[dict]] = {}
    for r in results:
        groups.setdefault(r["variant"], []).append(r)
    return groups


def spread(values: list[float]) -> tuple[float, float, float] | None:
    return (median(values), min(values), max(values)) if values else None


def _pct(x) -> str:
    return "–" if x is None else f"{100 * x:.2f}"


def _bytes(x) -> str:
    if x is None:
        return "–"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(x) >= size:
            return f"{x / size:.2f} {unit}"
    return f"{x:.0f} B"


def comparison(ref: tuple | None, mine: tuple | None, seeds_ref: int, seeds_mine: int) -> str:
    """The median's difference from the reference, and whether it lies inside the seed spread
    (the two variants' min–max ranges overlap): such a difference is not shown by this many seeds."""
    if ref is None or mine is None:
        return "–"
    delta = 100 * (mine[0] - ref[0])
    if min(seeds_ref, seeds_mine) < 2:
        return f"{delta:+.2f} (1 seed: spread unknown)"
    overlap = mine[1] <= ref[2] and ref[1] <= mine[2]
    return f"{delta:+.2f} ({'inside the seed spread' if overlap else 'outside the seed spread'})"


def markdown(results: list[dict], settings: dict, variants: dict[str, dict]) -> str:
    groups = by_variant(results)
    order = [name for name in variants if name in groups]
    finished = {n: [r for r in groups[n] if r["status"] == "finished"] for n in order}
    stats = {n: spread([r["final_val_mlm_acc"] for r in finished[n] if r["final_val_mlm_acc"] is not None])
             for n in order}
    reference = next((n for n in order if stats[n]), None)
    budget = f"{settings['samples']:,} samples" if settings.get("samples") else f"{settings['minutes']:g} minutes"
    where = f"hostfile {settings['hostfile']}" if settings.get("hostfile") else f"{settings['ranks']} ranks"
    lines = [f"# Ablation: {len(order)} variants, model {settings['model']}, {budget} each, {where}",
             "",
             (f"Data `{settings['data']}`. Accuracy is validation MLM accuracy in percent: median over the "
              f"finished seeds (min–max). Δ is against `{reference}`; a Δ inside the seed spread (the ranges "
              f"overlap) is not established by these seeds. Bytes are what one rank sent in training's "
              f"collectives, whole run. Seconds exclude evaluation."),
             ""]
    has_downstream = any(r.get("downstream") for r in results)
    target = settings.get("target")
    header = ["variant", "changes", "seeds", "final acc", "Δ final", "best acc", "samples", "train s", "seq/s",
              "bytes/step", "total bytes"]
    if target is not None:
        header.append(f"samples to {100 * target:.1f}%")
    if has_downstream:
        header.append("downstream")
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name in order:
        done = finished[name]
        s = stats[name]
        acc = "–" if s is None else f"{_pct(s[0])} ({_pct(s[1])}–{_pct(s[2])})"
        best = spread([r["best_val_mlm_acc"] for r in done if r["best_val_mlm_acc"] is not None])
        changes = ", ".join(f"{k}={v}" for k, v in variants[name].get("changes", {}).items()) or \
            Path(variants[name].get("source", "")).name
        delta = "reference" if name == reference else comparison(stats[reference] if reference else None, s,
                                                                  len(finished.get(reference, [])), len(done))

        def med(key, fmt, done=done):
            values = [r[key] for r in done if r.get(key) is not None]
            return fmt(median(values)) if values else "–"

        seeds = f"{len(done)}/{len(groups[name])}"
        row = [f"`{name}`", changes, seeds, acc, delta, "–" if best is None else _pct(best[0]),
               med("samples", lambda x: f"{x:,.0f}"), med("train_s", lambda x: f"{x:,.0f}"),
               med("seq_per_s", lambda x: f"{x:.1f}"), med("bytes_per_step", _bytes), med("total_bytes", _bytes)]
        if target is not None:
            reached = [r["samples_to_target"] for r in done if r.get("samples_to_target") is not None]
            row.append(f"{median(reached):,.0f} ({len(reached)}/{len(done)} reached)" if reached else
                       f"not reached ({len(done)} runs)")
        if has_downstream:
            scores = [r["downstream"]["median"] for r in done if r.get("downstream")]
            metric = next((r["downstream"]["metric"] for r in done if r.get("downstream")), "")
            bow = [r["downstream"]["bag_of_words"] for r in done if (r.get("downstream") or {}).get("bag_of_words")]
            frozen = [r["downstream"]["linear_probe"] for r in done
                      if (r.get("downstream") or {}).get("linear_probe") is not None]
            row.append((f"{metric} {_pct(median(scores))} ({_pct(min(scores))}–{_pct(max(scores))})" if scores
                        else "–") + (f"; bag of words {_pct(median(bow))}" if bow else "")
                       + (f"; linear probe {_pct(median(frozen))}" if frozen else "") + other_tasks(done))
        lines.append("| " + " | ".join(row) + " |")
    problems = [r for r in results if r["status"] != "finished"]
    if problems:
        lines += ["", "Runs not finished:", ""]
        lines += [f"- `{r['variant']}` seed {r['seed']}: {r['status']}" + (f" — {r['error']}" if r.get("error") else "")
                  for r in problems]
    lines += ["", "Each run's command is in `commands.sh`; its RUN directory is under `runs/`."]
    return "\n".join(lines) + "\n"


def other_tasks(done: list[dict]) -> str:
    """The downstream tasks after the first (bert-ablate --downstream A B C): each one's metric,
    median over the finished seeds."""
    first = next((r["downstream"]["task"] for r in done if r.get("downstream")), None)
    scores: dict[str, list] = {}
    for r in done:
        for task, result in (r.get("downstream_tasks") or {}).items():
            if task != first and result.get("median") is not None:
                scores.setdefault(f"{task} {result['metric']}", []).append(result["median"])
    return "".join(f"; {name} {_pct(median(values))}" for name, values in scores.items())


def plots(results: list[dict], out_dir: Path) -> list[Path]:
    """curves.png (accuracy against samples and time, loss against samples), and bytes.png when
    the variants' bytes differ. One colour per variant, one line per seed."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = by_variant([r for r in results if r.get("curve") or r.get("loss_curve")])
    if not groups:
        return []
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    colour_of = {name: colours[i % len(colours)] for i, name in enumerate(groups)}
    fig, axes = plt.subplots(1, 3, figsize=(17, 5))
    for name, runs in groups.items():
        colour = colour_of[name]
        for j, r in enumerate(runs):
            label = name if j == 0 else None
            curve = r.get("curve") or []
            axes[0].plot([p["samples"] for p in curve], [100 * p["val_mlm_acc"] for p in curve],
                         color=colour, label=label, marker=".")
            axes[1].plot([p["elapsed_s"] / 60 for p in curve if p.get("elapsed_s") is not None],
                         [100 * p["val_mlm_acc"] for p in curve if p.get("elapsed_s") is not None],
                         color=colour, label=label, marker=".")
            losses = r.get("loss_curve") or []
            axes[2].plot([p["samples"] for p in losses], [p["loss"] for p in losses], color=colour, label=label)
    for ax, (x, y) in zip(axes, (("samples", "validation MLM accuracy (%)"),
                                 ("training minutes (evaluation excluded)", "validation MLM accuracy (%)"),
                                 ("samples", "training loss"))):
        ax.set_xlabel(x)
        ax.set_ylabel(y)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    written = [out_dir / "curves.png"]
    fig.savefig(written[0], dpi=110)
    plt.close(fig)

    finished = {name: [r for r in runs if r["status"] == "finished"] for name, runs in groups.items()}
    totals = {name: median([r["total_bytes"] for r in runs]) for name, runs in finished.items() if runs}
    bytes_plot = out_dir / "bytes.png"
    bytes_plot.unlink(missing_ok=True)  # an earlier plot may show runs that had not finished
    if len(set(totals.values())) > 1:
        fig, axes = plt.subplots(1, 2, figsize=(13, 5))
        names = list(totals)
        axes[0].barh(names, [totals[n] / 1e9 for n in names],
                     color=[colour_of[n] for n in names])
        axes[0].set_xlabel("bytes one rank sent, whole run (GB, median over seeds)")
        for name, runs in finished.items():
            if not runs:
                continue
            r = runs[0]
            cumulative, previous, xs, ys = 0.0, 0, [], []
            for p in r.get("loss_curve") or []:
                cumulative += (p.get("bytes_sent") or 0) * (p["step"] - previous)
                previous = p["step"]
                xs.append(p["samples"])
                ys.append(cumulative / 1e9)
            axes[1].plot(xs, ys, color=colour_of[name], label=name)
        axes[1].set_xlabel("samples")
        axes[1].set_ylabel("bytes sent so far (GB, first seed)")
        axes[1].legend(fontsize=7)
        axes[1].grid(alpha=0.3)
        fig.tight_layout()
        written.append(bytes_plot)
        fig.savefig(bytes_plot, dpi=110)
        plt.close(fig)
    return written
