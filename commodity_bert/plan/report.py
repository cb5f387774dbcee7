"""Tables and the plot of bert-plan."""
from __future__ import annotations

from pathlib import Path


def table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    return "\n".join(lines)


def preflight_tables(profile: dict) -> str:
    ranks = profile["ranks"]
    parts = [f"preflight: {profile['world_size']} ranks on {profile['hosts']} hosts, {profile['backend']}, "
             f"{profile['precision']}; model {ranks[0]['model']} seq {ranks[0]['seq_len']} "
             f"micro-batch {ranks[0]['micro_batch']} ({ranks[0]['data']})", ""]
    parts.append(table(
        ["rank", "host", "address", "interface", "device", "matmul TFLOP/s", "fwd+bwd s", "optimizer s",
         "grad sync s", "1-bit LAMB step s", "model TFLOP/s"],
        [[str(r["rank"]), r["host"], r["address"], str(r["interface"]), r["device"][:40], f"{r['matmul_tflops']:.3g}",
          f"{r['forward_backward_s']:.4f}", f"{r['optimizer_s']:.4f}",
          f"{r.get('grad_sync_local_s', 0):.4f}", f"{r['onebit_optimizer_s']:.4f}",
          f"{r['model_tflops']:.3g}"] for r in ranks]))
    sweep = profile["allreduce"]
    if profile["world_size"] > 1:
        parts += ["", f"allreduce over {sweep['world']} ranks ({profile['backend']}):"]
        parts.append(table(["size MB", "seconds", "algbw Gbit/s", "busbw Gbit/s"],
                           [[f"{r['mb']:g}", f"{r['seconds']:.4f}", f"{r['algbw_gbit_s']:.3g}",
                             f"{r['busbw_gbit_s']:.3g}"] for r in sweep["sizes"]]))
        if sweep.get("fit"):
            fit = sweep["fit"]
            parts.append(f"fit: {fit['bus_gbit_s']:.3g} Gbit/s per rank, {fit['latency_s'] * 1e3:.3g} ms latency "
                         f"({fit['latency_per_hop_s'] * 1e6:.0f} µs per hop)")
        if sweep["skipped_mb"]:
            parts.append(f"skipped sizes (over --comm-budget-s at this bandwidth): "
                         f"{', '.join(f'{s:g}' for s in sweep['skipped_mb'])} MB")
    if profile["links"]:
        parts += ["", "host to host, one direction at a time as its receiver saw it:"]
        parts.append(table(["from", "to", "Mbit/s"],
                           [[r["from"], r["to"], f"{r['gbit_s'] * 1000:.0f}"] for r in profile["links"]]))
    return "\n".join(parts)


def money(value) -> str:
    return "-" if value is None else f"{value:,.0f}"


def estimate_table(rows: list[dict]) -> str:
    """One line a row; a `split` column where the rows price cards of unequal speed (--gpu)."""
    split = any("split" in r for r in rows)
    return table(["optimizer", *(["split"] if split else []), "nodes", "GPUs", "step s", "compute s", "comm s",
                  "seq/s", "efficiency", "days", "USD"],
                 [[r["optimizer"], *([r.get("split", "")] if split else []), str(r["nodes"]), str(r["gpus"]),
                   f"{r['step_s']:.3g}", f"{r['compute_s']:.3g}", f"{r['comm_s']:.3g}", f"{r['seq_per_s']:,.1f}",
                   f"{r['efficiency']:.0%}", f"{r['days']:.3g}", money(r["usd"])] for r in rows])


def estimate_plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with_cost = any(r["usd"] is not None for r in rows)
    fig, axes = plt.subplots(1, 2 if with_cost else 1, figsize=(11 if with_cost else 6, 4.2), squeeze=False)
    for optimizer in dict.fromkeys(r["optimizer"] for r in rows):
        mine = [r for r in rows if r["optimizer"] == optimizer]
        axes[0][0].plot([r["gpus"] for r in mine], [r["days"] for r in mine], marker="o", label=optimizer)
        if with_cost:
            axes[0][1].plot([r["gpus"] for r in mine], [r["usd"] for r in mine], marker="o", label=optimizer)
    axes[0][0].set_ylabel("days to finish")
    if with_cost:
        axes[0][1].set_ylabel("USD")
    for ax in axes[0]:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("GPUs")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    tmp.replace(path)
