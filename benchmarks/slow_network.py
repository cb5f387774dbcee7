"""Step time, throughput and bytes on the wire across 1, 2 and 4 hosts, on unlimited and
rate-limited links, for LAMB, 1-bit LAMB and LAMB with bucket-wise clipping.

Hosts are network namespaces on this machine (tools/netns_cluster.py, needs root), one rank
each, launched through DeepSpeed's pdsh launcher from node1. Each host's egress is limited by
`tc` to the given rate, as a NIC would be. Bytes per step are read two ways and compared: from
the training metrics (`bytes_sent`, what rank 0's collectives sent) and from node1's eth0
counter (everything that left the host, TCP/IP headers included), sampled as each metrics row
appears. Weak scaling: the micro-batch per rank is fixed, so the global batch grows with hosts.

The defaults model a GPU cluster's balance on a CPU: a small micro-batch, so that
communication, not compute, dominates at 1 Gbit/s (the `mini` model's gradients are 45 MB in
fp32). `--model base` (440 MB) needs about 6 GB of RAM per rank under 1-bit LAMB: 4 hosts ran
out of memory on a 24 GB machine. All hosts share this machine's cores, so compute slows as
hosts are added; the table gives the unlimited-link step time of each setting beside the
limited one.

    sudo python benchmarks/slow_network.py [--hosts 1 2 4] [--rates unlimited 1gbit]
        [--variants lamb onebit_lamb lamb_bucketwise_clip] [--model mini] [--steps 12]
        [--work DIR] [--json OUT] [--markdown OUT.md] [--plot OUT.png]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VARIANTS = REPO / "benchmarks" / "studies" / "onebit_freeze"  # the accuracy study's configs
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]  # site-packages may hold another `benchmarks`
from tools.netns_cluster import Cluster, unavailable_reason


def variant_config(variant: str, micro_batch: int, steps: int, freeze_step: int) -> dict:
    """The accuracy study's variant (fp32 here), with this benchmark's micro-batch and freeze step."""
    config = json.loads((VARIANTS / f"{variant}.json").read_text())
    config.pop("bf16", None)
    config["scheduler"]["params"]["total_num_steps"] = 10 * steps  # long schedule: lr stays near its peak
    config["train_micro_batch_size_per_gpu"] = micro_batch
    config["scheduler"]["params"]["warmup_num_steps"] = steps
    if variant == "onebit_lamb":
        config["optimizer"]["params"]["freeze_step"] = freeze_step
    if variant == "lamb_bucketwise_clip":
        config["commodity_bert"]["bucketwise_clipping"]["bucket_mb"] = 25  # DeepSpeed's bucket size
    return config


def prepare_data(work: Path) -> Path:
    """Seq-128 shards of the embedded corpus in WORK/seq128, made once and reused."""
    data = work / "seq128"
    if not (data / "manifest.json").exists():
        subprocess.run([sys.executable, "-m", "data_prep", "shards", "--input", "embedded:sotu", "--seq-len", "128",
                        "--dupe-factor", "1", "--num-shards", "8", "--val-fraction", "0.01", "--output", str(data)],
                       cwd=REPO, check=True)
    return data


def set_up(script: str, work_arg: str | None) -> tuple[Path, Path]:
    """The namespace-cluster benchmarks' start: refuse in one line where no cluster can be built,
    then the work directory and the data in it."""
    reason = unavailable_reason()
    if reason:
        raise SystemExit(f"{script}: {reason}")
    work = Path(work_arg or tempfile.mkdtemp(prefix=f"{script.removesuffix('.py')}_")).resolve()
    return work, prepare_data(work)


def one_thread_per_rank(cluster: Cluster, threads: int = 1) -> None:
    """OMP_NUM_THREADS for every rank (the cluster gives each its share of the cores, at least
    one): several ranks of several threads each on 2 cores spend their time waiting for one another."""
    env_file = cluster.directory / "deepspeed_env"
    env_file.write_text(env_file.read_text().replace(f"OMP_NUM_THREADS={cluster.threads_per_rank}",
                                                     f"OMP_NUM_THREADS={threads}"))


def run_variant(cluster: Cluster, data: Path, work: Path, variant: str, args, config: dict | None = None,
                first_steady: int | None = None, last_steady: int | None = None) -> dict:
    """Train `variant` (or `config`) on the cluster; medians over the windows between metrics rows
    that lie wholly within the steady steps (`first_steady` … `last_steady`)."""
    config_path = work / f"{variant}.json"
    config = config or variant_config(variant, args.micro_batch, args.steps, args.freeze_step)
    config_path.write_text(json.dumps(config))
    slots = "" if cluster.slots == 1 else "x" + (str(cluster.slots) if isinstance(cluster.slots, int)
                                                 else "+".join(map(str, cluster.slots)))
    run = work / f"{variant}_{len(cluster.hosts)}hosts{slots}_{args.current_rate}"
    cmd = [*cluster.exec_prefix(0), str(Path(sys.executable).parent / "deepspeed"), "--hostfile",
           str(cluster.hostfile), "--master_port", "29700", "train.py", "--deepspeed_config", str(config_path),
           "--data", str(data), "--model", args.model, "--output-dir", str(run), "--max-steps", str(args.steps),
           "--log-every", str(getattr(args, "log_every", 1)), "--eval-every", "0", "--save-every", "0", "--save-every-minutes", "0",
           "--num-workers", "1", "--resume", "none", "--dist-timeout-minutes", "5"]
    log = open(work / f"{run.name}.log", "w")  # noqa: SIM115 - the launcher writes to it while we poll
    proc = subprocess.Popen(cmd, cwd=REPO, env=cluster.env, stdout=log, stderr=subprocess.STDOUT)
    metrics, samples = run / "metrics.jsonl", {}  # step → node1's eth0 tx bytes when its row appeared
    while proc.poll() is None:
        if metrics.exists():
            for line in metrics.read_text().splitlines():
                step = json.loads(line)["step"]
                if step not in samples:
                    samples[step] = cluster.tx_bytes(0)
        time.sleep(0.05)
    log.close()
    if proc.returncode:
        raise SystemExit(f"{variant} on {len(cluster.hosts)} hosts failed; see {log.name}")
    rows = {r["step"]: r for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r}
    first = first_steady or (args.freeze_step + 2 if variant == "onebit_lamb" else 3)  # after the freeze
    logged = sorted(rows)
    # each row covers the steps since the one before (--log-every); steady: wholly at or after `first`
    windows = [(prev, s) for prev, s in zip(logged, logged[1:]) if prev + 1 >= first and prev in samples and s in samples
               and (last_steady is None or s <= last_steady)]
    total_batch = args.micro_batch * cluster.ranks
    return {
        "variant": variant, "hosts": len(cluster.hosts), "link": args.current_rate,
        "step_s": statistics.median(total_batch / rows[s]["seq_per_s"] for _, s in windows),
        "seq_per_s": statistics.median(rows[s]["seq_per_s"] for _, s in windows),
        "bytes_metrics": statistics.median(rows[s]["bytes_sent"] for _, s in windows),
        # what a host's link sent (the mean over hosts of their ranks' bytes to other hosts), per step
        "node_bytes": statistics.median(rows[s].get("node_bytes_sent", rows[s]["bytes_sent"]) for _, s in windows),
        "bytes_interface": statistics.median((samples[s] - samples[prev]) / (s - prev) for prev, s in windows),
        "rounds": statistics.median(rows[s]["comm_rounds"] for _, s in windows),
        "steady_steps": sum(s - prev for prev, s in windows),
        "windows": windows,
    }


def table(results: list[dict]) -> str:
    """Two efficiencies: weak scaling against 1 host on the same link (on this machine it also
    pays for the hosts sharing its cores), and against the same hosts on an unlimited link,
    which isolates what the link costs; on a cluster, where hosts do not share compute, that is
    the weak-scaling efficiency the link allows."""
    one_host = {(r["variant"], r["link"]): r["seq_per_s"] for r in results if r["hosts"] == 1}
    unlimited = {(r["variant"], r["hosts"]): r["step_s"] for r in results if r["link"] == "unlimited"}
    header = ("| hosts | link | variant | step s | seq/s | weak scaling vs 1 host | vs unlimited link "
              "| bytes/step (metrics) | bytes/step (eth0) | eth0 / metrics |")
    lines = [header, "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        one = one_host.get((r["variant"], r["link"])) or one_host.get((r["variant"], "unlimited"))
        efficiency = f"{r['seq_per_s'] / (r['hosts'] * one):.0%}" if one else "-"
        fast = unlimited.get((r["variant"], r["hosts"]))
        link_efficiency = f"{fast / r['step_s']:.0%}" if fast and r["link"] != "unlimited" else "-"
        ratio = f"{r['bytes_interface'] / r['bytes_metrics']:.3f}" if r["bytes_metrics"] else "-"
        lines.append(f"| {r['hosts']} | {r['link']} | {r['variant']} | {r['step_s']:.2f} | {r['seq_per_s']:.2f} "
                     f"| {efficiency} | {link_efficiency} | {r['bytes_metrics']:,.0f} | {r['bytes_interface']:,.0f} "
                     f"| {ratio} |")
    step = {(r["variant"], r["hosts"], r["link"]): r["step_s"] for r in results}
    for (variant, hosts, link), seconds in sorted(step.items()):
        lamb = step.get(("lamb", hosts, link))
        if variant == "onebit_lamb" and lamb and hosts > 1:
            lines.append(f"\n{hosts} hosts, {link}: 1-bit LAMB's compression-stage step time is "
                         f"{seconds / lamb:.2f} of LAMB's")
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    links = sorted({r["link"] for r in results})
    fig, axes = plt.subplots(1, len(links), figsize=(5 * len(links), 4), squeeze=False)
    for ax, link in zip(axes[0], links):
        for variant in sorted({r["variant"] for r in results}):
            # one host sends nothing over its link: its unlimited run stands for every link
            points = sorted((r["hosts"], r["step_s"]) for r in results if r["variant"] == variant and (
                r["link"] == link or (r["hosts"] == 1 and r["link"] == "unlimited" and not any(
                    q["hosts"] == 1 and q["link"] == link and q["variant"] == variant for q in results))))
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=variant)
        ax.set(title=f"link: {link}", xlabel="hosts (1 rank each)", ylabel="step time (s)")
        ax.set_xticks(sorted({r["hosts"] for r in results}))
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--rates", nargs="+", default=["unlimited", "1gbit"])
    parser.add_argument("--variants", nargs="+", default=["lamb", "onebit_lamb", "lamb_bucketwise_clip"])
    parser.add_argument("--model", default="mini")
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--freeze-step", type=int, default=4)
    parser.add_argument("--work", help="directory for data, logs and runs (default: a temporary one)")
    parser.add_argument("--json")
    parser.add_argument("--markdown")
    parser.add_argument("--plot")
    args = parser.parse_args()
    work, data = set_up("slow_network.py", args.work)
    results = []
    for rate in args.rates:
        for hosts in args.hosts:
            if hosts == 1 and rate != "unlimited" and "unlimited" in args.rates:
                continue  # one host sends nothing over its link: the unlimited run's figures hold
            cluster = Cluster.up(work / f"cluster_{hosts}_{rate}", hosts, slots=1,
                                 rate=None if rate == "unlimited" else rate)
            try:
                args.current_rate = rate
                for variant in args.variants:
                    results.append(run_variant(cluster, data, work, variant, args))
                    print(json.dumps(results[-1]), flush=True)
            finally:
                cluster.down()
    print(f"\n{args.model} model, seq 128, micro-batch {args.micro_batch} per rank, 1 rank per host, "
          f"{args.steps} steps (1-bit LAMB freezes at {args.freeze_step}); medians of the steady steps\n")
    print(table(results))
    if args.markdown:
        Path(args.markdown).write_text(table(results) + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "current_rate"},
                                               "results": results}, indent=1))
    if args.plot:
        plot(results, Path(args.plot))


if __name__ == "__main__":
    main()
